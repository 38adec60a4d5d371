"""Data types: Stax's dtypes, PyTorch's promotion rules, and the numpy forms values take.

Layer: the bottom of the stack (with op_table.py, which imports it); every other module may import it.

A `DType` names two numpy dtypes: the *storage* form (what a buffer holds: bfloat16 is stored as
16-bit words) and the *compute* form (what eager arithmetic runs in: half types compute in float32,
§6.2). This module consumes nothing of Stax (numpy only) and produces the dtype constants
(`float32` ... `int8`, `uint8`, `int16` ... `bool_`, `float8_e4m3fn`, `float8_e5m2`, `DTYPES`, PyTorch's aliases in `_ALIASES`), the promotion lattice, and the
conversions between the two forms. `tensor.py` re-exports its names (`stax.tensor.float32`,
`stax.tensor.DTYPES`, `stax.tensor.DType`); the one dtype rule that looks at tensors,
`result_type`, lives there.

Where to look:
  - the dtypes:                DType, float32 ... bool_, DTYPES, _ALIASES, _FROM_NP
  - promotion:                 promote_types, _combine (result_type is in tensor.py), can_cast
  - storage and compute forms: _to_storage_form, _to_compute_form
  - float8 (§9.8):             float8_e4m3fn, float8_e5m2, _float8_values, _float8_encode
"""
import numpy as np


# ---- Data types ----


class DType:
    """A Stax dtype: `np` is the storage dtype, `compute` the numpy dtype arithmetic runs in."""

    def __init__(self, name, torch_name, itemsize, kind, np_storage, np_compute):
        self.name, self._tname, self.itemsize, self.kind = name, torch_name, itemsize, kind
        self.np, self.compute = np.dtype(np_storage), np.dtype(np_compute)
        self.is_floating_point = kind == "f"

    def __repr__(self):
        return f"stax.{self.name}"

    def __reduce__(self):  # pickles (copy, multiprocessing) as a reference to the module constant
        return (_dtype_by_name, (self.name,))


float32 = DType("float32", "Float", 4, "f", np.float32, np.float32)
float64 = DType("float64", "Double", 8, "f", np.float64, np.float64)
float16 = DType("float16", "Half", 2, "f", np.float16, np.float32)      # §6.2: computed in float32
bfloat16 = DType("bfloat16", "BFloat16", 2, "f", np.uint16, np.float32)  # stored as 16-bit words
int8 = DType("int8", "Char", 1, "i", np.int8, np.int8)
uint8 = DType("uint8", "Byte", 1, "u", np.uint8, np.uint8)
int16 = DType("int16", "Short", 2, "i", np.int16, np.int16)
int32 = DType("int32", "Int", 4, "i", np.int32, np.int32)
int64 = DType("int64", "Long", 8, "i", np.int64, np.int64)
bool_ = DType("bool", "Bool", 1, "b", np.bool_, np.bool_)
# §9.8 float8 (OCP FP8): one-byte codes, computed in float32; only casts, views and
# stax._scaled_mm take them (as in PyTorch, no arithmetic runs on float8 itself)
float8_e4m3fn = DType("float8_e4m3fn", "Float8_e4m3fn", 1, "f", np.uint8, np.float32)
float8_e5m2 = DType("float8_e5m2", "Float8_e5m2", 1, "f", np.uint8, np.float32)
DTYPES = {d.name: d for d in (float32, float64, float16, bfloat16, int8, uint8, int16, int32, int64, bool_,
                              float8_e4m3fn, float8_e5m2)}
# PyTorch's aliases. `bool`, `int`, `float` must not shadow builtins, so they are reachable only
# as attributes: tensor.py's PEP 562 module __getattr__ (stax.tensor.bool) and stax.bool.
_ALIASES = dict(DTYPES, float=float32, double=float64, half=float16, int=int32, long=int64, short=int16)
_FROM_NP = {np.dtype(np.float32): float32, np.dtype(np.float64): float64,
            np.dtype(np.float16): float16, np.dtype(np.int32): int32,
            np.dtype(np.int64): int64, np.dtype(np.bool_): bool_, np.dtype(np.int8): int8,
            np.dtype(np.uint8): uint8, np.dtype(np.int16): int16}
_HALF = (float16, bfloat16)
FLOAT8 = (float8_e4m3fn, float8_e5m2)


# ---- §9.8 float8: the 256 values of each format, and rounding to them ----


