// ---- Stax C++ prelude (§8 CPU codegen; pasted at the top of every generated kernel file) ----
//
// Generated kernels are plain C++ loops compiled with
//   g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17 -fno-math-errno -fno-trapping-math
// (never -ffast-math; -fno-trapping-math changes no result, it lets GCC if-convert the selects
// below, which compute both sides: without it log/log2 are not vectorized).
// GCC does not vectorize calls to libm's expf/logf/erff/tanhf/sinf/cosf, so this prelude carries
// its own float versions: branch-free (every special case is a select, not a branch), made only of
// +, *, fma, compares, min/max, rint and integer bit operations, so that GCC vectorizes them inside
// `#pragma omp simd` loops and fixed-width lane loops. Accuracy: a few ulp over the whole float
// range (tests/test_cpp_runtime.py measures it); IEEE special values (NaN, +-inf, +-0, overflow,
// underflow) come out as libm gives them. Double overloads call libm: double is rarely hot.
// Helpers the code generator calls: NaN-propagating max/min, Python-semantics floordiv/remainder,
// rsqrt, sign, relu, and bfloat16/float16 <-> float32 conversions (round to nearest even).
// Only tiny C headers are included so that a one-kernel file compiles fast.
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <omp.h>

#define STAX_INLINE static inline __attribute__((always_inline))

// ---- bit casts (memcpy: defined behaviour, compiles to nothing, vectorizes) ----
STAX_INLINE float stax_i2f(int32_t i) { float f; memcpy(&f, &i, 4); return f; }
STAX_INLINE int32_t stax_f2i(float f) { int32_t i; memcpy(&i, &f, 4); return i; }
STAX_INLINE uint32_t stax_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
STAX_INLINE float stax_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#define STAX_NANF __builtin_nanf("")
#define STAX_INFF __builtin_inff()

// ---- exp family ----

// Polynomial for exp(r) on [-ln2/2, ln2/2] (Cephes expf, degree 5 for (exp(r)-1-r)/r^2); ~1 ulp.
STAX_INLINE float stax_exp_poly(float r) {
    float z = r * r;
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    return __builtin_fmaf(p, z, r) + 1.0f;
}

// p * 2^k for integer-valued k in [-152, 128]: two power-of-two factors built by integer add into
// the exponent field, so that results that overflow give inf and results in the subnormal range
// are rounded once (by the last multiply), as a correctly scaled value should be.
STAX_INLINE float stax_ldexp_k(float p, float kf) {
    int32_t k = (int32_t)kf;
    int32_t k1 = k >> 1;
    int32_t k2 = k - k1;
    return (p * stax_i2f((k1 + 127) << 23)) * stax_i2f((k2 + 127) << 23);
}

// exp: x clamped to [-104, 89] (beyond: exact 0 / inf after scaling); Cody-Waite range reduction
// x = k*ln2 + r with k = rint(x/ln2) and ln2 split in two (fma), degree-5 minimax polynomial,
// exponent built by integer add. NaN passes by select. Max error ~1 ulp.
STAX_INLINE float stax_exp(float x) {
    float xc = x < -104.0f ? -104.0f : x;
    xc = xc > 89.0f ? 89.0f : xc;
    float k = __builtin_rintf(xc * 1.44269504088896341f);
    float r = __builtin_fmaf(k, -0.693359375f, xc);
    r = __builtin_fmaf(k, 2.12194440e-4f, r);
    float y = stax_ldexp_k(stax_exp_poly(r), k);
    return x != x ? x : y;
}

// exp2: k = rint(x), r = (x - k)*ln2 (x - k is exact), same polynomial and scaling as exp.
STAX_INLINE float stax_exp2(float x) {
    float xc = x < -152.0f ? -152.0f : x;
    xc = xc > 129.0f ? 129.0f : xc;
    float k = __builtin_rintf(xc);
    float f = xc - k;
    float r = __builtin_fmaf(f, 0.693147182464599609375f, f * -1.904654299957768e-09f);
    float y = stax_ldexp_k(stax_exp_poly(r), k);
    return x != x ? x : y;
}

