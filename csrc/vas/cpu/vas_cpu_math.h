// The float log2 and transposes the vas kernels vectorise (no libmvec, no -ffast-math),
// and the small row-major matrix products of the vas CPU kernels.
#pragma once

#include "common/cpu_math.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace headscope::vas::cpu {

using headscope::exp8_le0;
using headscope::exp_shift_scale;
using headscope::max_of;
using headscope::f8;
using headscope::i8;

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

// Transposes 8 rows of 8 floats in registers: r[k][c] becomes r[c][k].
inline void transpose8x8(f8 r[8]) {
  f8 t[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * k + 1] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  f8 u[8];
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 (h = 1)
    const f8 a = t[4 * h], b = t[4 * h + 1], c = t[4 * h + 2], d = t[4 * h + 3];
    u[4 * h + 0] = __builtin_shufflevector(a, c, 0, 1, 8, 9, 4, 5, 12, 13);
    u[4 * h + 1] = __builtin_shufflevector(a, c, 2, 3, 10, 11, 6, 7, 14, 15);
    u[4 * h + 2] = __builtin_shufflevector(b, d, 0, 1, 8, 9, 4, 5, 12, 13);
    u[4 * h + 3] = __builtin_shufflevector(b, d, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int k = 0; k < 4; ++k) {  // column k from u[k] (rows 0-3) and u[4 + k] (rows 4-7)
    r[k] = __builtin_shufflevector(u[k], u[4 + k], 0, 1, 2, 3, 8, 9, 10, 11);
    r[k + 4] = __builtin_shufflevector(u[k], u[4 + k], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// dst = src^T for a rows x cols block (row strides lds, ldd): 8 x 8 blocks in registers
// (a scalar strided transpose stalls on stores that share cache sets), scalar edges.
inline void transpose(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                      int64_t ldd) {
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t r0 = 0; r0 < rows8; r0 += 8)
    for (int64_t c0 = 0; c0 < cols8; c0 += 8) {
      f8 r[8];
      for (int k = 0; k < 8; ++k) std::memcpy(&r[k], src + (r0 + k) * lds + c0, sizeof(f8));
      transpose8x8(r);
      for (int k = 0; k < 8; ++k) std::memcpy(dst + (c0 + k) * ldd + r0, &r[k], sizeof(f8));
    }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c_begin = r < rows8 ? cols8 : 0;
    for (int64_t c = c_begin; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
}

// Row-major C (m x n, ldc) = alpha * A (m x k, lda) * B (k x n, ldb). Reads B in blocks
// of 16 columns: each row of B must have 16 - (n % 16) readable floats after column n
// (their values are not used).
void gemm_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float* C, int64_t ldc);

}  // namespace headscope::vas::cpu
