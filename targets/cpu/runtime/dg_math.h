// dg_math.h - vectorizable single-precision math functions for generated kernels.
//
// Functions (namespace dg::math), drop-in replacements for the <cmath> float
// functions named in the comments:
//
//   float exp_f(float x)     e^x          (expf)
//   float expm1_f(float x)   e^x - 1      (expm1f; accurate for tiny |x|)
//   float log_f(float x)     ln x         (logf)
//   float log1p_f(float x)   ln(1 + x)    (log1pf; accurate for tiny |x|)
//   float tanh_f(float x)    tanh x       (tanhf)
//   float sigmoid_f(float x) 1 / (1 + e^-x)  (no libm function; the printer's
//                            form of (1 + tanh(x/2)) / 2)
//   float erf_f(float x)     erf x        (erff; used by gelu)
//   float max_f(float a, float b), min_f(float a, float b)
//                            max/min that propagate a NaN in b (relu(NaN)
//                            is NaN, as in numpy); one vmaxps/vminps, where
//                            GCC calls libm's fmaxf/fminf out of line
//   float flush_subnormal_f(float x)
//                            x, or 0 where x is subnormal (the optimizers'
//                            decaying state; see below)
//
// Why: GCC cannot vectorize a loop that calls libm's expf/tanhf/... unless
// -ffast-math is given, which deepgen does not use (NaN and signed-zero
// semantics matter).  These functions are inline and branch-free: every lane
// computes every path and picks its result with bit-mask selects (see
// detail::select), using only float arithmetic and integer/bit operations on
// the float's representation (memcpy bit casts), with no table lookups.  So
// GCC -O3 vectorizes `for (i) y[i] = dg::math::tanh_f(x[i]);` with plain SSE2
// as well as with -mavx2 -mfma, under the default -ftrapping-math.
//
// Accuracy, measured over all 2^32 inputs against double-precision libm, with
// and without FMA (tests/test_math.py checks a dense sweep): every result is
// within 1 ulp of the correctly rounded float, sigmoid's within 2 (the bound
// promised is 2 ulp);
// the largest error |result - exact| / ulp is given at each function ("without
// FMA": plain SSE2 builds; -ffp-contract=fast with FMA measures as with FMA).
// Relative accuracy is kept for tiny |x| in expm1/log1p/tanh/erf, for
// sigmoid's results down into the subnormals, and
// subnormal inputs and outputs are handled.
// Special values follow IEEE-754/C99 Annex F: NaN in -> NaN out; exp(+inf) =
// +inf, exp(-inf) = +0, overflow -> +inf, underflow -> subnormal or 0;
// expm1(-inf) = -1; log(+-0) = -inf, log(x < 0) = NaN, log(+inf) = +inf;
// log1p(-1) = -inf, log1p(x < -1) = NaN; tanh(+-inf) = +-1; erf(+-inf) = +-1;
// the odd functions and expm1/log1p keep the sign of zero.  Floating-point
// exception flags are not meaningful (every path is evaluated).
//
// FMA: where the compiler reports fast fused multiply-add (__FP_FAST_FMAF,
// e.g. -mfma or -march=haswell), mul_add uses it; otherwise it is a*b + c.
// The error bounds hold for both, and for either -ffp-contract setting.
// Do not compile with -ffast-math: the range reduction relies on IEEE
// rounding of each operation (e.g. adding and subtracting 1.5 * 2^23).
//
// Polynomial coefficients were fitted for this file: near-minimax fits of the
// relative error (Lawson's iteratively reweighted least squares on 4000
// Chebyshev nodes, mpmath 40-digit reference values), then rounded to float
// one coefficient at a time from the lowest order up, refitting the remaining
// ones after each rounding.  The "max fit error" comments give the weighted
// error of the rounded polynomial in exact arithmetic.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__GNUC__)
#define DG_MATH_INLINE inline __attribute__((always_inline))
#else
#define DG_MATH_INLINE inline
#endif

