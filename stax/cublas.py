"""§9.8 The extern candidate: cuBLASLt through cffi, and Alg. 9.1's choice against the template.

Layer: back end (GPU), beside the launch-time modules: imports `cuda` (the context, the one
stream, device memory), `cache` (the choice's record on disk) and, lazily, `ir` (to read an
epilogue when code is generated; a warm start imports no sympy).
templates.py asks it, when printing a template group, whether cuBLASLt can run the matmul
(`plan_matmul`) and with which of its fused epilogues (`match_epilogue`); runtime.py hands the
generated wrapper `extern_kernels.mm` and `async_compile.mm_choice` from here.

The chapter's candidate set for a GEMM includes the framework's own matmul. Stax has none of its
own, so when NVIDIA's `nvidia-cublas` wheel is installed (`pip install stax[cublas]`) the GEMM
of cuBLASLt competes with the Triton templates: the wrapper prints both branches, and the first
call measures them (`MatmulChoice`, Alg. 9.1) and keeps the faster; the choice is recorded on
disk beside the autotuner's records. Without the package (CI, no GPU) nothing here is loaded and
only the templates compete.

Consumes the layouts of a matmul's operands and output (shapes, strides in elements, dtypes),
the precision of float32 (`set_float32_matmul_precision`: "ieee" or "tf32") and an epilogue name
("none", "bias", "relu", "relu_bias", "gelu", "gelu_bias"); produces a `MatmulPlan` (cuBLAS's
column-major view of the row-major product, by the transposition trick
out^T = B^T · A^T), and from it the descriptors and the `cublasLtMatmul` call.

Where to look:
  - `library_path`, `available`, `load` .... finding libcublasLt (the nvidia-cublas package, then
                                             $STAX_CUBLASLT); STAX_LOGS=autotune says which
  - `plan_matmul` .......................... layouts -> cuBLAS's m, n, k, ops, leading dims, batch
  - `match_epilogue` ....................... which epilogues cuBLASLt fuses (bias along N, relu, gelu)
  - `build`, `LtBinding` ................... the descriptors, the heuristic's algorithm, the call
  - `mm` ................................... `extern_kernels.mm`, the wrapper's line
  - `MatmulChoice` ......................... Alg. 9.1: the template against cuBLASLt, measured once
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys
from dataclasses import dataclass

from . import cache, cuda

CDEF = """
typedef int cublasStatus_t;
typedef struct cublasLtContext *cublasLtHandle_t;
typedef struct cublasLtMatmulDescOpaque_st *cublasLtMatmulDesc_t;
typedef struct cublasLtMatrixLayoutOpaque_st *cublasLtMatrixLayout_t;
typedef struct cublasLtMatmulPreferenceOpaque_st *cublasLtMatmulPreference_t;
typedef struct { uint64_t data[8]; } cublasLtMatmulAlgo_t;
typedef struct { cublasLtMatmulAlgo_t algo; size_t workspaceSize; cublasStatus_t state;
                 float wavesCount; int reserved[4]; } cublasLtMatmulHeuristicResult_t;
size_t cublasLtGetVersion(void);
const char *cublasLtGetStatusName(cublasStatus_t status);
cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, int computeType, int scaleType);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, int attr, const void *buf, size_t size);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, int type, uint64_t rows,
                                          uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, int attr, const void *buf,
                                                size_t size);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref, int attr,
                                                    const void *buf, size_t size);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
    cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc,
    cublasLtMatrixLayout_t Ddesc, cublasLtMatmulPreference_t pref, int requested,
    cublasLtMatmulHeuristicResult_t results[], int *returned);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void *alpha,
    const void *A, cublasLtMatrixLayout_t Adesc, const void *B, cublasLtMatrixLayout_t Bdesc,
    const void *beta, const void *C, cublasLtMatrixLayout_t Cdesc, void *D, cublasLtMatrixLayout_t Ddesc,
    const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspaceSize, void *stream);
