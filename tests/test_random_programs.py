"""Random programs (tests/randprog.py), compiled on the CPU and through the Triton back end,
against a float64 reference (issue 9).

CI runs STAX_RANDPROG_N programs (default 200) from seed STAX_RANDPROG_SEED (default 0), each on
both devices; on a machine without a GPU the Triton kernels run in the interpreter, and every
kernel they generate is built for sm_90 by tests/test_zz_sm90.py (conftest records it). The
count shows in the test's id and in pytest's summary ("random programs: N run, F failed").
More on demand:

    STAX_RANDPROG_N=5000 python -m pytest tests/test_random_programs.py
    python tests/randprog.py --n 5000 --device cuda --sm90     # a table, reproducers
"""
import os

import pytest

import conftest
import randprog

N = int(os.environ.get("STAX_RANDPROG_N", "200"))
SEED = int(os.environ.get("STAX_RANDPROG_SEED", "0"))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("n", [N], ids=lambda n: f"{n}-programs")
def test_random_programs(device, n):
    counts, failures = randprog.run_many(range(SEED, SEED + n), [device], stream=open(os.devnull, "w"))
    c = counts[device]
    conftest.REPORT_LINES.append(
        f"random programs on {device}: {n} run, {c['fail']} failed ({c['ok']} equal to the float64 "
        f"reference, {c['ok-half']} half-precision ones within rounding, "
        f"{c['eager-error']} raising in both)")
    report = "\n\n".join(f"seed {p.seed} on {d}:\n{p.source}# inputs: {p.inputs}\n{detail[:3000]}"
                         for p, d, detail in failures[:10])
    assert not failures, (f"{len(failures)} of {n} random programs failed on {device} "
                          f"(rerun one: python tests/randprog.py --seeds S --device {device}):\n{report}")


def test_generator_is_deterministic():
    assert randprog.write_program(7).source == randprog.write_program(7).source
    prog = randprog.write_program(7)
    a = [t.numpy() if t.dtype.name != "bfloat16" else t.float().numpy() for t in prog.make_inputs()]
    b = [t.numpy() if t.dtype.name != "bfloat16" else t.float().numpy() for t in prog.make_inputs()]
    assert all((x == y).all() for x, y in zip(a, b))
