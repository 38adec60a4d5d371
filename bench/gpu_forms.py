"""Rows read by several passes (softmax, layer_norm): the persistent form against the looped one (§9.4).

Run on the GPU: `python bench/gpu_forms.py`. A multi-pass row of 1024 < n ≤ 32768 gets both
forms, and `multi_kernel_N` measures which is faster at the first launch. For each row length this
compiles the function three times: the persistent kernel forced, the looped one forced, and the
measured choice; each is autotuned (Algorithm 9.1) and timed against the memory floor.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stax  # noqa: E402
from stax import cuda, triton_heuristics  # noqa: E402
from gpu import copy_bandwidth, time_calls  # noqa: E402

CASES = [
    ("layernorm", lambda x, w, b: stax.layer_norm(x, (x.shape[-1],), w, b), 65536, 4096),
    ("layernorm", lambda x, w, b: stax.layer_norm(x, (x.shape[-1],), w, b), 16384, 16384),
    ("softmax", lambda x, w, b: stax.softmax(x, -1), 65536, 2048),
    ("softmax", lambda x, w, b: stax.softmax(x, -1), 65536, 4096),
    ("softmax", lambda x, w, b: stax.softmax(x, -1), 16384, 16384),
    ("softmax", lambda x, w, b: stax.softmax(x, -1), 4096, 32768),
]


def main():
    bw = copy_bandwidth()
    measured = triton_heuristics.MultiKernel._choose
    forced = {"persistent": lambda self, args: self.kernels[0], "looped": lambda self, args: self.kernels[1],
              "measured": measured}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| workload | rows × row | persistent ms (frac) | looped ms (frac) | measured choice ms (frac) | configs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, fn, rows, n in CASES:
        args = [stax.randn(rows, n, device="cuda"), stax.randn(n, device="cuda"), stax.randn(n, device="cuda")]
        nbytes = 2 * rows * n * 4 + (2 * n * 4 if name == "layernorm" else 0)
        floor = nbytes / bw * 1e3
        cells, configs, ref = [], [], None
        for form, choose in forced.items():
            os.environ["STAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="stax-forms-")
            triton_heuristics.MultiKernel._choose = choose
            f = stax.compile(fn)
            host = f(*args).cpu().numpy()
            ref = host if ref is None else ref
            assert abs(host - ref).max() < 1e-4, (name, form)
            multi = [v for k, v in f.artifacts[next(iter(f.artifacts))][0].__globals__.items()
                     if k.startswith("multi_kernel")]
            chosen = multi[0].chosen if multi else None
            ms = time_calls(f, args)
            cells.append(f"{ms:.3f} ({floor / ms:.2f})")
            configs.append(f"{form}: {chosen.name if chosen else '-'} {chosen.config if chosen else ''}")
        triton_heuristics.MultiKernel._choose = measured
        print(f"| {name} | {rows}×{n} | {' | '.join(cells)} | {'; '.join(configs)} |", flush=True)
        del args


if __name__ == "__main__":
    main()