// sigmoid: e = exp(-|x|) (never overflows); sigmoid = (x >= 0 ? 1 : e) / (1 + e). Exact limits
// 0 and 1 at -+inf, keeps subnormal results for very negative x, NaN -> NaN.
STAX_INLINE float stax_sigmoid(float x) {
    float e = stax_exp(-__builtin_fabsf(x));
    float num = x >= 0.0f ? 1.0f : e;
    return num / (1.0f + e);
}

// ---- log family ----

// Shared core: x = 2^e * m with m in [sqrt(1/2), sqrt(2)) (subnormals first scaled by 2^23),
// f = m - 1 (exact); log(1+f) = f - f^2/2 + f^3*P(f), P of degree 8 (Cephes logf).
struct stax_log_parts { float e, f, t; };
STAX_INLINE stax_log_parts stax_log_core(float x) {
    int sub = x < 1.17549435e-38f;
    float xs = sub ? x * 8388608.0f : x;
    int32_t bits = stax_f2i(xs);
    float e = (float)(((bits >> 23) & 0xff) - 127) - (sub ? 23.0f : 0.0f);
    float m = stax_i2f((bits & 0x007fffff) | 0x3f800000);  // m in [1, 2)
    int big = m > 1.41421356237f;
    m = big ? m * 0.5f : m;
    e = big ? e + 1.0f : e;
    float f = m - 1.0f;
    float z = f * f;
    float p = 7.0376836292e-2f;
    p = __builtin_fmaf(p, f, -1.1514610310e-1f);
    p = __builtin_fmaf(p, f, 1.1676998740e-1f);
    p = __builtin_fmaf(p, f, -1.2420140846e-1f);
    p = __builtin_fmaf(p, f, 1.4249322787e-1f);
    p = __builtin_fmaf(p, f, -1.6668057665e-1f);
    p = __builtin_fmaf(p, f, 2.0000714765e-1f);
    p = __builtin_fmaf(p, f, -2.4999993993e-1f);
    p = __builtin_fmaf(p, f, 3.3333331174e-1f);
    stax_log_parts out = {e, f, __builtin_fmaf(-0.5f, z, f * z * p)};  // t = log(1+f) - f
    return out;
}

// Special values by select: log(0) = -inf, log(x<0) = NaN, log(inf) = inf, NaN -> NaN.
STAX_INLINE float stax_log_special(float x, float y) {
    y = x == 0.0f ? -STAX_INFF : y;
    y = x < 0.0f ? STAX_NANF : y;
    y = x == STAX_INFF ? x : y;
    return x != x ? x : y;
}

// log: log(x) = e*ln2 + log(1+f), ln2 split in two (Cody-Waite) so that e*ln2_hi is exact. ~1 ulp.
STAX_INLINE float stax_log(float x) {
    stax_log_parts lp = stax_log_core(x);
    float e = lp.e, f = lp.f, t = lp.t;
    float y = __builtin_fmaf(e, -2.12194440e-4f, t);
    y = f + y;
    y = __builtin_fmaf(e, 0.693359375f, y);
    return stax_log_special(x, y);
}

// log2: log2(x) = e + log(1+f)*log2(e), log2(e) split in two; exact for powers of two.
STAX_INLINE float stax_log2(float x) {
    stax_log_parts lp = stax_log_core(x);
    float e = lp.e, l = lp.f + lp.t;
    float y = __builtin_fmaf(l, 1.44269502162933349609375f, l * 1.9259629911266175e-08f) + e;
    return stax_log_special(x, y);
}

// ---- erf / tanh ----

