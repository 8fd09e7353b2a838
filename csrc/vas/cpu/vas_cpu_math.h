// The float log and transposes the vas kernels vectorise (no libmvec, no -ffast-math),
// and the small row-major matrix products of the vas CPU kernels.
#pragma once

#include "common/cpu_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace headscope::vas::cpu {

using headscope::exp8_le0;
using headscope::exp_shift_scale;
using headscope::max_of;
using headscope::f8;
using headscope::i8;

// Natural log of 8 positive normal floats, within about 1 ulp, without a division (the
// tile loop's one division, p / q, keeps the divider busy): x = 2^k m with m in
// [sqrt(1/2), sqrt(2)), then Cephes logf's polynomial in f = m - 1.
inline f8 log8_pos(f8 x) {
  i8 ix;
  std::memcpy(&ix, &x, sizeof ix);
  ix += 0x3f800000 - 0x3f3504f3;
  const i8 k = (ix >> 23) - 0x7f;
  ix = (ix & 0x007fffff) + 0x3f3504f3;
  f8 f;
  std::memcpy(&f, &ix, sizeof f);
  f -= 1.0f;
  // Estrin's scheme: a short dependency chain, so that the out-of-order core can overlap
  // many vectors (Horner's nine chained FMAs left it latency-bound)
  const f8 z = f * f, z4 = z * z;
  const f8 e01 = 3.3333331174e-1f - 2.4999993993e-1f * f;
  const f8 e23 = 2.0000714765e-1f - 1.6668057665e-1f * f;
  const f8 e45 = 1.4249322787e-1f - 1.2420140846e-1f * f;
  const f8 e67 = 1.1676998740e-1f - 1.1514610310e-1f * f;
  const f8 e03 = e01 + e23 * z, e47 = e45 + e67 * z;
  f8 y = e03 + (e47 + 7.0376836292e-2f * z4) * z4;
  const f8 dk = __builtin_convertvector(k, f8);
  y = y * f * z + dk * -2.12194440e-4f - 0.5f * z;
  return (f + y) + dk * 0.693359375f;
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
