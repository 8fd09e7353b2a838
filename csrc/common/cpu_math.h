// Small CPU math helpers written so that the compiler vectorises the loops that
// call them (no branches, no library calls).
#pragma once

#include <cstdint>
#include <cstring>

namespace headscope {

// 8 floats / 8 int32 (GCC/Clang vector extensions: one AVX register with -march=native,
// two SSE halves otherwise).
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

// exp(x) for x in [-700, 0], within about 2 ulp of std::exp: x = k ln2 + f with
// |f| <= ln2 / 2, e^f by its Taylor series to degree 13 (truncation < 1e-17), and
// 2^k assembled in the exponent bits. Arguments outside the range give meaningless
// values (never undefined behaviour): callers check their ranges before using results.
inline double exp_nonpositive(double x) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: rounds to an integer
  const double t = x * kLog2e + kShifter;
  const double k = t - kShifter;
  const double f = (x - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * f + 1.0 / 479001600.0;
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
  int64_t ti, si;
  std::memcpy(&ti, &t, sizeof ti);
  std::memcpy(&si, &kShifter, sizeof si);
  const uint64_t bits = static_cast<uint64_t>(ti - si + 1023) << 52;  // 2^k
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
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
    f8 v;
    std::memcpy(&v, src + i, sizeof v);
    v = exp8_le0(v - shift) * mul;
    std::memcpy(dst + i, &v, sizeof v);
    sum += v;
  }
  if (i < n) {
    f8 v = f8{} - __builtin_inff();  // padding lanes: exp(-inf) = 0
    std::memcpy(&v, src + i, sizeof(float) * (n - i));
    v = exp8_le0(v - shift) * mul;
    std::memcpy(dst + i, &v, sizeof(float) * (n - i));
    sum += v;
  }
  float total = 0.f;
  for (int k = 0; k < 8; ++k) total += sum[k];
  return total;
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
    f8 v;
    std::memcpy(&v, x + i, sizeof v);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int j = 1; j < 8; ++j) r = m[j] > r ? m[j] : r;
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

}  // namespace headscope
