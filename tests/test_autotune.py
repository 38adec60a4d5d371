"""§9.6: coordinate descent (Alg. 9.2, Prop. 9.2) and random search (Prop. 9.3) on
synthetic cost functions. No GPU, no triton."""

from __future__ import annotations

import hashlib
import itertools
import math
import random

import pytest

from conftest import run_outside_interpreter
from stax.autotune import (AutotuneError, SearchStats, coordinate_descent, random_search,
                           samples_for_quantile)

# ---- spaces and synthetic cost functions ----

SPACE = {
    "XBLOCK": [2 ** k for k in range(11)],      # 1 .. 1024
    "R0_BLOCK": [2 ** k for k in range(12)],    # 1 .. 2048
    "num_warps": [1, 2, 4, 8, 16, 32],
    "num_stages": [1, 2, 3, 4],                 # 3 has no x2 / /2 neighbour
}
SMALL = {"XBLOCK": [1, 2, 4, 8, 16, 32], "num_warps": [1, 2, 4, 8], "num_stages": [1, 2, 3, 4, 5]}


def unit(config, salt="") -> float:
    """A deterministic pseudo-random number in [0, 1) per configuration."""
    text = salt + repr(sorted(config.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") / 2 ** 64


def lg(config, name):
    return math.log2(config[name])


def bowl(c):
    return (1 + 0.5 * (lg(c, "XBLOCK") - 5) ** 2 + 0.3 * (lg(c, "R0_BLOCK") - 7) ** 2
            + 0.8 * (lg(c, "num_warps") - 2) ** 2 + 0.2 * (c["num_stages"] - 3) ** 2)


def plateaus(c):
    return (20 - math.floor(lg(c, "XBLOCK") / 3) - math.floor(lg(c, "R0_BLOCK") / 4)
            - 2 * (c["num_warps"] >= 8) + 0.5 * (c["num_stages"] == 4))


def ridge(c):
    # a long diagonal valley: progress needs alternating moves of XBLOCK and R0_BLOCK
    x, r = lg(c, "XBLOCK"), lg(c, "R0_BLOCK")
    return 1 + 0.2 * (x - r + 1) ** 2 + 0.1 * (x + r - 17) ** 2 + 0.05 * lg(c, "num_warps")


def holes(c):
    if c["XBLOCK"] * c["R0_BLOCK"] > 2 ** 12 or c["XBLOCK"] * c["num_warps"] > 2 ** 9:
        return math.inf                       # register limit
    if unit(c, "hole") < 0.1:
        return math.inf                       # fails to compile
    return bowl(c)


def rugged(c):
    return 1 + 99 * unit(c, "rugged")         # many local optima


LANDSCAPES = {"bowl": bowl, "plateaus": plateaus, "ridge": ridge, "holes": holes,
              "rugged": rugged}


def configs(space):
    names = list(space)
    for values in itertools.product(*(space[n] for n in names)):
        yield dict(zip(names, values))


_SUMMARIES = {}


def size_and_min(cost, space):
    """|Π| and t_min = min over Π of cost, by enumeration (cached)."""
    key = (cost, repr(space))
    if key not in _SUMMARIES:
        all_costs = [cost(c) for c in configs(space)]
        _SUMMARIES[key] = len(all_costs), min(all_costs)
    return _SUMMARIES[key]


def neighbours(c, space):
    """Every configuration that differs from c by a factor 2 in exactly one parameter."""
    for name, values in space.items():
        for v in values:
            if v == c[name] * 2 or v * 2 == c[name]:
                yield {**c, name: v}


def counting(cost):
    calls = []

    def wrapped(c):
        calls.append(dict(c))
        return cost(c)
    return wrapped, calls


def check_prop_9_2(start, cost, space, eps):
    """Run coordinate descent and check every claim of Prop. 9.2 and Alg. 9.2."""
    stats = SearchStats()
    wrapped, calls = counting(cost)
    result = coordinate_descent(start, wrapped, space, eps, stats=stats)

    size, t_min = size_and_min(cost, space)
    t0 = cost(start)
    bound = min(size, math.ceil(math.log(t0 / t_min) / -math.log(1 - eps)))
    assert stats.acceptances <= bound

    # the result is a local optimum
    t_res = cost(result)
    for nb in neighbours(result, space):
        assert cost(nb) >= (1 - eps) * t_res, (result, nb)

    # each move: one parameter x2 or /2, faster by more than the factor (1 - eps)
    traj = stats.trajectory
    assert traj[0] == (start, t0) and traj[-1] == (result, t_res)
    for (a, ta), (b, tb) in zip(traj, traj[1:]):
        changed = [n for n in space if a[n] != b[n]]
        assert len(changed) == 1 and b in list(neighbours(a, space)), (a, b)
        assert tb < (1 - eps) * ta and tb == cost(b)

    # each configuration measured once
    keys = [tuple(sorted(c.items())) for c in calls]
    assert len(keys) == len(set(keys)) == stats.evaluations
    return result, stats


def finite_starts(cost, space, k, seed):
    r = random.Random(seed)
    all_configs = list(configs(space))
    out = []
    while len(out) < k:
        c = r.choice(all_configs)
        if math.isfinite(cost(c)):
            out.append(c)
    return out


# ---- Prop. 9.2: bound on acceptances, local optimality ----

@pytest.mark.parametrize("eps", [1e-3, 0.05, 0.3])
@pytest.mark.parametrize("landscape", sorted(LANDSCAPES))
def test_prop_9_2_bound_and_local_optimum(landscape, eps):
    cost = LANDSCAPES[landscape]
    corner = {"XBLOCK": 1, "R0_BLOCK": 1, "num_warps": 1, "num_stages": 1}
    starts = [corner] + finite_starts(cost, SPACE, 6, seed=landscape)
    for start in starts:
        check_prop_9_2(start, cost, SPACE, eps)


def test_bowl_reaches_global_minimum_from_far_away():
    start = {"XBLOCK": 1024, "R0_BLOCK": 1, "num_warps": 32, "num_stages": 1}
    result, stats = check_prop_9_2(start, bowl, SPACE, 1e-3)
    assert result == {"XBLOCK": 32, "R0_BLOCK": 128, "num_warps": 4, "num_stages": 2}
    # 5 halvings of XBLOCK, 7 doublings of R0_BLOCK, 3 halvings of num_warps, 1 stage doubling
    assert stats.acceptances == 16


def test_ridge_needs_several_rounds():
    # one pass over the parameters is not enough in a diagonal valley: each round moves
    # XBLOCK and R0_BLOCK one step each, and the optimum is 8 steps away
    start = {"XBLOCK": 1, "R0_BLOCK": 2, "num_warps": 4, "num_stages": 1}
    result, stats = check_prop_9_2(start, ridge, SPACE, 1e-3)
    assert (result["XBLOCK"], result["R0_BLOCK"]) == (256, 512)
    assert stats.acceptances >= 16


def test_acceptance_needs_a_gain_of_more_than_eps():
    # each doubling is faster, but only by a factor (1 - 0.6 eps) or exactly (1 - eps):
    # no move may be accepted (a plain `t' < t` rule would walk all 20 steps, past the bound)
    eps = 0.01
    space = {"B": [2 ** k for k in range(21)]}
    for ratio in (1 - 0.6 * eps, 1 - eps):
        result, stats = check_prop_9_2({"B": 1}, lambda c: ratio ** lg(c, "B"), space, eps)
        assert result == {"B": 1} and stats.acceptances == 0
    # by more than (1 - eps): every step taken, down to the end of the chain
    result, stats = check_prop_9_2({"B": 1}, lambda c: (1 - 2 * eps) ** lg(c, "B"), space, eps)
    assert result == {"B": 2 ** 20} and stats.acceptances == 20


def test_halving_is_tried_and_values_keep_their_type():
    space = {"XBLOCK": [16, 32, 64, 128], "num_warps": [2, 4, 8]}
    result = coordinate_descent({"XBLOCK": 128, "num_warps": 8},
                                lambda c: c["XBLOCK"] * c["num_warps"], space)
    assert result == {"XBLOCK": 16, "num_warps": 2}
    assert all(type(v) is int for v in result.values())


def test_inf_holes_are_never_chosen_and_a_start_in_a_hole_walks_out():
    space = {"XBLOCK": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4]}

    def cost(c):
        return math.inf if c["XBLOCK"] >= 8 else 10.0 / c["XBLOCK"] / c["num_warps"]
    assert coordinate_descent({"XBLOCK": 2, "num_warps": 1}, cost, space) == \
        {"XBLOCK": 4, "num_warps": 4}
    # from an invalid start, the first finite neighbour is an improvement
    assert coordinate_descent({"XBLOCK": 8, "num_warps": 1}, cost, space) == \
        {"XBLOCK": 4, "num_warps": 4}


def test_extra_keys_pass_through_and_start_is_not_mutated():
    start = {"XBLOCK": 4, "num_warps": 4, "num_stages": 1, "kind": "persistent"}
    seen = []

    def cost(c):
        seen.append(c["kind"])
        return 1.0 / c["XBLOCK"]
    before = dict(start)
    result = coordinate_descent(start, cost, SMALL)
    assert start == before
    assert result["kind"] == "persistent" and set(seen) == {"persistent"}
    assert result["XBLOCK"] == 32


def test_bad_arguments():
    with pytest.raises(ValueError, match="not in space"):
        coordinate_descent({"XBLOCK": 3, "num_warps": 1, "num_stages": 1}, bowl, SMALL)
    with pytest.raises(ValueError, match="no value"):
        coordinate_descent({"XBLOCK": 2}, bowl, SMALL)
    with pytest.raises(ValueError, match="eps"):
        coordinate_descent({"XBLOCK": 2, "num_warps": 1, "num_stages": 1}, bowl, SMALL, eps=0)
    with pytest.raises(ValueError, match="repeats"):
        random_search({"XBLOCK": [1, 1, 2]}, lambda c: 1.0, 5, random.Random(0))
    with pytest.raises(ValueError, match="n >= 1"):
        random_search(SMALL, lambda c: 1.0, 0, random.Random(0))
    with pytest.raises(ValueError, match="cost"):
        coordinate_descent({"XBLOCK": 2, "num_warps": 1, "num_stages": 1},
                           lambda c: math.nan, SMALL)


# ---- Prop. 9.2 under noise: eps > 2 eta/(1 + eta) makes every acceptance real ----

def noisy(cost, eta_max, seed):
    """Multiplicative noise |eta| <= eta_max, fresh at every measurement, often at the extremes."""
    r = random.Random(seed)

    def measured(c):
        eta = r.choice([-eta_max, eta_max, r.uniform(-eta_max, eta_max)])
        return cost(c) * (1 + eta)
    return measured


def fake_improvements(landscape, eta_max, eps, trials):
    """Accepted moves that were not real improvements of the noiseless cost."""
    fakes = moves = 0
    for seed in range(trials):
        for start in finite_starts(landscape, SPACE, 3, seed=f"noise{seed}"):
            stats = SearchStats()
            coordinate_descent(start, noisy(landscape, eta_max, seed), SPACE, eps, stats=stats)
            traj = [c for c, _ in stats.trajectory]
            assert len({tuple(sorted(c.items())) for c in traj}) == len(traj)  # no revisits
            for a, b in zip(traj, traj[1:]):
                moves += 1
                fakes += not landscape(b) < landscape(a)
    return fakes, moves


def flat(c):
    # near-ties everywhere: neighbours differ by far less than the noise
    return 1 + 0.02 * unit(c, "flat")


@pytest.mark.parametrize("eta_max", [0.01, 0.05, 0.2])
@pytest.mark.parametrize("landscape", [flat, rugged, plateaus], ids=lambda f: f.__name__)
def test_noise_every_acceptance_is_a_real_improvement(landscape, eta_max):
    eps = 2 * eta_max / (1 + eta_max) * 1.001
    fakes, moves = fake_improvements(landscape, eta_max, eps, trials=4)
    assert fakes == 0
    if landscape is not flat:
        assert moves > 0


def test_noise_below_the_threshold_does_fool_the_descent():
    # the same experiment with eps under the threshold accepts moves that are not improvements:
    # the condition of the proposition is what the test above relies on
    eta_max = 0.05
    fakes, moves = fake_improvements(flat, eta_max, eps=1e-3, trials=4)
    assert fakes > 0


# ---- Prop. 9.3: quantile guarantee of random search ----

def test_samples_for_quantile():
    assert samples_for_quantile() == 60
    assert samples_for_quantile(0.05, 0.05) == 60
    assert samples_for_quantile(1.0, 0.5) == 1
    for q in (0.01, 0.05, 0.1, 0.3, 1.0):
        for delta in (0.001, 0.01, 0.05, 0.2, 0.9):
            n = samples_for_quantile(q, delta)
            assert (1 - q) ** n <= delta                            # enough
            assert n == 1 or math.exp(-q * (n - 1)) > delta          # and the smallest such N
    for bad in ((0, 0.05), (1.5, 0.05), (0.05, 0), (0.05, 1)):
        with pytest.raises(ValueError):
            samples_for_quantile(*bad)


QSPACE = {"XBLOCK": [1, 2, 4, 8, 16], "R0_BLOCK": [8, 16, 32, 64], "num_warps": [1, 2, 4, 8, 16, 32]}


def _quantile_time(c):
    if unit(c, "qhole") < 0.15:
        return math.inf
    return float(1 + int(40 * unit(c, "q")))   # integer times: many ties


_QTABLE = {tuple(c.values()): _quantile_time(c) for c in configs(QSPACE)}


def quantile_cost(c):
    return _QTABLE[tuple(c[n] for n in QSPACE)]


def good_set(cost, space, q):
    """G_q = {c : t(c) <= t_q}, t_q the ceil(q|Π|)-th fastest time."""
    all_configs = list(configs(space))
    times = sorted(cost(c) for c in all_configs)
    t_q = times[math.ceil(q * len(times)) - 1]
    return {tuple(sorted(c.items())) for c in all_configs if cost(c) <= t_q}


@pytest.mark.parametrize("q, n", [(0.05, 10), (0.05, 60), (0.2, 3), (0.1, 1)])
def test_prop_9_3_quantile_guarantee(q, n):
    good = good_set(quantile_cost, QSPACE, q)
    trials = 1500
    hits = 0
    for seed in range(trials):
        try:
            c = random_search(QSPACE, quantile_cost, n, random.Random(seed))
        except AutotuneError:       # every sample invalid: a miss
            continue
        hits += tuple(sorted(c.items())) in good
    p = 1 - (1 - q) ** n
    slack = 4 * math.sqrt(p * (1 - p) / trials) + 1 / trials
    assert hits / trials >= p - slack, (hits / trials, p)


def test_random_search_returns_the_fastest_sample_first_on_ties():
    wrapped, calls = counting(quantile_cost)
    stats = SearchStats()
    result = random_search(QSPACE, wrapped, 30, random.Random(7), stats=stats)
    finite = [c for c in calls if math.isfinite(quantile_cost(c))]
    t_best = min(quantile_cost(c) for c in finite)
    assert result == next(c for c in calls if quantile_cost(c) == t_best)
    assert stats.cost == t_best and stats.config == result

    wrapped, calls = counting(lambda c: 1.0)
    assert random_search(QSPACE, wrapped, 10, random.Random(3)) == calls[0]


def test_random_search_draws_uniformly_with_replacement():
    space = {"a": [1, 2, 3], "b": [10, 20]}
    trials = 3000
    counts = {}
    repeats = 0
    for seed in range(trials):
        wrapped, calls = counting(lambda c: 1.0)
        stats = SearchStats()
        c = random_search(space, wrapped, 1, random.Random(seed))
        key = tuple(sorted(c.items()))
        counts[key] = counts.get(key, 0) + 1
        # with replacement: 6 draws from 6 configurations usually repeat one
        stats = SearchStats()
        random_search(space, lambda c: 1.0, 6, random.Random(seed), stats=stats)
        repeats += stats.evaluations < 6
    assert len(counts) == 6
    expected = trials / 6
    for k, v in counts.items():
        assert abs(v - expected) < 5 * math.sqrt(expected), counts
    assert repeats / trials > 0.9                      # 1 - 6!/6^6 = 0.985


def test_random_search_is_reproducible_and_memoized():
    a = random_search(QSPACE, quantile_cost, 40, random.Random(11))
    b = random_search(QSPACE, quantile_cost, 40, random.Random(11))
    assert a == b
    wrapped, calls = counting(lambda c: float(c["a"]))
    stats = SearchStats()
    random_search({"a": [1, 2]}, wrapped, 50, random.Random(0), stats=stats)
    assert len(calls) == stats.evaluations == 2


# ---- every configuration invalid ----

def test_all_inf_is_an_error():
    inf = lambda c: math.inf  # noqa: E731
    with pytest.raises(AutotuneError, match="no valid configuration"):
        random_search(QSPACE, inf, 20, random.Random(0))
    with pytest.raises(AutotuneError, match="no valid configuration"):
        coordinate_descent({"XBLOCK": 2, "num_warps": 1, "num_stages": 1}, inf, SMALL)


# ---- Algorithm 9.1 in the kernel launcher, triton_heuristics.py (the GPU measurement is replaced by a fake) ----


def _fake_kernel(monkeypatch, tmp_path, times):
    """A CachingAutotuner whose 'measurements' come from `times` (config -> ms), on a fake H200."""
    from types import SimpleNamespace
    from stax import cuda, triton_heuristics as th
    monkeypatch.setenv("STAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda, "get_device_properties", lambda: SimpleNamespace(name="fake H200", cc=(9, 0)))
    monkeypatch.setattr(th, "_triton_version", lambda: "3.6.0")
    monkeypatch.setattr(th, "_RECORDS", {})
    src = "def triton_poi_fused_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):\n    pass\n"
    k = th.CachingAutotuner("triton_poi_fused_0", "pointwise", {"x": 1 << 24},
                            {"in_ptr0": "*fp32", "out_ptr0": "*fp32", "xnumel": "i32"}, source=src)
    measured = []

    def measure(cfg, numels, args):
        measured.append(cfg)
        return times(cfg)
    monkeypatch.setattr(k, "_measure", measure)
    monkeypatch.setattr(k, "_protect", lambda args: [])
    monkeypatch.setattr(k, "_restore", lambda saved: None)
    return k, measured


def test_algorithm_9_1_measures_once_then_reads_the_record(monkeypatch, tmp_path):
    from stax import autotune as at
    numels = {"xnumel": 1 << 24}
    fastest = {"XBLOCK": 2048, "num_warps": 8, "num_stages": 1}
    k, measured = _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0 if c == fastest else 2.0)
    assert k._autotune(numels, ()) == fastest
    assert measured == at.candidates("pointwise", numels)          # every candidate, once
    assert list((tmp_path / "autotune").glob("triton_poi_fused_*.json"))
    # a second process: nothing in memory, the record on disk; nothing is measured
    k2, measured2 = _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0)
    assert k2._autotune(numels, ()) == fastest and measured2 == []