def _float8_values(exp_bits: int, man_bits: int, fn: bool) -> np.ndarray:
    """The float32 value of each of the 256 codes (sign, exponent, mantissa; bias 2^(e-1) - 1).
    e4m3fn ("finite"): no infinities, only S.1111.111 is NaN; e5m2: IEEE-like, inf and NaNs."""
    bias = (1 << (exp_bits - 1)) - 1
    c = np.arange(256)
    e, m = (c >> man_bits) & ((1 << exp_bits) - 1), c & ((1 << man_bits) - 1)
    mag = np.where(e == 0, m * 2.0 ** (1 - bias - man_bits), (1 + m / 2.0 ** man_bits) * 2.0 ** (e - bias))
    top = e == (1 << exp_bits) - 1
    if fn:
        mag = np.where(top & (m == (1 << man_bits) - 1), np.nan, mag)
    else:
        mag = np.where(top, np.where(m == 0, np.inf, np.nan), mag)
    return np.where(c >> 7, -mag, mag).astype(np.float32)


_F8 = {"float8_e4m3fn": (3, _float8_values(4, 3, True)), "float8_e5m2": (2, _float8_values(5, 2, False))}


def _float8_encode(a, dtype) -> np.ndarray:
    """float32 -> float8 codes: round to nearest even, saturating (a finite value past the largest,
    and ±inf, become ± the largest finite value, as the GPU's cvt.rn.satfinite and the float8
    recipes' clamping do; PyTorch's plain cast gives NaN or inf instead); NaN stays NaN."""
    man, values = _F8[dtype.name]
    a = np.asarray(a, np.float32)
    finite = values[:128][np.isfinite(values[:128])]           # the positive codes, ascending
    mag = np.minimum(np.abs(a.astype(np.float64)), finite[-1])
    exp = np.floor(np.log2(np.maximum(mag, finite[1])))        # subnormals share the least exponent
    exp = np.maximum(exp, np.log2(finite[1 << man]))            # (the least normal's)
    ulp = 2.0 ** (exp - man)
    q = np.minimum(np.rint(np.nan_to_num(mag) / ulp) * ulp, finite[-1])
    code = np.searchsorted(finite, q).astype(np.uint8)
    code = np.where(np.signbit(a), code | 0x80, code)
    return np.where(np.isnan(a), np.uint8(0x7F), code).astype(np.uint8)


def _dtype_by_name(name):
    return DTYPES[name]


def promote_types(a, b):
    """PyTorch's promotion lattice: bool < uint8, int8 < int16 < int32 < int64 < float16, bfloat16 <
    float32 < float64 (uint8 with int8 is int16: the first type that holds both ranges). float8
    promotes with nothing (PyTorch's rule): cast it first."""
    if a is b:
        return a
    if a in FLOAT8 or b in FLOAT8:
        raise TypeError(f"Promotion for Float8 Types is not supported, attempted to promote {a._tname} and "
                        f"{b._tname}: cast the float8 tensor with .to(...) first")
    if {a, b} == {uint8, int8}:
        return int16
    if a is bool_ or b is bool_:
        return b if a is bool_ else a
    if a.is_floating_point != b.is_floating_point:
        return a if a.is_floating_point else b
    if {a, b} == {float16, bfloat16}:
        return float32
    return a if a.itemsize >= b.itemsize else b


def _scalar_dtype(s):
    return bool_ if isinstance(s, bool) else int64 if isinstance(s, int) else float32


def _combine(higher, lower):
    # c10's combine_categories: a lower-priority group only matters if it is of a higher category
    if higher is None or lower is None:
        return lower if higher is None else higher
    if higher.is_floating_point:
        return higher
    if higher is bool_ or lower.is_floating_point:
        return promote_types(higher, lower)
    return higher


def can_cast(frm, to):  # c10::canCast, for in-place results
    if frm.is_floating_point and not to.is_floating_point:
        return False
    return not (frm is not bool_ and to is bool_)


def _to_storage_form(a, dtype):
    """A numpy array in compute form -> the same values in `dtype`'s storage form (rounding once)."""
    if dtype is bfloat16:
        u = np.asarray(a, np.float32).view(np.uint32)
        rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)  # nearest-even
        return np.where(np.isnan(a), ((u >> 16) | 0x40).astype(np.uint16), rounded)  # keep NaN
    if dtype in FLOAT8:
        return _float8_encode(a, dtype)
    return np.asarray(a).astype(dtype.np, copy=False)


def _to_compute_form(a, dtype):
    if dtype is bfloat16:   # np.asarray: a 0-d shift gives a numpy scalar, not a 0-d array
        return np.asarray(a.astype(np.uint32) << 16).view(np.float32)
    if dtype in FLOAT8:
        return np.asarray(_F8[dtype.name][1][a])
    return a.astype(np.float32) if dtype is float16 else a
