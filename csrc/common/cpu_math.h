// Small CPU math helpers written so that the compiler vectorises the loops that
// call them (no branches, no library calls, no libmvec, no -ffast-math).
#pragma once

#include "common/cpu_simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace headscope {

// The unsigned integers of a double's bits: uint64_t for double, a vector of them of the
// same width for a vector of doubles.
template <typename V>
struct BitsOf {
  typedef uint64_t type __attribute__((vector_size(sizeof(V))));
};
template <>
struct BitsOf<double> {
  using type = uint64_t;
};
template <typename V>
using Bits = typename BitsOf<V>::type;

template <typename To, typename From>
inline To bit_cast_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast_as: sizes differ");
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

// exp(x) for x in [-700, 0], within about 2 ulp of std::exp: x = k ln2 + f with
// |f| <= ln2 / 2, e^f by its Taylor series to degree 13 (truncation < 1e-17), and
// 2^k assembled in the exponent bits. Arguments outside the range give meaningless
// values (never undefined behaviour): callers check their ranges before using results.
// V: double, or a vector of doubles (dw) for as many at once.
template <typename V>
inline V exp_nonpositive(V x) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: rounds to an integer
  constexpr uint64_t kShifterBits = 0x4338000000000000;
  const V t = x * kLog2e + kShifter;
  const V k = t - kShifter;
  const V f = (x - k * kLn2Hi) - k * kLn2Lo;
  V p = f * (1.0 / 6227020800.0) + 1.0 / 479001600.0;  // 1/13!, 1/12!
  p = p * f + 1.0 / 39916800.0;
  p = p * f + 1.0 / 3628800.0;
  p = p * f + 1.0 / 362880.0;
  p = p * f + 1.0 / 40320.0;
  p = p * f + 1.0 / 5040.0;
  p = p * f + 1.0 / 720.0;
  p = p * f + 1.0 / 120.0;
  p = p * f + 1.0 / 24.0;
  p = p * f + 1.0 / 6.0;
  p = p * f + 0.5;
  p = p * f + 1.0;
  p = p * f + 1.0;
  // 2^k in the exponent bits (wrapping, never undefined, outside the range)
  const Bits<V> scale = (bit_cast_as<Bits<V>>(t) - kShifterBits + 1023) << 52;
  return p * bit_cast_as<V>(scale);
}

// log(x) for positive normal doubles (V: double or dw), within 1 ulp (fdlibm's e_log.c
// without its special cases): x = 2^k m with m in [sqrt(1/2), sqrt(2)) taken from the bits,
// s = (m - 1) / (m + 1) and log(m) = 2 atanh(s) by fdlibm's polynomial in s^2. Zero,
// subnormal, negative, infinite or NaN x give meaningless values: callers keep x normal.
template <typename V>
inline V log_positive_normal(V x) {
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr uint64_t kSqrtHalfBits = 0x3fe6a09e667f3bcd;
  constexpr uint64_t kOneBits = 0x3ff0000000000000;
  const Bits<V> bits = bit_cast_as<Bits<V>>(x) + (kOneBits - kSqrtHalfBits);
  const V m = bit_cast_as<V>((bits & 0x000fffffffffffff) + kSqrtHalfBits);
  // k + 1023 in a double's low mantissa bits, read as an integer-valued double
  const V k = bit_cast_as<V>((bits >> 52) | 0x4330000000000000) - (4503599627370496.0 + 1023);
  const V f = m - 1.0;
  const V s = f / (2.0 + f);
  const V z = s * s, w = z * z;
  const V t1 = w * (3.999999999940941908e-01 +
                    w * (2.222219843214978396e-01 + w * 1.531383769920937332e-01));
  const V t2 = z * (6.666666666666735130e-01 +
                    w * (2.857142874366239149e-01 +
                         w * (1.818357216161805012e-01 + w * 1.479819860511658591e-01)));
  const V hfsq = 0.5 * f * f;
  return k * kLn2Hi - ((hfsq - (s * (hfsq + (t1 + t2)) + k * kLn2Lo)) - f);
}

// exp(x) for x <= ~88, about 1 ulp (Cephes expf), 0 below -87.3 (where the true value is
// under 1.2e-38), on 8 floats at once (GCC/Clang vector extensions; written explicitly
// because the clamps would otherwise become branches under -ftrapping-math).
inline f8 exp8_le0(f8 x) {
  const f8 lo = f8{} - 87.3f, hi = f8{} + 88.3f;
  f8 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const f8 t = xc * 1.44269504088896341f;
  const f8 shifted = t + 12582912.0f;  // 1.5 * 2^23: rounds t to an integer
  const f8 nf = shifted - 12582912.0f;
  i8 ni;
  std::memcpy(&ni, &shifted, sizeof ni);
  ni = ni - 0x4B400000;  // round(t)
  f8 r = xc - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  f8 p = f8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i8 e = (ni + 127) << 23;
  f8 scale;
  std::memcpy(&scale, &e, sizeof scale);
  const f8 y = p * scale;
  return x < lo ? f8{} : y;
}

