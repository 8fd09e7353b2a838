// Float log / exp the vas kernels vectorise (no libmvec, no -ffast-math),
// and the small row-major matrix products of the vas CPU kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace headscope::vas::cpu {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Natural log of a positive normal float, < 1 ulp (the FreeBSD/musl logf reduction
// and polynomial). Callers only pass ratios of values clipped to [1e-12, ...].
inline float log_pos(float x) {
  constexpr float ln2_hi = 6.9313812256e-01f, ln2_lo = 9.0580006145e-06f;
  constexpr float Lg1 = 0.66666662693f, Lg2 = 0.40000972152f, Lg3 = 0.28498786688f,
                  Lg4 = 0.24279078841f;
  uint32_t ix = float_to_bits(x);
  ix += 0x3f800000u - 0x3f3504f3u;
  const int32_t k = static_cast<int32_t>(ix >> 23) - 0x7f;
  ix = (ix & 0x007fffffu) + 0x3f3504f3u;
  const float f = bits_to_float(ix) - 1.0f;
  const float s = f / (2.0f + f);
  const float z = s * s, w = z * z;
  const float t1 = w * (Lg2 + w * Lg4), t2 = z * (Lg1 + w * Lg3);
  const float R = t2 + t1, hfsq = 0.5f * f * f;
  const float dk = static_cast<float>(k);
  return s * (hfsq + R) + dk * ln2_lo - hfsq + f + dk * ln2_hi;
}

// exp(x) for x <= ~88, about 1 ulp (Cephes expf), 0 below -87.3 (where the true value is
// under 1.2e-38), on 8 floats at once (GCC/Clang vector extensions; written explicitly
// because the clamps would otherwise become branches under -ftrapping-math).


// log_pos on 8 floats.
inline f8 log8_pos(f8 x) {
  constexpr float ln2_hi = 6.9313812256e-01f, ln2_lo = 9.0580006145e-06f;
  constexpr float Lg1 = 0.66666662693f, Lg2 = 0.40000972152f, Lg3 = 0.28498786688f,
                  Lg4 = 0.24279078841f;
  i8 ix;
  std::memcpy(&ix, &x, sizeof ix);
  ix += 0x3f800000 - 0x3f3504f3;
  const i8 k = (ix >> 23) - 0x7f;
  ix = (ix & 0x007fffff) + 0x3f3504f3;
  f8 f;
  std::memcpy(&f, &ix, sizeof f);
  f -= 1.0f;
  const f8 s = f / (2.0f + f);
  const f8 z = s * s, w = z * z;
  const f8 t1 = w * (Lg2 + w * Lg4), t2 = z * (Lg1 + w * Lg3);
  const f8 R = t2 + t1, hfsq = 0.5f * f * f;
  const f8 dk = __builtin_convertvector(k, f8);
  return s * (hfsq + R) + dk * ln2_lo - hfsq + f + dk * ln2_hi;
}

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

// dst[c] = exp(src[c] - shift) * mul for c < n (8 at a time; src may equal dst).
inline void exp_shift_scale(float* dst, const float* src, int64_t n, float shift, float mul) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    f8 v;
    std::memcpy(&v, src + c, sizeof v);
    v = exp8_le0(v - shift) * mul;
    std::memcpy(dst + c, &v, sizeof v);
  }
  if (c < n) {
    f8 v = f8{};
    std::memcpy(&v, src + c, sizeof(float) * (n - c));
    v = exp8_le0(v - shift) * mul;
    std::memcpy(dst + c, &v, sizeof(float) * (n - c));
  }
}

// Row-major C (m x n, ldc) = alpha * A (m x k, lda) * B (k x n, ldb). Reads B in blocks
// of 16 columns: each row of B must have 16 - (n % 16) readable floats after column n
// (their values are not used).
void gemm_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float* C, int64_t ldc);

}  // namespace headscope::vas::cpu
