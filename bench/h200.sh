#!/usr/bin/env bash
# The H200 session script: GPU tests and benchmarks in a few batched phases, logs under $OUT.
#   bash bench/h200.sh tests    # the GPU-facing test files on the real device (~8 min)
#   bash bench/h200.sh tests-par # the same files in six processes at once (about 5 min)
#   bash bench/h200.sh bench    # bench/gpu.py: memory-bound workloads, reductions, indexing, matmuls, convs
#   bash bench/h200.sh extra    # launch-bound (CUDA graphs), attention, AdamW, training steps, dynamic vs static
# Needs cffi + pycparser wheels for the device's Python in .whl/ (see the device tool's notes).
set -u
OUT="${OUT:-/tmp/stax-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD STAX_CACHE_DIR=/tmp/stax-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
case "${1:-tests}" in
tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider --maxfail=30 \
        tests/test_gpu.py tests/test_gpu_reductions.py tests/test_cudagraph.py tests/test_cudagraph_training.py tests/test_attention.py \
        tests/test_templates.py tests/test_conv.py tests/test_indexing.py tests/test_optim.py \
        tests/test_auto_dynamic.py tests/test_soundness_guards.py tests/test_export.py \
        tests/test_data_dependent.py tests/test_bucketing.py tests/test_functional.py tests/test_ops_more.py \
        tests/test_training.py tests/test_dynamic.py tests/test_scans.py tests/test_float_scalars.py \
        tests/test_fused_reductions.py ${STAX_H200_SKIP:+--deselect $STAX_H200_SKIP} \
        > "$OUT/tests.log" 2>&1
    tail -30 "$OUT/tests.log";;
tests-par)
    # the same files in six pytest processes at once (16 host cores: Triton's compiles dominate)
    groups=("tests/test_gpu.py tests/test_conv.py tests/test_optim.py tests/test_export.py"
            "tests/test_gpu_reductions.py tests/test_cudagraph.py tests/test_cudagraph_training.py tests/test_indexing.py tests/test_bucketing.py"
            "tests/test_attention.py"
            "tests/test_templates.py tests/test_auto_dynamic.py tests/test_data_dependent.py"
            "tests/test_soundness_guards.py tests/test_functional.py tests/test_ops_more.py tests/test_scans.py"
            "tests/test_training.py tests/test_dynamic_training.py tests/test_dynamic.py tests/test_float_scalars.py tests/test_fused_reductions.py ${STAX_H200_EXTRA:-}")
    i=0
    for g in "${groups[@]}"; do
        STAX_CACHE_DIR=/tmp/stax-cache-$i timeout "${STAX_H200_LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider \
            --maxfail=30 $g ${STAX_H200_SKIP:+--deselect $STAX_H200_SKIP} > "$OUT/tests$i.log" 2>&1 &
        i=$((i + 1))
    done
    wait
    for j in $(seq 0 $((i - 1))); do echo "== group $j"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests$j.log" | tail -12; done;;
bench)
    timeout 580 python3 bench/gpu.py --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    tail -80 "$OUT/bench.log";;
extra)
    timeout 150 python3 bench/gpu.py launchbound --json "$OUT/launch.json" > "$OUT/launch.log" 2>&1
    timeout 200 python3 bench/gpu.py attention --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1
    timeout 60 python3 bench/gpu.py adamw --json "$OUT/adamw.json" > "$OUT/adamw.log" 2>&1
    timeout 240 python3 bench/gpu.py train --json "$OUT/train.json" > "$OUT/train.log" 2>&1
    timeout 150 python3 bench/gpu.py --dynamic ex1_1 softmax layernorm colsum --json "$OUT/dynamic.json" > "$OUT/dynamic.log" 2>&1
    for f in launch attention adamw train dynamic; do echo "== $f"; tail -25 "$OUT/$f.log"; done;;
changed)
    # what this session changed, measured: dynamic vs static, TF32, launch-bound, training, AdamW
    timeout 150 python3 bench/gpu.py --dynamic ex1_1 softmax layernorm colsum --json "$OUT/dynamic.json" > "$OUT/dynamic.log" 2>&1
    timeout 90 python3 bench/gpu.py mm_fp32_high mm_fp32 --json "$OUT/mm.json" > "$OUT/mm.log" 2>&1
    timeout 120 python3 bench/gpu.py launchbound --json "$OUT/launch.json" > "$OUT/launch.log" 2>&1
    timeout 150 python3 bench/gpu.py train --json "$OUT/train.json" > "$OUT/train.log" 2>&1
    timeout 60 python3 bench/gpu.py adamw --json "$OUT/adamw.json" > "$OUT/adamw.log" 2>&1
    for f in dynamic mm launch train adamw; do echo "== $f"; grep "^|" "$OUT/$f.log" | tail -12; done;;
esac