def test_a_record_is_for_the_sizes_it_was_measured_at(monkeypatch, tmp_path):
    """§10.3: one text of symbolic sizes runs at many sizes; its record is the choice at the size
    it was tuned at, so the same text first launched at another size is measured again."""
    big, small = {"XBLOCK": 2048, "num_warps": 8, "num_stages": 1}, {"XBLOCK": 1024, "num_warps": 4, "num_stages": 1}
    k, _ = _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0 if c == big else 2.0)
    assert k._autotune({"xnumel": 1 << 24}, ()) == big
    k2, measured = _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0 if c == small else 2.0)
    assert k2._autotune({"xnumel": 1 << 23}, ()) == small and measured
    k3, measured = _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0)
    assert k3._autotune({"xnumel": 1 << 24}, ()) == big and measured == []


def test_failing_or_spilling_candidates_are_never_chosen(monkeypatch, tmp_path):
    numels = {"xnumel": 1 << 24}
    # inf is what _measure returns for a candidate that fails to compile or spills registers
    k, _ = _fake_kernel(monkeypatch, tmp_path, lambda c: math.inf if c["XBLOCK"] >= 2048 else 0.5 + c["num_warps"] / 100)
    chosen = k._autotune(numels, ())
    assert chosen["XBLOCK"] < 2048
    k, _ = _fake_kernel(monkeypatch, tmp_path / "b", lambda c: math.inf)
    with pytest.raises(AutotuneError, match="failed to compile or spilled"):
        k._autotune(numels, ())