"""

# cudaDataType_t, cublasComputeType_t, cublasOperation_t and the attributes (cublasLt.h)
CUDA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}
COMPUTE = {"ieee": 68, "tf32": 77}         # CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32
OP_N, OP_T = 0, 1
EPILOGUES = {"none": 1, "relu": 2, "bias": 4, "relu_bias": 6, "gelu": 32, "gelu_bias": 36}
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_BATCH_STRIDE = 3, 4, 7, 8, 10
LAYOUT_BATCH_COUNT, LAYOUT_BATCH_STRIDE = 5, 6
PREF_MAX_WORKSPACE, PREF_ALIGN = 1, {"a": 5, "b": 6, "c": 7, "d": 8}
WORKSPACE_BYTES = 32 << 20                 # what PyTorch gives cuBLASLt on Hopper
# The heuristic's first algorithm is not always its fastest (a float32 IEEE 50257x768x8192 product
# ran 64x64 tiles at 14.7 ms where its third proposal, 256x128, takes 12.3): Alg. 9.1 measures
# this many of its proposals the first time a product is timed, and records the winner.
ALGO_CANDIDATES = 6
ENV_VAR = "STAX_CUBLASLT"


class CublasError(RuntimeError):
    """A cuBLASLt call failed, or the library cannot run this product."""


# ---- §9.8 Finding the library (the nvidia-cublas package, then $STAX_CUBLASLT) ----


def _package_dirs() -> list:
    """The lib folders of an installed nvidia-cublas wheel: site-packages/nvidia/cublas/lib (CUDA
    12's wheels), site-packages/nvidia/cu13/lib (CUDA 13's, which share one folder)."""
    import importlib
    dirs = []
    for name in ("nvidia.cublas", "nvidia.cu13"):
        try:
            pkg = importlib.import_module(name)     # namespace packages: no code runs
        except ImportError:
            continue
        dirs += [os.path.join(p, "lib") for p in getattr(pkg, "__path__", [])]
    return dirs


def library_path() -> str | None:
    """libcublasLt.so.* from the nvidia-cublas package, else the file $STAX_CUBLASLT names; None
    when neither exists (then cuBLASLt is not a candidate)."""
    for d in _package_dirs():
        found = sorted(glob.glob(os.path.join(d, "libcublasLt.so*")))
        if found:
            return found[0]
    env = os.environ.get(ENV_VAR)
    return env if env and os.path.isfile(env) else None


def available() -> bool:
    """Is cuBLASLt a candidate? (a file on disk; nothing is loaded, so generating code needs no GPU)."""
    return library_path() is not None


def _log(text: str) -> None:
    stages = os.environ.get("STAX_LOGS", "").split(",")
    if "autotune" in stages or "all" in stages:
        print(f"stax cublas: {text}", file=sys.stderr)


# ---- §9.8 The plan: cuBLAS's column-major view of a row-major product ----


@dataclass(frozen=True)
class MatrixLayout:
    """One matrix (or batch of them) as Stax lays it out: sizes and strides in elements."""
    shape: tuple
    stride: tuple
    dtype: str


@dataclass(frozen=True)
class MatmulPlan:
    """One cublasLtMatmul, in cuBLAS's terms: D[m, n] = op(A)[m, k] · op(B)[k, n], column-major.
    By out^T = B^T · A^T, cuBLAS's A is Stax's b and its B is Stax's a (`swap`), unless the
    output is column-major itself."""
    m: int
    n: int
    k: int
    trans_a: int
    trans_b: int
    lda: int
    ldb: int
    ldd: int
    batch: int
    stride_a: int
    stride_b: int
    stride_d: int
    a_type: int
    b_type: int
    d_type: int
    compute: int
    epilogue: int
    bias_type: int | None
    swap: bool


def _flat_batch(op: MatrixLayout) -> tuple:
    """(count, stride) of the batch dims flattened into one strided batch; None when they cannot
    be (a batch dim that is not `stride × size` of the next one)."""
    dims = [(s, st) for s, st in zip(op.shape[:-2], op.stride[:-2]) if s != 1]
    if not dims:
        return 1, 0
    for (s0, st0), (s1, st1) in zip(dims, dims[1:]):
        if st0 != st1 * s1:
            return None
    return math.prod(s for s, _ in dims), dims[-1][1]


def _col_major_ld(rows: int, cols: int, sr: int, sc: int) -> int | None:
    """The leading dim of a [rows, cols] matrix that is column-major as it is, else None."""
    if sr == 1 or rows == 1:
        ld = sc if cols > 1 else max(rows, 1)
        if ld >= max(rows, 1):
            return ld
    return None


def _col_major(rows: int, cols: int, stride: tuple) -> tuple | None:
    """A [rows, cols] matrix with element strides (row, col) as cuBLAS sees it: (op, ld) of
    the column-major matrix it is (OP_N: itself, ld = column stride; OP_T: its transpose is
    column-major, ld = row stride); None when neither stride is 1. A size-1 dim's stride is free."""
    sr, sc = stride
    ld = _col_major_ld(rows, cols, sr, sc)
    if ld is not None:
        return OP_N, ld
    ld = _col_major_ld(cols, rows, sc, sr)          # its transpose is column-major
    return None if ld is None else (OP_T, ld)


