"""Every Triton kernel the test session generated builds for sm_90 (issue 3's CI check).

conftest.py records each kernel text `codegen_triton.generate` prints during the session; this
file is named to run last, and builds each of them for sm_90 in its heuristic default
configuration, on a machine without a GPU too. (tests/test_gpu.py builds the chapter's examples in
every candidate configuration.) Run alone, it checks only the kernels its own session generated.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import conftest

SCRIPT = """
import json, sys, traceback
from stax.triton_heuristics import kernel_from_source
failed = {}
for path in sys.argv[1:]:
    name, source = json.loads(open(path).read())
    try:
        cubin, info, _ = kernel_from_source(name, source).compile_for(90)
        assert cubin[:4] == b"\\x7fELF"
    except Exception:
        failed[path] = traceback.format_exc(limit=3)[-1500:]
print(json.dumps(failed))
"""


def test_every_generated_kernel_builds_for_sm90(tmp_path):
    kernels = list(conftest.GENERATED_TRITON_KERNELS.items())
    if not kernels:
        pytest.skip("no Triton kernel was generated in this session")
    paths = []
    for i, (source, name) in enumerate(kernels):
        path = tmp_path / f"{i}_{name}.json"
        path.write_text(json.dumps([name, source]))
        paths.append(str(path))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    workers = max(1, min(4, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, *paths[w::workers]], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent)
             for w in range(workers)]
    failed = {}
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
        failed.update(json.loads(out.strip().splitlines()[-1]))
    report = "\n\n".join(f"{Path(k).name}:\n{json.loads(Path(k).read_text())[1]}\n{v}" for k, v in failed.items())
    assert not failed, f"{len(failed)} of {len(kernels)} kernels failed to build for sm_90:\n{report}"