def test_a_small_local_frame_is_measured_a_spill_is_not(monkeypatch):
    """libdevice's sin/cos keep 32 bytes of stack in every configuration: such a candidate is
    timed; one whose local memory is a register spill (past LOCAL_FRAME_BYTES) costs inf."""
    from types import SimpleNamespace
    from stax import cuda, triton_heuristics as th
    src = "def triton_poi_fused_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):\n    pass\n"
    k = th.CachingAutotuner("triton_poi_fused_0", "pointwise", {"x": 1 << 20},
                            {"in_ptr0": "*fp32", "out_ptr0": "*fp32", "xnumel": "i32"}, source=src)
    local = [0]
    monkeypatch.setattr(k, "_launcher", lambda cfg, aligned, args: SimpleNamespace(
        kernel=SimpleNamespace(local_size_bytes=local[0])))
    monkeypatch.setattr(cuda, "median_ms", lambda run, cold=False: 0.25)
    cfg, numels = {"XBLOCK": 1024, "num_warps": 4, "num_stages": 1}, {"xnumel": 1 << 20}
    for size, want in ((0, 0.25), (32, 0.25), (th.LOCAL_FRAME_BYTES, 0.25), (th.LOCAL_FRAME_BYTES + 8, math.inf)):
        local[0] = size
        assert k._measure(cfg, numels, [16, 32, 1 << 20]) == want, size


