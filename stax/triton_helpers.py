"""Device functions that generated Triton kernels call (the GPU counterpart of cpp_prelude.h).

Layer: leaf, imported only by kernel files (triton_heuristics.HEADER), never by Stax's own modules;
it imports triton at import time. Chapter: §9.1–9.5 (the functions the listings call).

Kernels print `triton_helpers.max2(tmp4, 1)`, `triton_helpers.maximum(a, b)`, `libdevice.exp(x)`:
this module defines them. Max and min propagate NaN as eager does (Triton's `tl.max` does not).
`libdevice` is Triton's CUDA libdevice, except under `TRITON_INTERPRET=1`, where libdevice calls
return None, so the same names map to `tl` functions the interpreter implements.

Where to look: `maximum`/`minimum` (NaN-propagating), `max2`/`min2`/`prod` (row reductions),
`max_with_index`/`min_with_index` (argmax/argmin: first index wins ties, NaN counts as largest),
`floordiv`/`remainder` (Python signs), `cumsum`/`cumprod`/`logcumsumexp`/`cummax`/`cummin` (block scans along a dim,
`tl.associative_scan`) and `logaddexp` (their carry's combine), `last_arrival` (the one-kernel split's
counter, §6.5), `libdevice`.
"""
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# ---- libdevice, or its interpreter stand-in ----

@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _nearbyint(x):
    r = tl.floor(x + 0.5)
    half = r * 0.5
    return tl.where(((r - x) == 0.5) & (tl.floor(half) != half), r - 1.0, r)


@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def _pow(a, b):
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = tl.floor(b) == b
    odd = whole & ((tl.floor(b * 0.5) * 2.0) != b)
    signed = tl.where(a < 0, tl.where(whole, tl.where(odd, -mag, mag), float("nan")), mag)
    return tl.where(b == 0, 1.0, signed)