def plan_matmul(a: MatrixLayout, b: MatrixLayout, out: MatrixLayout, compute: str = "ieee", epilogue: str = "none",
                bias: str | None = None) -> MatmulPlan:
    """The plan of out = epilogue(a @ b [+ bias]), or CublasError saying why cuBLASLt cannot run it."""
    (m, kk), (kb, n) = a.shape[-2:], b.shape[-2:]
    if kk != kb or tuple(out.shape[-2:]) != (m, n):
        raise CublasError(f"shapes {a.shape} @ {b.shape} -> {out.shape} do not multiply")
    if 0 in (m, n, kk):
        raise CublasError("an empty product (the template writes its zeros)")
    if a.dtype != b.dtype or a.dtype not in CUDA_TYPES or out.dtype not in CUDA_TYPES:
        raise CublasError(f"cuBLASLt here multiplies float32/float16/bfloat16 alike, not {a.dtype} @ {b.dtype}")
    if out.dtype not in (a.dtype, "float32"):
        raise CublasError(f"a {a.dtype} product is written as {a.dtype} or float32, not {out.dtype}")
    if epilogue not in EPILOGUES or ("bias" in epilogue) != (bias is not None):
        raise CublasError(f"epilogue {epilogue!r} with bias {bias!r} is not one cuBLASLt fuses")
    if bias is not None and bias != out.dtype:
        raise CublasError(f"cuBLASLt's bias has the output's dtype ({out.dtype}), not {bias}")
    batches = [_flat_batch(x) for x in (a, b, out)]
    if any(x is None for x in batches):
        raise CublasError("batch dims that are not one strided batch")
    count = max(c for c, _ in batches)
    if any(c not in (1, count) for c, _ in batches) or batches[2][0] != count:
        raise CublasError("operands with different batch counts")
    if count >= 1 << 31:
        raise CublasError("more than 2^31 batches")
    oa, ob = (_col_major(*x.shape[-2:], x.stride[-2:]) for x in (a, b))
    if oa is None or ob is None:
        raise CublasError("an operand with no unit stride along either matrix dim: cuBLASLt needs one")
    ldd = _col_major_ld(n, m, out.stride[-1], out.stride[-2])
    if ldd is not None:       # row-major out (Stax's): out^T[n, m] = b^T · a^T; a bias along N runs
        (ta, lda), (tb, ldb), swap = _flipped(ob), _flipped(oa), True      # along D's rows, as cuBLASLt's
        cm, cn, (sa, sb) = n, m, (batches[1][1], batches[0][1])
    elif bias is None and _col_major_ld(m, n, *out.stride[-2:]) is not None:
        (ta, lda), (tb, ldb), swap = oa, ob, False         # column-major out: D = a · b as it is
        cm, cn, (sa, sb) = m, n, (batches[0][1], batches[1][1])
        ldd = _col_major_ld(m, n, *out.stride[-2:])
    else:
        raise CublasError("an output that is neither row- nor column-major (or a column-major one with a bias)")
    if max(cm, cn, kk, lda, ldb, ldd) >= 1 << 31:
        raise CublasError("a size or leading dim past 2^31")
    return MatmulPlan(cm, cn, kk, ta, tb, lda, ldb, ldd, count, sa, sb, batches[2][1],
                      CUDA_TYPES[a.dtype], CUDA_TYPES[b.dtype], CUDA_TYPES[out.dtype],
                      COMPUTE[compute] if a.dtype == "float32" else COMPUTE["ieee"], EPILOGUES[epilogue],
                      None if bias is None else CUDA_TYPES[bias], swap)