def test_max_autotune_runs_coordinate_descent_from_the_best_candidate(monkeypatch, tmp_path):
    numels = {"xnumel": 1 << 24}
    # a bowl in log2 space with its minimum outside the candidate set
    cost = lambda c: 1 + abs(math.log2(c["XBLOCK"]) - 13) + abs(math.log2(c["num_warps"]) - 4) + c["num_stages"]  # noqa: E731
    k, _ = _fake_kernel(monkeypatch, tmp_path, cost)
    k.mode = "max-autotune"
    chosen = k._autotune(numels, ())
    assert chosen == {"XBLOCK": 8192, "num_warps": 16, "num_stages": 1}
    k, _ = _fake_kernel(monkeypatch, tmp_path / "r", cost)
    k.mode, k.options = "max-autotune", {"autotune_search": "random"}
    best_candidate = min(cost(c) for c in __import__("stax").autotune.candidates("pointwise", numels))
    assert cost(k._autotune(numels, ())) <= best_candidate


def test_autotune_off_runs_the_heuristic_default(monkeypatch, tmp_path):
    from stax import autotune as at
    numels = {"xnumel": 1 << 24}
    k, measured = _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0)
    k.options = {"autotune": False}
    assert k._autotune(numels, ()) == at.default_config("pointwise", numels) and measured == []