namespace dg::math {

namespace detail {

DG_MATH_INLINE uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

DG_MATH_INLINE float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// a * b + c, fused where the target has a fast FMA instruction.
DG_MATH_INLINE float mul_add(float a, float b, float c) {
#if defined(__FP_FAST_FMAF)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// |x| and the sign bit of x.
DG_MATH_INLINE float abs_f(float x) {
  return from_bits(bits(x) & 0x7FFFFFFFu);
}
DG_MATH_INLINE float with_sign_of(float magnitude, float sign) {
  return from_bits(bits(magnitude) | (bits(sign) & 0x80000000u));
}

// c ? a : b as a bit-mask blend of two computed values.  Plain `?:` on floats lets GCC turn
// the select back into a branch around the computation of one operand; under the default
// -ftrapping-math its if-conversion then refuses to evaluate that floating-point code
// unconditionally and the loop is not vectorized.  Masks keep every select branch-free.
DG_MATH_INLINE uint32_t mask(bool c) {
  return 0u - static_cast<uint32_t>(c);
}
DG_MATH_INLINE float select(bool c, float a, float b) {
  uint32_t m = mask(c);
  return from_bits((bits(a) & m) | (bits(b) & ~m));
}
DG_MATH_INLINE int32_t select(bool c, int32_t a, int32_t b) {
  uint32_t m = mask(c);
  return static_cast<int32_t>((static_cast<uint32_t>(a) & m) | (static_cast<uint32_t>(b) & ~m));
}

// 2^k for an integer k in [-126, 127] (a normal float).
DG_MATH_INLINE float pow2i(int32_t k) {
  return from_bits((static_cast<uint32_t>(k) + 127u) << 23);
}

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Adding 1.5 * 2^23 to |v| < 2^22 rounds v to an integer held in the low mantissa bits.
constexpr float kRoundShift = 0x1.8p23f;
constexpr float kLog2e = 0x1.715476p+0f;  // 1/ln 2
// ln 2 = kLn2Hi + kLn2Lo; kLn2Hi has 15 significant bits, so n * kLn2Hi is exact for |n| < 512.
constexpr float kLn2Hi = 0x1.62e4p-1f;           // 0.693145751953125
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;        // 1.42860677e-06
constexpr uint32_t kSqrtHalfBits = 0x3F3504F3u;  // sqrt(1/2) as float bits
constexpr float kSqrtHalfM1 = -0x1.2bec34p-2f;   // sqrt(1/2) - 1
constexpr float kSqrt2M1 = 0x1.a8279ap-2f;       // sqrt(2) - 1

// x = n ln2 + r with n = round(x / ln2), for |x| < ~150 (n fits the shift trick).
// r = r_hi + r_lo: r_hi = x - n * kLn2Hi is exact, r_lo = -n * kLn2Lo is tiny.
struct Ln2Reduction {
  int32_t n;
  float r_hi, r_lo;
};

DG_MATH_INLINE Ln2Reduction reduce_ln2(float x) {
  float t = mul_add(x, kLog2e, kRoundShift);
  float nf = t - kRoundShift;
  Ln2Reduction red;
  red.n = static_cast<int32_t>(bits(t) - bits(kRoundShift));
  red.r_hi = mul_add(-nf, kLn2Hi, x);  // exact with or without fusing
  red.r_lo = -nf * kLn2Lo;
  return red;
}

// q(r) with e^r - 1 = r + r^2 q(r) for |r| <= ln(2)/2 (degree 5;
// max fit error 2^-31.0 relative to e^r - 1).
DG_MATH_INLINE float expm1_q(float r) {
  float q = 0x1.9e8ae4p-13f;
  q = mul_add(q, r, 0x1.6d404ep-10f);
  q = mul_add(q, r, 0x1.1112d0p-7f);
  q = mul_add(q, r, 0x1.5554f4p-5f);
  q = mul_add(q, r, 0x1.555554p-3f);
  q = mul_add(q, r, 0x1.0p-1f);
  return q;
}

// e^(x + x_lo) for x + x_lo in [-87, 88] (2^n stays a normal float) and |x_lo| <= 2^-6 |x|.
// n comes from the rounded sum, so |r| stays within the fitted interval.
DG_MATH_INLINE float exp_core(float x, float x_lo) {
  Ln2Reduction red = reduce_ln2(x + x_lo);
  float nf = static_cast<float>(red.n);
  float r_hi = mul_add(-nf, kLn2Hi, x);  // exact: |r_hi| < 1/2 on the grid of x's ulp
  float r = r_hi + (red.r_lo + x_lo);
  float p = 1.0f + mul_add(r * r, expm1_q(r), r);
  return p * pow2i(red.n);
}

// log(1 + f) for f in [sqrt(1/2) - 1, sqrt(2) - 1] as f + f^2 P(f) (degree 8;
// max fit error 2^-27.8 relative to log1p(f)), plus e * ln 2 and a small
// correction `corr` (added before the final roundings).
DG_MATH_INLINE float log_core(float e, float f, float corr) {
  float p = -0x1.383ebcp-4f;
  p = mul_add(p, f, 0x1.087e60p-3f);
  p = mul_add(p, f, -0x1.0f4f0ep-3f);
  p = mul_add(p, f, 0x1.226b2ap-3f);
  p = mul_add(p, f, -0x1.542402p-3f);
  p = mul_add(p, f, 0x1.99a428p-3f);
  p = mul_add(p, f, -0x1.000438p-2f);
  p = mul_add(p, f, 0x1.555550p-2f);
  p = mul_add(p, f, -0x1.fffff8p-2f);
  float lo = mul_add(e, kLn2Lo, corr);
  float s = mul_add(f * f, p, lo);
  return mul_add(e, kLn2Hi, f + s);  // e * kLn2Hi is exact
}

// Splits u > 0 (normal) into u = 2^e m with m in [sqrt(1/2), sqrt(2)); returns m - 1 (exact).
DG_MATH_INLINE float split_log(float u, int32_t& e) {
  uint32_t ub = bits(u);
  e = static_cast<int32_t>(ub - kSqrtHalfBits) >> 23;
  float m = from_bits(ub - (static_cast<uint32_t>(e) << 23));
  return m - 1.0f;
}

}  // namespace detail

// e^x.  Max error 0.98 ulp (0.95 without FMA).
DG_MATH_INLINE float exp_f(float x) {
  using namespace detail;
  // Clamping keeps n in [-150, 128]: exp(-104) rounds to 0 and exp(89) overflows to inf.
  // NaN passes both comparisons and propagates.
  float xc = select(x < -104.0f, -104.0f, x);
  xc = select(xc > 89.0f, 89.0f, xc);
  Ln2Reduction red = reduce_ln2(xc);
  float r = red.r_hi + red.r_lo;
  float p = 1.0f + mul_add(r * r, expm1_q(r), r);
  // 2^n in two normal factors; the last product rounds once (also into subnormals).
  int32_t k1 = red.n >> 1;
  int32_t k2 = red.n - k1;
  return p * pow2i(k1) * pow2i(k2);
}

// e^x - 1.  Max error 0.89 ulp (1.03 without FMA).
DG_MATH_INLINE float expm1_f(float x) {
  using namespace detail;
  // expm1(-30) rounds to -1; expm1(89) overflows.  n in [-44, 129].
  float xc = select(x < -30.0f, -30.0f, x);
  xc = select(xc > 89.0f, 89.0f, xc);
  Ln2Reduction red = reduce_ln2(xc);
  float r = red.r_hi + red.r_lo;
  // e^x - 1 = 2^n (c + e^r - 1) with c = 1 - 2^-n and e^r - 1 = r_hi + b.
  //   0 <= n <= 23: (c + r_hi) + b; c + r_hi is exact, which avoids rounding the
  //                 cancellation near n = 1.
  //   n < 0:        c + (r_hi + b); the rounding of e^r - 1 is small against the result.
  //   n > 23:       1 + ((r_hi + b) - 2^-n), as c = 1 - 2^-n itself would round.
  float b = mul_add(r * r, expm1_q(r), red.r_lo);
  int32_t m = select(red.n < 30, red.n, 30);
  float p2 = pow2i(-m);
  bool big = red.n > 23;
  float c_hi = select(big, 1.0f, 1.0f - p2);
  float c_lo = select(big, -p2, 0.0f);
  float sum = select((red.n < 0) | big, c_hi + ((red.r_hi + b) + c_lo), (c_hi + red.r_hi) + b);
  int32_t k1 = red.n >> 1;
  int32_t k2 = red.n - k1;
  float y = sum * pow2i(k1) * pow2i(k2);
  return select(x == 0.0f, x, y);  // keeps -0
}

// Natural logarithm.  Max error 0.88 ulp (0.90 without FMA).
DG_MATH_INLINE float log_f(float x) {
  using namespace detail;
  bool sub = x < 0x1p-126f;  // subnormal (or <= 0: replaced below)
  float xs = select(sub, x * 0x1p23f, x);
  int32_t e;
  float f = split_log(xs, e);
  float ef = static_cast<float>(e) - select(sub, 23.0f, 0.0f);
  float y = log_core(ef, f, 0.0f);
  y = select(x < kInf, y, x + x);  // +inf, NaN (quieted)
  y = select(x < 0.0f, kNaN, y);
  return select(x == 0.0f, -kInf, y);
}

// log(1 + x).  Max error 0.88 ulp (0.97 without FMA).
DG_MATH_INLINE float log1p_f(float x) {
  using namespace detail;
  // Outside the core's interval: 1 + x = u + c exactly (u rounded, c its error), and
  // log(u + c) ~ log(u) + c / u.
  float u = 1.0f + x;
  float c = select(x < 1.0f, x - (u - 1.0f), 1.0f - (u - x));
  float corr = c / u;
  int32_t e;
  float f = split_log(u, e);
  // Inside [sqrt(1/2) - 1, sqrt(2) - 1] the core takes x itself (exact, no reduction).
  bool direct = (x > kSqrtHalfM1) & (x < kSqrt2M1);
  f = select(direct, x, f);
  float ef = select(direct, 0.0f, static_cast<float>(e));
  corr = select(direct, 0.0f, corr);
  float y = log_core(ef, f, corr);
  y = select(x < kInf, y, x + x);  // +inf, NaN (quieted)
  y = select(x < -1.0f, kNaN, y);
  y = select(x == -1.0f, -kInf, y);
  return select(x == 0.0f, x, y);  // keeps -0
}

// Hyperbolic tangent.  Max error 1.06 ulp (with or without FMA).
DG_MATH_INLINE float tanh_f(float x) {
  using namespace detail;
  float a = abs_f(x);
  // |x| < 0.75: odd polynomial a + a^3 P(a^2) (degree 6 in a^2; max fit error 2^-32.6
  // relative to tanh).
  float a2 = a * a;
  float p = -0x1.36cde8p-11f;
  p = mul_add(p, a2, 0x1.7b6918p-9f);
  p = mul_add(p, a2, -0x1.17e644p-7f);
  p = mul_add(p, a2, 0x1.64ebf4p-6f);
  p = mul_add(p, a2, -0x1.ba021p-5f);
  p = mul_add(p, a2, 0x1.1110ap-3f);
  p = mul_add(p, a2, -0x1.555554p-2f);
  float small = mul_add(a * a2, p, a);
  // Otherwise 1 - 2 / (e^(2a) + 1); tanh(a) rounds to 1 for a > 9.01.  NaN propagates.
  // e^(2a) + 1 = (2^n + 1) + 2^n (e^r - 1) rounds once (2^n + 1 is exact for n <= 23).
  float ac = select(a > 9.5f, 9.5f, a);
  Ln2Reduction red = reduce_ln2(2.0f * ac);
  float r = red.r_hi + red.r_lo;
  float scale = pow2i(red.n);
  float den = mul_add(scale, mul_add(r * r, expm1_q(r), r), scale + 1.0f);
  float large = 1.0f - 2.0f / den;
  return with_sign_of(select(a < 0.75f, small, large), x);
}

// Logistic sigmoid 1 / (1 + e^-x), from t = e^-|x| in [0, 1]: 1 / (1 + t) for
// x >= 0 and t / (1 + t) for x < 0, which keeps relative accuracy as the result
// underflows.  One exp and one division, where (1 + tanh(x/2)) / 2, the form the
// ops' expressions use, costs tanh's two paths and its division (and loses all
// relative accuracy for x below about -10: 1 + tanh cancels).  NaN propagates;
// sigmoid(+-0) = 0.5.  Max error 2.40 ulp, at most 2 ulp from the correctly
// rounded float (all 2^32 inputs, with or without FMA): t's error of up to 0.98
// ulp counts double where t / (1 + t) falls into the binade below t's.
// (Carrying t's tail through the division brings it under 1 ulp, but costs a
// third more time than the tanh form; this one costs a fifth less.)
DG_MATH_INLINE float sigmoid_f(float x) {
  using namespace detail;
  float t = exp_f(-abs_f(x));
  return select(x < 0.0f, t, 1.0f) / (1.0f + t);
}

// Error function.  Max error 0.99 ulp (1.32 without FMA, near |x| = 1).
DG_MATH_INLINE float erf_f(float x) {
  using namespace detail;
  float a = abs_f(x);
  // |x| < 1: a + a P(a^2) (degree 6; max fit error 2^-29.4 relative to erf).
  float a2 = a * a;
  float p = 0x1.4771fcp-14f;
  p = mul_add(p, a2, -0x1.a3515ep-11f);
  p = mul_add(p, a2, 0x1.53f224p-8f);
  p = mul_add(p, a2, -0x1.b7f71ap-6f);
  p = mul_add(p, a2, 0x1.ce2ce6p-4f);
  p = mul_add(p, a2, -0x1.81273ep-2f);
  p = mul_add(p, a2, 0x1.06eba8p-3f);
  float small = mul_add(a, p, a);
  // 1 <= |x| <= 4: 1 - e^(-a^2) Q(s), s = 2 / (2 + a) - 1/2 = (1 - a/2) / (2 + a) in
  // [-1/6, 1/6] (1 - a/2 is exact) (degree 7; max fit error 2^-25.8 relative to
  // erfc(a) e^(a^2), most of it the rounding of the constant term).  erf rounds to 1 beyond 3.92.
  float ac = select(a > 4.0f, 4.0f, a);
  float t = (1.0f - 0.5f * ac) / (2.0f + ac);
  float q = 0x1.82f1d6p-4f;
  q = mul_add(q, t, -0x1.eebbd4p-5f);
  q = mul_add(q, t, -0x1.c80dacp-3f);
  q = mul_add(q, t, 0x1.eb809ap-5f);
  q = mul_add(q, t, 0x1.437d3cp-1f);
  q = mul_add(q, t, 0x1.eeea1ep-1f);
  q = mul_add(q, t, 0x1.b57036p-1f);
  q = mul_add(q, t, 0x1.058672p-2f);
  // a^2 = hi + lo exactly: hi = a_hi^2 with a_hi the top 12 bits of a (an exact product).
  float a_hi = from_bits(bits(ac) & 0xFFFFF000u);
  float a_lo = ac - a_hi;
  float large = 1.0f - exp_core(-(a_hi * a_hi), -(a_lo * (ac + a_hi))) * q;
  return with_sign_of(select(a < 1.0f, small, large), x);
}

// a > b ? a : b: one vector max instruction, which returns b when either is NaN.
inline float max_f(float a, float b) {
  return a > b ? a : b;
}
inline float min_f(float a, float b) {
  return a < b ? a : b;
}

// x, or +0 where x is subnormal (0 < |x| < 2^-126); NaN and infinities pass.  The
// optimizers' decaying state (a momentum buffer, Adam's moments) goes through it:
// under zero gradients (a dead unit, an embedding row no batch reads) it shrinks
// geometrically into the subnormals, where each multiply costs Intel cores a
// microcode assist (a train step seen 4.5x slower).  A compare and a blend.
inline float flush_subnormal_f(float x) {
  return detail::select(detail::abs_f(x) < std::numeric_limits<float>::min(), 0.0f, x);
}

}  // namespace dg::math
