// The qk op's step before the pass (vas_head_stats_cuda.cu): the softmax statistics of
// q k^T per row, and the panel loads and logits the pass recomputes A from.
#pragma once

#include "common/attention_pattern.h"
#include "vas/cuda/vas_head_stats_common_cuda.cuh"

#include <cfloat>
#include <cmath>

namespace headscope::vas::cuda {
namespace {

// ---- qk op: softmax statistics per row ------------------------------------------------------

// A 64 x 64 panel of rows (window-relative row r at rows + r * s_row) and columns
// d0 .. d0 + 64 of a q or k tensor into shared memory as float, zero outside.
template <typename T>
__device__ void load_panel(float* dst, const T* rows, int64_t s_row, int64_t s_col,
                           int64_t rows_valid, int64_t d0, int64_t D) {
  for (int e = threadIdx.x; e < kTile * 64; e += kThreads) {
    const int r = e >> 6, c = e & 63;
    dst[r * kXld + c] = (r < rows_valid && d0 + c < D) ? ldf(rows + r * s_row + (d0 + c) * s_col) : 0.0f;
  }
}

// acc (fragment layout) = X Y^T over the D columns of q / k rows, 3xTF32.
template <typename T>
__device__ __forceinline__ void logits_tile(float* acc, float* sx, float* sy, const T* x, int64_t sx_row,
                            int64_t sx_col, int64_t x_rows, const T* y, int64_t sy_row,
                            int64_t sy_col, int64_t y_rows, int64_t D, const Lane& L) {
  #pragma unroll
  for (int e = 0; e < mma::kFrag; ++e) acc[e] = 0.0f;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __syncthreads();
    load_panel(sx, x, sx_row, sx_col, x_rows, d0, D);
    load_panel(sy, y, sy_row, sy_col, y_rows, d0, D);
    __syncthreads();
    const int kw = static_cast<int>((min((int64_t)64, D - d0) + 7) / 8 * 8);
    mma::gemm_3xtf32(acc, sx, sy, kXld, kw, L);
  }
}

// (m, z) of two parts of a softmax row combined.
__device__ inline void merge_mz(float& m, float& z, float m2, float z2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) return;
  z = z * __expf(m - mm) + z2 * __expf(m2 - mm);
  m = mm;
}

// A scaled logit, soft-capped when the pattern says so.
__device__ inline float logit(float l, const BatchPattern& pat) {
  return pat.softcap > 0 ? softcap_logit(l, static_cast<float>(pat.softcap)) : l;
}

// Whether key `key` of batch row b is padding (kpm: the contiguous (B, T) key padding
// mask, nullptr for none). Padding keys are left out of the softmax.
__device__ inline bool key_padded(const bool* kpm, int64_t b, int64_t T, int64_t key) {
  return kpm != nullptr && kpm[b * T + key];
}

template <typename Q_t>
__global__ void __launch_bounds__(kThreads)
qk_rows_kernel(Heads P, const Q_t* __restrict__ q, Strides4 sq, const Q_t* __restrict__ k,
               Strides4 sk, int64_t Hkv, int64_t D, float scale, BatchPattern pat,
               const bool* __restrict__ kpm) {
  extern __shared__ float4 smem_rows[];
  float* sx = reinterpret_cast<float*>(smem_rows);
  float* sy = sx + kTile * kXld;
  float* mz = sy + kTile * kXld;  // [2 (wn), 64, 2]
  const Lane L;
  const int64_t bh = blockIdx.y, b = bh / P.H, h = bh % P.H, hk = h / (P.H / Hkv);
  int64_t n, s;
  window(P, b, n, s);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  if (i0 >= n) return;
  // the keys the block's rows may see (absolute): from its first row's window start
  // (window starts never decrease; any earlier key of a block that the window does not
  // bound) to its last row's last key, or every later key with blocks
  const AttentionPattern ap = pat.row(b);
  const int64_t last_row = s + min(i0 + kTile, n) - 1;
  const bool blocks_unbound = ap.has_blocks() && !ap.window_bounds_blocks;
  const int64_t key_begin = blocks_unbound ? 0 : max(ap.window_start(s + i0), (int64_t)0);
  const int64_t key_end = ap.has_blocks() ? P.T : ap.last_key(last_row, P.T, -1, -1) + 1;
  const Q_t* qrows = q + b * sq.s0 + h * sq.s1 + (s + i0) * sq.s2;
  const Q_t* krows = k + b * sk.s0 + hk * sk.s1;
  float m[4], z[4];
  #pragma unroll
  for (int r = 0; r < 4; ++r) m[r] = -INFINITY, z[r] = 0.0f;
  bool finite = true;
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kTile) {
    float acc[mma::kFrag];
    logits_tile(acc, sx, sy, qrows, sq.s2, sq.s3, n - i0, krows + k0 * sk.s2, sk.s2, sk.s3,
                P.T - k0, D, L);
    // slot r = 2 mi + hrow holds one row; its 8 elements: ni = 0..3, two columns each
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int mi = r >> 1, hr = r & 1;
      const int il = L.slot_row(r);
      const int64_t ia = s + i0 + il;
      const int64_t qb = ap.query_block(ia, P.T);
      float l[8];
      float tmax = -INFINITY;
      #pragma unroll
      for (int t = 0; t < 8; ++t) {
        const int e = (mi * 4 + (t >> 1)) * 4 + hr * 2 + (t & 1);
        const int64_t key = k0 + L.col(e);
        const bool valid = i0 + il < n && key < P.T && ap.sees(ia, qb, key) &&
                           !key_padded(kpm, b, P.T, key);
        l[t] = valid ? logit(acc[e] * scale, pat) : -INFINITY;
        if (valid) finite &= isfinite(l[t]);
        tmax = fmaxf(tmax, l[t]);
      }
      if (tmax == -INFINITY) continue;
      float zt = 0.0f;
      #pragma unroll
      for (int t = 0; t < 8; ++t) zt += __expf(l[t] - tmax);
      merge_mz(m[r], z[r], tmax, zt);
    }
  }
  #pragma unroll
  for (int r = 0; r < 4; ++r)
    #pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[r], o), z2 = __shfl_xor_sync(0xffffffffu, z[r], o);
      merge_mz(m[r], z[r], m2, z2);
    }
  if (L.tq == 0)
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int il = L.slot_row(r);
      mz[(L.wn * kTile + il) * 2] = m[r];
      mz[(L.wn * kTile + il) * 2 + 1] = z[r];
    }
  if (__any_sync(0xffffffffu, !finite) && (threadIdx.x & 31) == 0) atomicOr(P.bad + bh, 1);
  __syncthreads();
  const int t = threadIdx.x;
  if (t < kTile && i0 + t < n) {
    float mm = mz[t * 2], zz = mz[t * 2 + 1];
    merge_mz(mm, zz, mz[(kTile + t) * 2], mz[(kTile + t) * 2 + 1]);
    P.mrow[bh * P.T + i0 + t] = mm;
    P.izrow[bh * P.T + i0 + t] = 1.0f / zz;
  }
}

}  // namespace
}  // namespace headscope::vas::cuda