def _flipped(op_ld: tuple) -> tuple:
    """The transpose of a matrix cuBLAS reads as (op, ld) is the same memory with the other op."""
    op, ld = op_ld
    return (OP_T if op == OP_N else OP_N), ld


# ---- §9.8 Which epilogues cuBLASLt fuses ----


class _Tree:
    """An ops handler building each body as a tree of tuples: ("load", name, index), (op, *args)."""

    def load(self, name, index):
        return ("load", name, index.expand() if hasattr(index, "expand") else index)

    def constant(self, value, dtype):
        return ("constant", float(value))

    def to_dtype(self, x, dtype, *rest):
        return ("to_dtype", x, dtype.name)

    def masked(self, mask, body, other):
        return ("masked",)

    def __getattr__(self, name):
        return lambda *args: (name, *args)


def _strip_casts(t, keep: set):
    """Drop float casts (bf16 -> float32 upcasts and the final rounding): cuBLASLt's epilogue runs
    in float32 and rounds once when it stores."""
    if isinstance(t, tuple) and t and t[0] == "to_dtype" and t[2] in keep:
        return _strip_casts(t[1], keep)
    if isinstance(t, tuple) and t and t[0] not in ("load", "constant"):
        return (t[0],) + tuple(_strip_casts(x, keep) for x in t[1:])
    return t


def _is_const(t, value: float) -> bool:
    v = t[1] if isinstance(t, tuple) and t and t[0] == "constant" else t
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(float(v) - value) <= 1e-6 * abs(value)


def _is_gelu_tanh(t, x) -> bool:
    """x · 0.5 · (tanh((x + x³ · 0.044715) · √(2/π)) + 1): `gelu(approximate="tanh")`, the one
    cuBLASLt's GELU epilogue computes (exact, erf gelu is not fused)."""
    if not (isinstance(t, tuple) and t[0] == "mul" and len(t) == 3):
        return False
    half, rest = t[1], t[2]
    if not (isinstance(half, tuple) and half[0] == "mul" and half[1] == x and _is_const(half[2], 0.5)):
        return False
    if not (isinstance(rest, tuple) and rest[0] == "add" and _is_const(rest[2], 1.0)):
        return False
    th = rest[1]
    if not (isinstance(th, tuple) and th[0] == "tanh"):
        return False
    inner = th[1]
    if not (isinstance(inner, tuple) and inner[0] == "mul" and _is_const(inner[2], math.sqrt(2 / math.pi))):
        return False
    s = inner[1]
    if not (isinstance(s, tuple) and s[0] == "add" and s[1] == x and isinstance(s[2], tuple) and s[2][0] == "mul"
            and _is_const(s[2][2], 0.044715)):
        return False
    cube = s[2][1]
    return (isinstance(cube, tuple) and ((cube[0] == "pow" and cube[1] == x and _is_const(cube[2], 3.0))
            or (cube[0] == "mul" and x in cube[1:] and any(isinstance(c, tuple) and c[0] == "mul"
                                                          and c[1:] == (x, x) for c in cube[1:]))))


def match_epilogue(tree, acc: tuple, bias_ok) -> tuple | None:
    """(epilogue name, bias buffer or None) when the body `tree` is one cuBLASLt fuses, given the
    tree of the matmul's result `acc` and `bias_ok(load)` saying whether a load is a bias along
    N; None otherwise (the epilogue then runs as a separate Stax kernel)."""
    def linear(t):
        if t == acc:
            return "none", None
        if isinstance(t, tuple) and t[0] == "add" and len(t) == 3:
            for x, y in ((t[1], t[2]), (t[2], t[1])):
                if x == acc and isinstance(y, tuple) and y[0] == "load" and bias_ok(y):
                    return "bias", y[1]
        return None
    plain = linear(tree)
    if plain is not None:
        return plain
    if isinstance(tree, tuple) and tree[0] == "relu" and len(tree) == 2 and linear(tree[1]):
        kind, bias = linear(tree[1])
        return ("relu" if kind == "none" else "relu_bias"), bias
    for x in ([acc] + [t for t in _adds(tree)]):
        lin = linear(x)
        if lin is not None and _is_gelu_tanh(tree, x):
            return ("gelu" if lin[0] == "none" else "gelu_bias"), lin[1]
    return None