// erf: x clamped to [-4, 4] (|erf| rounds to 1 beyond 3.92), then the rational minimax form
// x*P(x^2)/Q(x^2), P degree 6, Q degree 4 (coefficients from Eigen/XLA). ~2 ulp; odd, so
// erf(-0) = -0; NaN passes through the clamp.
STAX_INLINE float stax_erf(float x) {
    float xc = x > 4.0f ? 4.0f : x;
    xc = xc < -4.0f ? -4.0f : xc;
    float z = xc * xc;
    float p = -2.72614225801306e-10f;
    p = __builtin_fmaf(p, z, 2.77068142495902e-08f);
    p = __builtin_fmaf(p, z, -2.10102402082508e-06f);
    p = __builtin_fmaf(p, z, -5.69250639462346e-05f);
    p = __builtin_fmaf(p, z, -7.34990630326855e-04f);
    p = __builtin_fmaf(p, z, -2.95459980854025e-03f);
    p = __builtin_fmaf(p, z, -1.60960333262415e-02f);
    float q = -1.45660718464996e-05f;
    q = __builtin_fmaf(q, z, -2.13374055278905e-04f);
    q = __builtin_fmaf(q, z, -1.68282697438203e-03f);
    q = __builtin_fmaf(q, z, -7.37332916720468e-03f);
    q = __builtin_fmaf(q, z, -1.42647390514189e-02f);
    return xc * (p / q);  // p/q ~ 1.13: one rounding of x*(p/q), so tiny/subnormal x stay exact-ish
}

// tanh: |x| < 0.625: odd polynomial x + x^3*P(x^2), P degree 5 (least-squares fit on Chebyshev
// nodes); otherwise sign(x)*(1 - 2/(exp(2|x|) + 1)) with |x| clamped to 10 (tanh rounds to 1
// there). Both computed, one selected. ~2 ulp; tanh(+-inf) = +-1, tanh(-0) = -0, NaN -> NaN.
STAX_INLINE float stax_tanh(float x) {
    float a = __builtin_fabsf(x);
    float z = x * x;
    float p = 0.002295607700943947f;
    p = __builtin_fmaf(p, z, -0.008346729911863804f);
    p = __builtin_fmaf(p, z, 0.02176986262202263f);
    p = __builtin_fmaf(p, z, -0.05395938828587532f);
    p = __builtin_fmaf(p, z, 0.13333304226398468f);
    p = __builtin_fmaf(p, z, -0.3333333432674408f);
    float small = __builtin_fmaf(x * z, p, x);
    float ac = a > 10.0f ? 10.0f : a;
    float e = stax_exp(2.0f * ac);
    float big = 1.0f - 2.0f / (e + 1.0f);
    big = x < 0.0f ? -big : big;
    float y = a < 0.625f ? small : big;
    y = x == 0.0f ? x : y;  // keeps the sign of zero
    return x != x ? x : y;
}

// ---- sin / cos ----