// dst[i] = exp(src[i] - shift) * mul for i < n (src may equal dst; src[i] - shift <= ~88,
// -inf gives 0); returns the sum of the results (8 lanes, then the lanes in order).
inline float exp_shift_scale(float* dst, const float* src, int64_t n, float shift, float mul) {
  f8 sum = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const f8 v = exp8_le0(vload(src + i) - shift) * mul;
    vstore(dst + i, v);
    sum += v;
  }
  if (i < n) {
    f8 v = f8{} - __builtin_inff();  // padding lanes: exp(-inf) = 0
    std::memcpy(&v, src + i, sizeof(float) * (n - i));
    v = exp8_le0(v - shift) * mul;
    std::memcpy(dst + i, &v, sizeof(float) * (n - i));
    sum += v;
  }
  return hsum(sum);
}

// Largest of x[0..n) (-inf when n == 0; NaN entries are passed over), in 8 lanes.
template <typename T>
inline T max_of(const T* x, int64_t n) {
  T m[8];
  for (auto& v : m) v = -__builtin_inf();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
  for (; i < n; ++i) m[0] = x[i] > m[0] ? x[i] : m[0];
  T r = m[0];
  for (int j = 1; j < 8; ++j) r = m[j] > r ? m[j] : r;
  return r;
}

// The same for floats in one vector register: GCC leaves the generic loop scalar.
template <>
inline float max_of<float>(const float* x, int64_t n) {
  f8 m = f8{} - __builtin_inff();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const f8 v = vload(x + i);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int j = 1; j < 8; ++j) r = m[j] > r ? m[j] : r;
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

// Base-2 log of 8 positive normal floats, within 2.5 ulp (measured over every float from
// 2^-60 to 2^21), without a division (the tile loop's one division, p / q, keeps the divider
// busy) and in half the multiply-adds of a polynomial over a whole octave, which bound the
// tile loop: x = 2^k m with m in [sqrt(1/2), sqrt(2)); the top three bits of m's mantissa
// pick c ~ 1/m from a table, r = m c - 1 (one rounding, |r| < 0.058) and
// log2(x) = k + log2(1/c) + r P(r), P of degree 4 (approximation error 6e-9). The c around
// m = 1 is 1, so results near 0 keep their relative accuracy; each other c is the float near
// 1/m whose log2(1/c) is a float to within 1e-12, so the table adds no rounding.
inline f8 log2_8_pos(f8 x) {
  static constexpr float kC[8] = {1.356148f,   1.24505782f,  1.15562713f,  1.07614207f,
                                  1.0f,        0.907144368f, 0.813989699f, 0.74211055f};
  static constexpr float kL[8] = {-0.439514637f, -0.316212744f, -0.208675981f, -0.105868556f,
                                  0.0f,          0.140595928f,  0.296917558f,  0.430293977f};
  i8 ix;
  std::memcpy(&ix, &x, sizeof ix);
  ix += 0x3f800000 - 0x3f3504f3;  // the exponent of x / sqrt(1/2)
  const i8 k = (ix >> 23) - 0x7f;
  const i8 mant = ix & 0x007fffff;
  const i8 idx = mant >> 20;
  const i8 mbits = mant + 0x3f3504f3;
  f8 m, c, l;
  std::memcpy(&m, &mbits, sizeof m);
#if defined(__AVX2__)
  f8 tc, tl;
  std::memcpy(&tc, kC, sizeof tc);
  std::memcpy(&tl, kL, sizeof tl);
  c = reinterpret_cast<f8>(_mm256_permutevar8x32_ps(reinterpret_cast<__m256>(tc),
                                                    reinterpret_cast<__m256i>(idx)));
  l = reinterpret_cast<f8>(_mm256_permutevar8x32_ps(reinterpret_cast<__m256>(tl),
                                                    reinterpret_cast<__m256i>(idx)));
#else
  for (int j = 0; j < 8; ++j) {
    c[j] = kC[idx[j]];
    l[j] = kL[idx[j]];
  }
#endif
  const f8 r = m * c - 1.0f;
  f8 p = f8{} + 0.290217966f;
  p = p * r - 0.361642182f;
  p = p * r + 0.480895519f;
  p = p * r - 0.721346736f;
  p = p * r + 1.44269502f;
  return r * p + (__builtin_convertvector(k, f8) + l);
}

// s + e = s + v exactly (TwoSum: e collects the addition's rounding error).
template <typename T>
inline void two_sum(T& s, T& e, T v) {
  const T t = s + v, bv = t - s;
  e += (s - (t - bv)) + (v - bv);
  s = t;
}

}  // namespace headscope