def test_kernels_of_a_few_microseconds_run_the_default_unmeasured(monkeypatch, tmp_path):
    """Tuning costs ~0.1 s per candidate: a kernel whose memory floor is under SMALL_KERNEL_MS
    (1M floats in, 1M out: about 3 µs) runs the heuristic default; max-autotune still searches."""
    from stax import autotune as at
    numels = {"xnumel": 1 << 20}
    k, measured = _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0)
    assert k._floor_ms(numels) < at.SMALL_KERNEL_MS
    assert k._autotune(numels, ()) == at.default_config("pointwise", numels) and measured == []
    k.mode = "max-autotune"
    k._autotune(numels, ())
    assert measured



def test_kernels_that_differ_only_in_name_share_one_record_and_one_cubin(monkeypatch, tmp_path):
    """Issue 14: the MLP block's four layers print four copies of one kernel under four names (and
    four comments naming their graph nodes). The copies share Alg. 9.1's record (the second one
    measures nothing) and the cubin cache's entries; any other difference in the text keeps them
    apart."""
    from stax import triton_heuristics as th
    numels = {"xnumel": 1 << 24}
    k, measured = _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0 if c["XBLOCK"] == 1024 else 2.0)
    chosen = k._autotune(numels, ())
    text = "# {0}: computes add_{1}, mul_{1}\ndef {0}(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):\n    pass\n"
    copy = th.CachingAutotuner("triton_poi_fused_3", "pointwise", dict(k.size_hints), dict(k.signature),
                               source=text.format("triton_poi_fused_3", 3))
    first = th.CachingAutotuner("triton_poi_fused_0", "pointwise", dict(k.size_hints), dict(k.signature),
                                source=text.format("triton_poi_fused_0", 0))
    assert copy.text_key == first.text_key == k.text_key
    copy.mode, copy.options = k.mode, k.options
    monkeypatch.setattr(copy, "_measure", lambda *a: pytest.fail("a copy's candidates were measured"))
    assert copy._autotune(numels, ()) == chosen and len(measured) > 1
    # the name counts only as a whole word; the body and the signature count everywhere
    assert th.shared_text("k_1", "def k_1(x):\n    k_12(x)\n") != th.shared_text("k_2", "def k_2(x):\n    k_22(x)\n")
    other = th.CachingAutotuner("triton_poi_fused_5", "pointwise", dict(k.size_hints), dict(k.signature),
                                source=text.format("triton_poi_fused_5", 5).replace("pass", "return"))
    assert other.text_key != first.text_key
    assert th._family("triton_per_fused_12") == "triton_per_fused" and th._family("k") == "k"