@triton.jit
def _log1p(x):
    # log(u) * x / (u - 1) with u = 1 + x cancels u's rounding error (Goldberg), exact at u == 1
    u = 1.0 + x
    return tl.where((u == 1.0) | (u == float("inf")), x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def _expm1(x):
    # (u - 1) * x / log(u) with u = exp(x) (Kahan's trick), exact where u rounds to 1
    u = tl.exp(x)
    big = tl.where(u == float("inf"), u, (u - 1.0) * (x / tl.log(u)))
    return tl.where(u == 1.0, x, tl.where(u - 1.0 == -1.0, -1.0, big))


@triton.jit
def _fmod(a, b):
    return a % b        # Triton's float % is C's fmod (frem): the dividend's sign


@triton.jit
def _atan2(y, x):
    # Cephes atanf on |y| / |x| (range-reduced to |t| <= tan(pi/8)), then the quadrant
    q = tl.abs(y) / tl.abs(x)
    big = q > 2.414213562373095
    mid = (q > 0.4142135623730950) & (q <= 2.414213562373095)
    t = tl.where(big, -1.0 / q, tl.where(mid, (q - 1.0) / (q + 1.0), q))
    base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = t * t
    r = base + ((((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z
                 - 3.33329491539e-1) * z * t + t)
    r = tl.where(x < 0, 3.141592653589793 - r, r)
    r = tl.where((x == 0) & (y == 0), 0.0, r)
    return tl.where(y < 0, -r, r)


class _InterpretedLibdevice:
    """libdevice's names, resolved at call time to the `tl` functions the interpreter patches."""
    _OWN = {"tanh": _tanh, "nearbyint": _nearbyint, "trunc": _trunc, "pow": _pow,
            "log1p": _log1p, "expm1": _expm1, "fmod": _fmod, "atan2": _atan2}

    def __getattr__(self, name):
        return self._OWN.get(name) or getattr(tl, name)


if INTERPRET:
    libdevice = _InterpretedLibdevice()
else:
    from triton.language.extra import libdevice  # noqa: F401


# ---- NaN-propagating max/min ----


@triton.jit
def maximum(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def minimum(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def max2(a, dim):
    return tl.reduce(a, dim, maximum)


@triton.jit
def min2(a, dim):
    return tl.reduce(a, dim, minimum)


@triton.jit
def _prod_combine(a, b):
    return a * b


@triton.jit
def prod(a, dim):
    return tl.reduce(a, dim, _prod_combine)


# ---- scans (§6 ir.Scan): tl.associative_scan with each op's combine ----


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def logaddexp(a, b):
    # numpy's npy_logaddexp: equal operands (+-inf too) give a + log 2; NaN propagates
    d = a - b
    big = tl.where(d > 0, a, b)
    e = tl.exp(-tl.abs(d))
    tail = big + libdevice.log1p(e)
    return tl.where(a == b, a + 0.6931471805599453, tl.where(d == d, tail, d))


@triton.jit
def cumsum(a, dim):
    return tl.associative_scan(a, dim, _add_combine)


@triton.jit
def cumprod(a, dim):
    return tl.associative_scan(a, dim, _prod_combine)


@triton.jit
def logcumsumexp(a, dim):
    return tl.associative_scan(a, dim, logaddexp)


@triton.jit
def cummax(a, dim):
    return tl.associative_scan(a, dim, maximum)


@triton.jit
def cummin(a, dim):
    return tl.associative_scan(a, dim, minimum)


# ---- argmax / argmin: (value, index) pairs ----


@triton.jit
def _pick_max(a, ai, b, bi):
    a_nan = a != a
    b_nan = b != b
    take_a = (a > b) | (a_nan & ~b_nan) | (((a == b) | (a_nan & b_nan)) & (ai < bi))
    return tl.where(take_a, a, b), tl.where(take_a, ai, bi)


@triton.jit
def _pick_min(a, ai, b, bi):
    a_nan = a != a
    b_nan = b != b
    take_a = (a < b) | (a_nan & ~b_nan) | (((a == b) | (a_nan & b_nan)) & (ai < bi))
    return tl.where(take_a, a, b), tl.where(take_a, ai, bi)


@triton.jit
def max_with_index(value, index, dim):
    return tl.reduce((value, index), dim, _pick_max)


@triton.jit
def min_with_index(value, index, dim):
    return tl.reduce((value, index), dim, _pick_min)


# ---- Python-semantics integer/float division ----


@triton.jit
def floordiv(a, b):
    # a zero divisor gives 0, a defined value (docs/DESIGN.md: the GPU does not raise; the
    # hardware's quotient would be undefined); the divide itself sees 1 there
    nonzero = b != 0
    d = tl.where(nonzero, b, 1)
    q = a // d
    # Triton's // truncates toward zero for integers; Python floors
    q = tl.where(((a % d) != 0) & ((a < 0) != (d < 0)), q - 1, q)
    return tl.where(nonzero, q, 0)


@triton.jit
def floordiv_float(a, b):
    return tl.floor(a / b)


@triton.jit
def remainder(a, b):
    nonzero = b != 0            # a zero divisor gives 0, as floordiv does
    d = tl.where(nonzero, b, 1)
    r = a % d
    r = tl.where((r != 0) & ((r < 0) != (d < 0)), r + d, r)
    return tl.where(nonzero, r, 0)


@triton.jit
def remainder_float(a, b):
    return a - b * tl.floor(a / b)


@triton.jit
def sign(x):
    # NaN gives 0, as eager (and PyTorch) does
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype)


@triton.jit
def ipow(a, b):
    r = tl.full(a.shape, 1, a.dtype) + a * 0
    base = a
    e = b + a * 0
    for _ in tl.static_range(63):
        r = tl.where((e & 1) != 0, r * base, r)
        base = base * base
        e = e >> 1
    return tl.where(b < 0, tl.where(a == 1, 1, tl.where(a == -1, tl.where((b & 1) != 0, -1, 1), 0)), r)


# ---- §6.5 The one-kernel split: the last program of a column block combines ----

@triton.jit
def last_arrival(counter_ptr, arrivals):
    """True in the last of the `arrivals` programs that call it on one int32 counter (each after
    storing its partials), which then sets the counter back to 0 for the next launch (and every
    CUDA graph replay). The barrier puts all of this program's stores before its arrival; the
    acq_rel atomic makes the other programs' stores visible to the last one."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    last = ticket == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)
    tl.debug_barrier()
    return last