def _adds(tree) -> list:
    """The sub-trees `add(...)` of a body (candidates for gelu's argument)."""
    out = []
    if isinstance(tree, tuple) and tree and tree[0] not in ("load", "constant"):
        if tree[0] == "add":
            out.append(tree)
        for x in tree[1:]:
            out += _adds(x)
    return out


def epilogue_of(node, mm_name: str, mm_layout, dtype_name: str, bias_dtype) -> tuple | None:
    """Trace an epilogue node's body and match it: (epilogue, bias buffer) or None. `bias_dtype
    (name)` is the dtype name of a buffer (a bias must have the output's)."""
    from .ir import index_vars, set_handler     # (only code generation reads an epilogue: a warm
    ranges = [int(r) for r in node.ranges]      # start that loads this module imports no sympy)
    xs = index_vars("i", len(ranges))
    with set_handler(_Tree()):
        tree = node.inner_fn(xs)
    zero = {x: 0 for x, r in zip(xs, ranges) if r == 1}
    tree = _strip_casts(tree, {"float32", dtype_name})
    want = mm_layout.index(xs).subs(zero).expand()
    last = xs[-1] if ranges[-1] != 1 else 0

    def fix(t):                    # size-1 loop vars are 0 in every index
        if isinstance(t, tuple) and t and t[0] == "load":
            return ("load", t[1], t[2].subs(zero).expand() if hasattr(t[2], "subs") else t[2])
        if isinstance(t, tuple) and t and t[0] != "constant":
            return (t[0],) + tuple(fix(x) for x in t[1:])
        return t
    tree = fix(tree)
    acc = ("load", mm_name, want)

    def bias_ok(load):
        return load[1] != mm_name and load[2] == last and bias_dtype(load[1]) == dtype_name
    return match_epilogue(tree, acc, bias_ok)


# ---- §9.8 The binding: descriptors, the heuristic's algorithm, the call ----