// Shared reduction: k = rint(x*2/pi), r = x - k*pi/2 with pi/2 split in three floats and fma
// (Cody-Waite; the first step is exact, so r is good to ~1 ulp for |x| up to ~1e7, well past
// 1e5), then a second one-step round. Beyond, r is clamped to [-0.8, 0.8]: results stay finite
// in [-1, 1] but are not accurate there. Quadrant q = k mod 4 computed in float (no int overflow).
struct stax_sincos_parts { float s, c; int32_t q; };
STAX_INLINE stax_sincos_parts stax_sincos_core(float x) {
    float xf = __builtin_fabsf(x) <= 3.40282347e38f ? x : 0.0f;  // inf/NaN: fixed up by callers
    float k = __builtin_rintf(xf * 0.636619772367581343f);
    float r = __builtin_fmaf(k, -1.57079637050628662109375f, xf);
    r = __builtin_fmaf(k, 4.371138828673793e-08f, r);
    r = __builtin_fmaf(k, 1.7151245100058819e-15f, r);
    // second round: k*2/pi rounded in float can be off by one for large |x| (|r| up to ~3pi/4);
    // r - k2*pi/2 is exact there (Sterbenz), so one more step puts r in [-pi/4, pi/4].
    float k2 = __builtin_rintf(r * 0.636619772367581343f);
    r = __builtin_fmaf(k2, -1.57079637050628662109375f, r);
    r = __builtin_fmaf(k2, 4.371138828673793e-08f, r);
    k = k + k2;
    // past ~1e7 the reduction is not accurate; keep the polynomials in range (finite, in [-1, 1])
    r = r > 0.8f ? 0.8f : r;
    r = r < -0.8f ? -0.8f : r;
    float kq = k - 4.0f * __builtin_rintf(k * 0.25f);  // in [-2, 2], exact; & 3 below = k mod 4
    int32_t q = (int32_t)kq & 3;
    float z = r * r;
    // sin(r) = r + r^3*S(r^2), cos(r) = 1 - r^2/2 + r^4*C(r^2) (Cephes sinf/cosf on [-pi/4, pi/4]).
    float s = -1.9515295891e-4f;
    s = __builtin_fmaf(s, z, 8.3321608736e-3f);
    s = __builtin_fmaf(s, z, -1.6666654611e-1f);
    s = __builtin_fmaf(s * z, r, r);
    float c = 2.443315711809948e-5f;
    c = __builtin_fmaf(c, z, -1.388731625493765e-3f);
    c = __builtin_fmaf(c, z, 4.166664568298827e-2f);
    c = __builtin_fmaf(c * z, z, __builtin_fmaf(-0.5f, z, 1.0f));
    stax_sincos_parts out = {s, c, q};
    return out;
}

// sin: quadrant q selects +-sin(r) / +-cos(r). sin(+-0) = +-0; sin(+-inf) = sin(NaN) = NaN.
STAX_INLINE float stax_sin(float x) {
    stax_sincos_parts sc = stax_sincos_core(x);
    float s = sc.s, c = sc.c;
    int32_t q = sc.q;
    float y = (q & 1) ? c : s;
    y = (q & 2) ? -y : y;
    y = x == 0.0f ? x : y;
    return __builtin_fabsf(x) <= 3.40282347e38f ? y : x - x;
}

// cos: cos(x) = sin(x + pi/2): quadrant q + 1. cos(+-inf) = cos(NaN) = NaN.
STAX_INLINE float stax_cos(float x) {
    stax_sincos_parts sc = stax_sincos_core(x);
    float s = sc.s, c = sc.c;
    int32_t q = sc.q;
    q = q + 1;
    float y = (q & 1) ? c : s;
    y = (q & 2) ? -y : y;
    return __builtin_fabsf(x) <= 3.40282347e38f ? y : x - x;
}

// ---- double versions: libm (double is rarely hot) ----
STAX_INLINE double stax_exp(double x) { return exp(x); }
STAX_INLINE double stax_exp2(double x) { return exp2(x); }
STAX_INLINE double stax_log(double x) { return log(x); }
STAX_INLINE double stax_log2(double x) { return log2(x); }
STAX_INLINE double stax_erf(double x) { return erf(x); }
STAX_INLINE double stax_tanh(double x) { return tanh(x); }
STAX_INLINE double stax_sin(double x) { return sin(x); }
STAX_INLINE double stax_cos(double x) { return cos(x); }
STAX_INLINE double stax_sigmoid(double x) {
    double e = exp(-fabs(x));
    return (x >= 0.0 ? 1.0 : e) / (1.0 + e);
}

// ---- helpers the code generator calls ----

// max/min that propagate NaN (torch.maximum/minimum): if either is NaN the result is NaN.
// One template for float, double and the integer types (a != a is false for integers).
template <class T> STAX_INLINE T stax_max(T a, T b) { return (a != a || a > b) ? a : b; }
template <class T> STAX_INLINE T stax_min(T a, T b) { return (a != a || a < b) ? a : b; }