def test_a_launch_bound_gemm_of_few_rows_runs_its_default_unmeasured(monkeypatch, tmp_path):
    """Issue 14: the MLP block's GEMM (8 x 1024 x 1024 bf16, 2 MB: 0.7 µs at the bandwidth) is
    shorter than a launch's host time, so timing its candidates back to back times the host; its
    default (the deepest pipeline) runs, as a generated kernel of a few µs runs its own. 17 rows,
    or 16 rows whose B takes longer than a launch to stream, are measured; max-autotune searches."""
    from stax import template_tuning as tt, triton_heuristics as th
    _fake_kernel(monkeypatch, tmp_path, lambda c: 1.0)      # (a fake H200, an empty cache)
    gemm = th.CachingAutotuner("triton_tem_fused_mm_0", "template", {"b": 1, "m": 8, "n": 1024, "k": 1024},
                               {"in_ptr0": "*bf16", "in_ptr1": "*bf16", "out_ptr0": "*bf16"},
                               source="def triton_tem_fused_mm_0(in_ptr0, in_ptr1, out_ptr0):\n    pass\n",
                               meta={"itemsize": 2, "tuning_key": "mm 8x1024x1024"})
    times = []
    monkeypatch.setattr(gemm, "_measure", lambda cfg, numels, args: times.append(cfg) or 1.0 + len(times))
    monkeypatch.setattr(gemm, "_protect", lambda args: [])
    monkeypatch.setattr(gemm, "_restore", lambda saved: None)
    mlp = {"bnumel": 1, "mnumel": 8, "nnumel": 1024, "knumel": 1024, "itemsize": 2, "tuning_key": "a"}
    assert tt.launch_bound(mlp) and gemm._autotune(mlp, ()) == th.default_config("template", mlp) and times == []
    for shape in ({"mnumel": 17}, {"mnumel": 16, "nnumel": 4096, "knumel": 4096}):
        numels = {**mlp, **shape, "tuning_key": repr(shape)}
        assert not tt.launch_bound(numels)
        times.clear()
        gemm._autotune(numels, ())
        assert times == th.candidates("template", numels)
    gemm.mode, times[:] = "max-autotune", []
    gemm._autotune({**mlp, "tuning_key": "b"}, ())
    assert len(times) > len(th.candidates("template", mlp))