class LtBinding:
    """cuBLASLt through cffi (ABI mode, no compiler): one handle and one workspace per process,
    on the CUDA driver's context and stream (stax.cuda). Every call is checked. Tests replace it
    with a fake of the same methods that records what it is asked."""

    def __init__(self, path: str):
        import cffi
        cuda.init()                            # the primary context cuBLASLt's runtime calls find
        self.ffi = cffi.FFI()
        self.ffi.cdef(CDEF)
        self.lib = self.ffi.dlopen(path)
        self.path, self.version = path, int(self.lib.cublasLtGetVersion())
        h = self.ffi.new("cublasLtHandle_t *")
        self._check(self.lib.cublasLtCreate(h), "cublasLtCreate")
        self.handle = h[0]
        self.workspace = cuda.allocate(WORKSPACE_BYTES)
        self._keep = []                        # descriptors live as long as the plans that use them

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            name = self.ffi.string(self.lib.cublasLtGetStatusName(rc)).decode()
            raise CublasError(f"{name} ({rc}) in {call}")

    def _set(self, fn, obj, attr: int, ctype: str, value, call: str) -> None:
        buf = self.ffi.new(f"{ctype} *", value)
        self._check(fn(obj, attr, buf, self.ffi.sizeof(ctype)), call)

    def matmul_desc(self, compute: int, scale: int):
        d = self.ffi.new("cublasLtMatmulDesc_t *")
        self._check(self.lib.cublasLtMatmulDescCreate(d, compute, scale), "cublasLtMatmulDescCreate")
        self._keep.append(d)
        return d[0]

    def set_desc(self, desc, attr: int, ctype: str, value) -> None:
        self._set(self.lib.cublasLtMatmulDescSetAttribute, desc, attr, ctype, value, "cublasLtMatmulDescSetAttribute")

    def layout(self, dtype: int, rows: int, cols: int, ld: int):
        d = self.ffi.new("cublasLtMatrixLayout_t *")
        self._check(self.lib.cublasLtMatrixLayoutCreate(d, dtype, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        self._keep.append(d)
        return d[0]

    def set_layout(self, layout, attr: int, ctype: str, value) -> None:
        self._set(self.lib.cublasLtMatrixLayoutSetAttribute, layout, attr, ctype, value,
                  "cublasLtMatrixLayoutSetAttribute")

    def heuristic(self, desc, a, b, d, prefs: dict, requested: int = 1) -> list:
        """The algorithms cuBLASLt's heuristic proposes under `prefs` {attribute: uint64}, best
        first (at most `requested`)."""
        p = self.ffi.new("cublasLtMatmulPreference_t *")
        self._check(self.lib.cublasLtMatmulPreferenceCreate(p), "cublasLtMatmulPreferenceCreate")
        self._keep.append(p)
        for attr, value in prefs.items():
            ctype = "uint64_t" if attr == PREF_MAX_WORKSPACE else "uint32_t"
            self._set(self.lib.cublasLtMatmulPreferenceSetAttribute, p[0], attr, ctype, value,
                      "cublasLtMatmulPreferenceSetAttribute")
        results = self.ffi.new(f"cublasLtMatmulHeuristicResult_t[{requested}]")
        count = self.ffi.new("int *")
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, p[0], requested,
                                                            results, count), "cublasLtMatmulAlgoGetHeuristic")
        algos = [self.ffi.addressof(results[i], "algo") for i in range(count[0]) if results[i].state == 0]
        if not algos:
            raise CublasError("cublasLtMatmulAlgoGetHeuristic found no algorithm for this product")
        self._keep.append(results)
        return algos

    def stream(self) -> int:
        return cuda.current_stream().ptr        # the one stream every Stax kernel runs on

    def matmul(self, desc, a_ptr: int, a, b_ptr: int, b, d_ptr: int, d, algo, stream: int) -> None:
        one, zero = self.ffi.new("float *", 1.0), self.ffi.new("float *", 0.0)
        vp = self.ffi.cast
        self._check(self.lib.cublasLtMatmul(
            self.handle, desc, one, vp("void *", a_ptr), a, vp("void *", b_ptr), b, zero,
            vp("void *", d_ptr), d, vp("void *", d_ptr), d, algo, vp("void *", self.workspace.data_ptr()),
            WORKSPACE_BYTES, vp("void *", stream)), "cublasLtMatmul")


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 that divides a pointer (cuBLASLt's heuristic assumes 256)."""
    return 256 if ptr % 256 == 0 else ptr & -ptr


def build(lt, plan: MatmulPlan, aligns: tuple, bias_ptr: int = 0, requested: int = 1) -> tuple:
    """The descriptors of one plan and the algorithms the heuristic proposes (best first, at most
    `requested`) for operands aligned to `aligns` (bytes of cuBLAS's A, B, D, bias):
    (desc, A, B, D layouts, [algo, ...]). The heuristic reads the bias pointer's alignment from the
    descriptor, so a bias is set before it is asked."""
    desc = lt.matmul_desc(plan.compute, CUDA_TYPES["float32"])
    lt.set_desc(desc, DESC_TRANSA, "int32_t", plan.trans_a)
    lt.set_desc(desc, DESC_TRANSB, "int32_t", plan.trans_b)
    if plan.epilogue != EPILOGUES["none"]:
        lt.set_desc(desc, DESC_EPILOGUE, "uint32_t", plan.epilogue)
    if plan.bias_type is not None:
        lt.set_desc(desc, DESC_BIAS_POINTER, "uint64_t", bias_ptr)
        if plan.batch > 1:       # one [N] bias for every batch
            lt.set_desc(desc, DESC_BIAS_BATCH_STRIDE, "int64_t", 0)
    rows_a, cols_a = (plan.m, plan.k) if plan.trans_a == OP_N else (plan.k, plan.m)
    rows_b, cols_b = (plan.k, plan.n) if plan.trans_b == OP_N else (plan.n, plan.k)
    layouts = [lt.layout(plan.a_type, rows_a, cols_a, plan.lda), lt.layout(plan.b_type, rows_b, cols_b, plan.ldb),
               lt.layout(plan.d_type, plan.m, plan.n, plan.ldd)]
    if plan.batch > 1:
        for layout, stride in zip(layouts, (plan.stride_a, plan.stride_b, plan.stride_d)):
            lt.set_layout(layout, LAYOUT_BATCH_COUNT, "int32_t", plan.batch)
            lt.set_layout(layout, LAYOUT_BATCH_STRIDE, "int64_t", stride)
    prefs = {PREF_MAX_WORKSPACE: WORKSPACE_BYTES, PREF_ALIGN["a"]: aligns[0], PREF_ALIGN["b"]: aligns[1],
             PREF_ALIGN["c"]: aligns[2], PREF_ALIGN["d"]: aligns[2]}
    return (desc, *layouts, lt.heuristic(desc, *layouts, prefs, requested))


_LT = [None]            # the process's binding (loaded on the first extern call)
_BUILT: dict = {}       # (plan, alignments) -> [desc, A, B, D layouts, the algorithm run]
_PLANS: dict = {}       # the layouts of a call -> its plan
_MEASURING: list = []   # non-empty while MatmulChoice times the extern candidate


def load():
    """The binding, loaded once; STAX_LOGS=autotune says which library file it is."""
    if _LT[0] is None:
        path = library_path()
        if path is None:
            raise CublasError("cuBLASLt was not found: install nvidia-cublas (pip install stax[cublas]) "
                              f"or set {ENV_VAR} to a libcublasLt.so")
        _LT[0] = LtBinding(path)
        _log(f"loaded {path} (cublasLt version {_LT[0].version})")
    return _LT[0]


def set_binding(lt):
    """Install another binding (tests: a fake recording its calls); returns the previous one."""
    old, _LT[0] = _LT[0], lt
    _BUILT.clear()
    _PLANS.clear()
    return old


def _operand(t) -> MatrixLayout:
    m = t._meta
    return MatrixLayout(tuple(m.shape), tuple(m.stride), m.dtype.name)


def mm(a, b, out, bias=None, epilogue: str = "none", compute: str = "ieee") -> None:
    """`extern_kernels.mm`: out = epilogue(a @ b [+ bias]) by cuBLASLt on the default stream (the
    wrapper's line). a, b, out are "cuda" tensors (views allowed); bias a [N] vector."""
    lt = load()
    layouts = (_operand(a), _operand(b), _operand(out), compute, epilogue, None if bias is None else bias.dtype.name)
    plan = _PLANS.get(layouts)
    if plan is None:
        plan = _PLANS[layouts] = plan_matmul(*layouts)
    first, second = (b, a) if plan.swap else (a, b)
    ptrs = (first.data_ptr(), second.data_ptr(), out.data_ptr(), 0 if bias is None else bias.data_ptr())
    key = (plan, tuple(_alignment(p) for p in ptrs))
    built = _BUILT.get(key)
    if bias is not None and built is not None:   # the bias pointer is a descriptor attribute: this call's
        lt.set_desc(built[0], DESC_BIAS_POINTER, "uint64_t", ptrs[3])
    if built is None:
        desc, la, lb, ld, algos = build(lt, plan, key[1], ptrs[3], ALGO_CANDIDATES)
        built = _BUILT[key] = [desc, la, lb, ld, _pick_algorithm(lt, key, desc, (la, lb, ld), algos, ptrs)]
    desc, la, lb, ld, algo = built
    lt.matmul(desc, ptrs[0], la, ptrs[1], lb, ptrs[2], ld, algo, lt.stream())


def _record_path(lt, stem: str, *parts: str):
    """A measured choice's record on disk, keyed by `parts`, the device and the library."""
    props = cuda.get_device_properties()
    key = cache.content_hash(*parts, props.name, repr(props.cc), str(lt.version), cache.FORMAT)
    return cache.folder("autotune") / f"{stem}_{key}.json"


def _pick_algorithm(lt, key, desc, layouts, algos, ptrs):
    """Which of the heuristic's proposals runs: the one recorded on disk for this product, else,
    while Alg. 9.1 is timing the extern candidate (`_MEASURING`), the fastest of them (each timed
    on the call's own operands; D is overwritten, as the call itself will), recorded; else the
    heuristic's first."""
    if len(algos) == 1 or cuda.interpreting():
        return algos[0]
    path = _record_path(lt, "cublas_algo", repr(key), str(ALGO_CANDIDATES))
    valid = (lambda r: isinstance(r, dict) and isinstance(r.get("index"), int) and 0 <= r["index"] < len(algos))
    record = cache.read_sealed_json(path, valid, "a cuBLASLt algorithm record") if path.exists() else None
    if record is None and _MEASURING:
        la, lb, ld = layouts
        times = []
        for algo in algos:
            try:
                times.append(cuda.median_ms(lambda: lt.matmul(desc, ptrs[0], la, ptrs[1], lb, ptrs[2], ld, algo,
                                                              lt.stream())))
            except CublasError:
                times.append(math.inf)      # a proposal this product cannot run after all
        record = {"index": times.index(min(times)), "ms": times}
        cache.write_sealed(path, json.dumps(record))
        _log(f"cuBLASLt proposals for {key[0].m}x{key[0].n}x{key[0].k}: "
             + ", ".join(f"{t:.4f}" for t in times) + f" ms -> #{record['index']}")
    return algos[record["index"] if record else 0]


# ---- §9.8 Alg. 9.1: the template against cuBLASLt ----


def _is_record(r) -> bool:
    return isinstance(r, dict) and r.get("winner") in ("template", "extern") and \
        all(isinstance(r.get(k), (int, float)) for k in ("template_ms", "extern_ms"))


class MatmulChoice:
    """`async_compile.mm_choice(name, key)`: the wrapper's `mm_choice_N.run(template_N, extern_N)`
    runs one of two branches computing the same group: the Triton template (its own blocks tuned
    first, Alg. 9.1) or cuBLASLt. The first call measures both and keeps the faster, recorded on
    disk under `key` (the GEMM's sizes, layouts, dtype, precision, epilogue) with the device and
    the library, so a later process measures nothing. The template runs unmeasured in Triton's
    interpreter, with autotuning off, or where cuBLASLt cannot be loaded or fails."""

    def __init__(self, name: str, key: str, options: dict | None = None):
        self.name, self.key, self.options = name, key, dict(options or {})
        self.chosen = None
        self.times = None              # (template ms, extern ms) when measured

    def run(self, template, extern) -> None:
        if self.chosen is None:
            self.chosen = self._choose(template, extern)
            return                     # (choosing ran the winner last: its results are in place)
        (extern if self.chosen == "extern" else template)()

    def _choose(self, template, extern) -> str:
        if cuda.interpreting() or self.options.get("autotune") is False:
            template()
            return "template"
        try:
            lt = load()
        except (CublasError, OSError) as e:
            _log(f"{self.name}: {e}; the template runs")
            template()
            return "template"
        path = _record_path(lt, "extern", self.key)
        record = cache.read_sealed_json(path, _is_record, "an extern choice record") if path.exists() else None
        if record is None:
            template()                 # the template's own tuning and compiles, before it is timed
            cuda.synchronize()
            t_template = cuda.median_ms(template)
            try:
                _MEASURING.append(self.name)     # mm times the heuristic's proposals first
                try:
                    t_extern = cuda.median_ms(extern)
                finally:
                    _MEASURING.pop()
            except CublasError as e:
                _log(f"{self.name}: {e}; the template runs")
                template()
                return "template"
            record = {"winner": "extern" if t_extern < t_template else "template",
                      "template_ms": t_template, "extern_ms": t_extern, "key": self.key}
            cache.write_sealed(path, json.dumps(record))
        self.times = (record["template_ms"], record["extern_ms"])
        _log(f"{self.name}: triton template {self.times[0]:.4f} ms, cuBLASLt {self.times[1]:.4f} ms "
             f"-> {'cuBLASLt' if record['winner'] == 'extern' else 'template'}")
        (extern if record["winner"] == "extern" else template)()
        return record["winner"]