// logaddexp (logcumsumexp's combine), as numpy's npy_logaddexp: equal operands (+-inf too) give
// a + log 2, NaN propagates; libm's exp/log1p, since a scan's loop is sequential anyway.
STAX_INLINE float stax_logaddexp(float a, float b) {
    if (a == b) return a + 0.693147180559945309417232121458176568f;
    float d = a - b;
    return d > 0 ? a + log1pf(expf(-d)) : (d <= 0 ? b + log1pf(expf(d)) : d);
}
STAX_INLINE double stax_logaddexp(double a, double b) {
    if (a == b) return a + 0.693147180559945309417232121458176568;
    double d = a - b;
    return d > 0 ? a + log1p(exp(-d)) : (d <= 0 ? b + log1p(exp(d)) : d);
}

// relu: x < 0 ? 0 : x (NaN -> NaN).
template <class T> STAX_INLINE T stax_relu(T x) { return x < T(0) ? T(0) : x; }

// sign: -1, 0 or 1; +-0 -> +-0 and NaN -> NaN for floats.
template <class T> STAX_INLINE T stax_sign(T x) {
    return x > T(0) ? T(1) : (x < T(0) ? T(-1) : x);
}

// rsqrt: 1/sqrt(x), correctly rounded sqrt then division (vsqrtps + vdivps with -fno-math-errno).
STAX_INLINE float stax_rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
STAX_INLINE double stax_rsqrt(double x) { return 1.0 / __builtin_sqrt(x); }

// Errors eager raises that only show while a kernel runs (an integer division by a zero element,
// an integer to a negative power): the kernel sets a bit here, and the wrapper takes the bits
// after the launch (stax_take_errors, codegen_cpp.py) and raises eager's exception. One word per
// loaded module; relaxed atomics, as many OpenMP threads may set it.
#define STAX_ERR_ZERO_DIV 1
#define STAX_ERR_NEG_POW 2
#define STAX_ERR_INDEX 4
static int stax_errors = 0;
STAX_INLINE void stax_set_error(int bit) { __atomic_fetch_or(&stax_errors, bit, __ATOMIC_RELAXED); }

// Indirect indexing (ops.indirect_indexing): an index i outside [0, n) sets STAX_ERR_INDEX and
// records the first such index as the user wrote it (`raw`, before negative wrapping), the size
// and which indexing site of the kernel failed, for the wrapper's IndexError; the kernel goes on
// with index 0, so it never touches memory outside the buffer.
static int64_t stax_index_info[3];
STAX_INLINE int64_t stax_check_index(int64_t i, int64_t n, int64_t raw, int64_t site) {
    if (__builtin_expect(i >= 0 && i < n, 1)) return i;
    if (!(__atomic_fetch_or(&stax_errors, STAX_ERR_INDEX, __ATOMIC_RELAXED) & STAX_ERR_INDEX)) {
        stax_index_info[0] = raw; stax_index_info[1] = n; stax_index_info[2] = site;
    }
    return 0;
}
extern "C" int64_t stax_index_error_info(int k) { return stax_index_info[k]; }