_PRECOMPILE = """
import json, sys, threading
from types import SimpleNamespace
import stax
from stax import cuda, cuda_triton, triton_heuristics as th
cuda.get_device_properties = lambda: SimpleNamespace(name="fake H200", cc=(9, 0))
gen = stax.generate(lambda x: x * 2 + 1, stax.randn(4096), device="cuda")
(name, source), = gen.kernels.items()
k = th.kernel_from_source(name, source)
cands = th.candidates(k.kind, {"xnumel": 4096})[:4]
bad, built, real = cands[-1], [], cuda_triton.compile_triton

def compile_triton(fn, signature, constexprs, **kw):
    built.append(threading.current_thread().name)
    if (constexprs, kw["num_warps"], kw["num_stages"]) == (
            {x: v for x, v in bad.items() if x.isupper()}, bad["num_warps"], bad["num_stages"]):
        raise RuntimeError("this candidate does not compile")
    return real(fn, signature, constexprs, **kw)
cuda_triton.compile_triton = compile_triton
ptr = SimpleNamespace(data_ptr=lambda: 1 << 20)
args = (ptr, ptr, 4096)
k._precompile(cands, args)
out = {"name": name, "n": len(cands), "threads": list(built), "threads_default": th.compile_threads()}
built.clear()
out["elf"] = [k._build(c, True, k._divs(args))[0][:4] == b"\\x7fELF" for c in cands[:-1]]
out["rebuilt"] = list(built)
try:
    k._build(bad, True, k._divs(args))
except RuntimeError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def test_candidates_are_built_side_by_side_then_loaded_from_the_cubin_cache(tmp_path):
    """`_precompile`: a kernel's candidates compile for sm_90 in threads (no GPU needed) before
    Algorithm 9.1 measures them one by one; each cubin lands in the cache where `_build` then finds
    it (nothing compiles twice), and a candidate that fails is left for `_compile` to raise. (In a
    process of its own: this session's triton runs as the interpreter.)"""
    pytest.importorskip("triton")
    out = run_outside_interpreter(_PRECOMPILE, env=dict(STAX_CACHE_DIR=str(tmp_path), STAX_COMPILE_THREADS="3"))
    assert out["n"] >= 2 and len(out["threads"]) == out["n"] and out["threads_default"] == 3
    assert all(t.startswith("stax-compile") for t in out["threads"])
    assert len(list((tmp_path / "cubin").glob(f"{out['name'].rsplit('_', 1)[0]}_*.bin"))) == out["n"] - 1
    assert out["elf"] == [True] * (out["n"] - 1) and out["rebuilt"] == []
    assert out["error"] == "this candidate does not compile"


def test_a_flat_kernel_of_two_blocks_a_program_keeps_that_form_among_its_capped_candidates():
    """§9.6: XUNROLL 2 (triton_kernel._two_blocks) is measured, not cut by MAX_CANDIDATES: the
    first H200 run of the exact GELU measured eight one-block forms and none of the three."""
    from stax.autotune import MAX_CANDIDATES, candidates
    cands = candidates("pointwise", {"xnumel": 64 << 20, "xunroll": 1})
    assert len(cands) <= MAX_CANDIDATES and cands[0]["XUNROLL"] == 1
    assert sum(c["XUNROLL"] == 2 for c in cands) == 3, cands
    assert all("XUNROLL" not in c for c in candidates("pointwise", {"xnumel": 64 << 20}))