// floordiv / remainder with Python semantics (torch.floor_divide / torch.remainder): the quotient
// is rounded towards -inf and the remainder has the sign of the divisor. Integers: b == 0 gives 0
// (as numpy does; no SIGFPE) and sets STAX_ERR_ZERO_DIV; b == -1 is handled without overflow.
template <class T> STAX_INLINE T stax_floordiv(T a, T b) {
    if (b == T(0)) { stax_set_error(STAX_ERR_ZERO_DIV); return T(0); }
    if (b == T(-1)) return (T)(T(0) - a);  // INT_MIN / -1 wraps like numpy instead of trapping
    T q = a / b;
    T r = a % b;
    return (r != T(0) && ((r < T(0)) != (b < T(0)))) ? (T)(q - T(1)) : q;
}
template <class T> STAX_INLINE T stax_remainder(T a, T b) {
    if (b == T(0)) { stax_set_error(STAX_ERR_ZERO_DIV); return T(0); }
    if (b == T(-1)) return T(0);
    T r = a % b;
    return (r != T(0) && ((r < T(0)) != (b < T(0)))) ? (T)(r + b) : r;
}
// Floats: Python's divmod (fmod is exact; the quotient (a - mod)/b is then nearly an integer and
// is snapped to it). Division by zero gives the IEEE a/b; remainder(a, 0) = NaN.
template <class F> STAX_INLINE F stax_floordiv_fp(F a, F b) {
    F mod = (F)fmod(a, b);
    F div = (a - mod) / b;
    if (mod != F(0) && ((b < F(0)) != (mod < F(0)))) div -= F(1);
    F fl;
    if (div != F(0)) {
        fl = (F)floor(div);
        if (div - fl > F(0.5)) fl += F(1);
    } else {
        fl = (F)copysign(F(0), a / b);
    }
    return b == F(0) ? a / b : fl;
}
template <class F> STAX_INLINE F stax_remainder_fp(F a, F b) {
    F mod = (F)fmod(a, b);
    if (mod != F(0)) {
        if ((b < F(0)) != (mod < F(0))) mod += b;
    } else {
        mod = (F)copysign(F(0), b);
    }
    return mod;
}
STAX_INLINE float stax_floordiv(float a, float b) { return stax_floordiv_fp<float>(a, b); }
STAX_INLINE double stax_floordiv(double a, double b) { return stax_floordiv_fp<double>(a, b); }
STAX_INLINE float stax_remainder(float a, float b) { return stax_remainder_fp<float>(a, b); }
STAX_INLINE double stax_remainder(double a, double b) { return stax_remainder_fp<double>(a, b); }

// ---- bfloat16 / float16 <-> float32 (stored as uint16_t bits) ----

// bf16 -> f32: the bf16 bits are the top half of the float32.
STAX_INLINE float stax_bf16_to_f32(uint16_t h) { return stax_u2f((uint32_t)h << 16); }

// f32 -> bf16: round to nearest even by adding 0x7fff + lsb; NaN kept (quieted, sign kept).
STAX_INLINE uint16_t stax_f32_to_bf16(float f) {
    uint32_t u = stax_f2u(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x0040u;
    return (uint16_t)(f != f ? nan : rounded);
}

// f16 -> f32 (exact): shift exponent/mantissa into place and rebias; inf/NaN get the full
// exponent; subnormals are renormalized by a float subtract of 2^-14 (exact). NaN is quieted.
STAX_INLINE float stax_f16_to_f32(uint16_t h) {
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    uint32_t exp = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    uint32_t inf_nan = o + ((uint32_t)(128 - 16) << 23);
    inf_nan |= (exp == 0x0f800000u && (h & 0x3ffu)) ? 0x00400000u : 0u;
    float sub = stax_u2f(o + (1u << 23)) - 6.103515625e-05f;
    uint32_t r = exp == 0x0f800000u ? inf_nan : (exp == 0 ? stax_f2u(sub) : o);
    return stax_u2f(r | (((uint32_t)h & 0x8000u) << 16));
}

// f32 -> f16, IEEE round to nearest even (F. Giesen's method, branch-free): normals by integer
// rebias + rounding bias (0xfff + lsb); results below 2^-14 by adding a magic float so that the
// FPU's own round-to-nearest-even aligns the 10 mantissa bits (subnormals exact); >= 65520 -> inf;
// NaN -> quiet NaN with the top payload bits kept (as F16C's vcvtps2ph does).
STAX_INLINE uint16_t stax_f32_to_f16(float f) {
    uint32_t u = stax_f2u(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    uint32_t normal = (a + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    float denorm_magic = 0.5f;  // bits ((127 - 15) + (23 - 10) + 1) << 23
    uint32_t sub = stax_f2u(stax_u2f(a) + denorm_magic) - stax_f2u(denorm_magic);
    uint32_t special = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : 0x7c00u;
    uint32_t r = a >= 0x47800000u ? special : (a < 0x38800000u ? sub : normal);
    return (uint16_t)(r | sign);
}
