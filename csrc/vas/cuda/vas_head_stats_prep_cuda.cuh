// Step 1 of the vas CUDA kernels (vas_head_stats_cuda.cu): the row-normalised head writes Vn
// of every head, and the flag of a head whose window holds NaN or Inf.
#pragma once

#include "vas/cuda/vas_head_stats_common_cuda.cuh"

namespace headscope::vas::cuda {
namespace {

// ---- 1. prep ------------------------------------------------------------------------------

// Sum of squares of row[0 .. n) (shared memory) in NumPy's pairwise order over float32
// squares (np.linalg.norm): the reference implementation's norms bit for bit. Called by a
// whole warp; every lane gets the result. NumPy sums blocks of up to 128 with 8
// interleaved accumulators (lanes 0..7 here, each in NumPy's order), combines them as a
// fixed tree, adds the tail, and splits longer rows in two at a multiple of 8.
__device__ float numpy_pairwise_sumsq(const float* row, int n) {
  auto sqr = [&](int i) { return __fmul_rn(row[i], row[i]); };  // never fused into an add
  if (n > 128) {
    int n2 = n / 2;
    n2 -= n2 % 8;
    return __fadd_rn(numpy_pairwise_sumsq(row, n2), numpy_pairwise_sumsq(row + n2, n - n2));
  }
  float res = 0.0f;
  int i = 0;
  if (n >= 8) {
    const int k = threadIdx.x & 7, m = n - n % 8;
    float r = sqr(k);
    for (int j = 8; j < m; j += 8) r = __fadd_rn(r, sqr(j + k));
    float rk[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) rk[q] = __shfl_sync(0xffffffffu, r, q);
    res = __fadd_rn(__fadd_rn(__fadd_rn(rk[0], rk[1]), __fadd_rn(rk[2], rk[3])),
                    __fadd_rn(__fadd_rn(rk[4], rk[5]), __fadd_rn(rk[6], rk[7])));
    i = m;
  }
  for (; i < n; ++i) res = __fadd_rn(res, sqr(i));
  return res;
}

// Each warp takes kPrepRows / 4 rows: loads them all (the loads in flight together), then
// normalises each: Vn_i = V_i / max(||V_i||, 1e-9) (a division, as the reference
// implementation). Rows from n to T64 and columns from Dh to Dh16 are zero.
template <typename V_t, bool kExact>
__global__ void __launch_bounds__(kThreads) prep_kernel(Heads P, const V_t* __restrict__ hw,
                                                        Strides4 sv) {
  constexpr int kRows = kPrepRows / 4;
  extern __shared__ float rowbuf_all[];  // [warps, kRows, Dh]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t bh = blockIdx.y, b = bh / P.H, h = bh % P.H, BH = P.B * P.H;
  int64_t n, s;
  window(P, b, n, s);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kPrepRows + warp * kRows;
  float* rowbuf = rowbuf_all + warp * kRows * P.Dh;
  double sq = 0;
  for (int rr = 0; rr < kRows; ++rr) {
    if (i0 + rr >= n) break;
    const V_t* row = hw + b * sv.s0 + h * sv.s1 + (s + i0 + rr) * sv.s2;
    for (int64_t c = lane; c < P.Dh; c += 32) {
      const float x = ldf(row + c * sv.s3);
      rowbuf[rr * P.Dh + c] = x;
      sq += static_cast<double>(x) * x;
    }
  }
  const bool bad = !isfinite(warp_sum(sq));
  __syncwarp();
  for (int rr = 0; rr < kRows; ++rr) {
    const int64_t i = i0 + rr;
    float den = 1.0f;
    if (i < n) {
      const float nrm = sqrtf(numpy_pairwise_sumsq(rowbuf + rr * P.Dh, static_cast<int>(P.Dh)));
      den = nrm > 1e-9f ? nrm : 1e-9f;
    }
    for (int64_t c = lane; c < P.Dh16; c += 32) {
      const float x = (i < n && c < P.Dh) ? rowbuf[rr * P.Dh + c] / den : 0.0f;
      if (kExact) {
        P.vf[(bh * P.T64 + i) * 16 + c] = x;
      } else {
        const __half hi = __float2half_rn(x);
        const __half lo = __float2half_rn((x - __half2float(hi)) * mma::kLoScale);
        P.vs[(bh * P.T64 + i) * P.Dh16 + c] = hi;
        P.vs[((BH + bh) * P.T64 + i) * P.Dh16 + c] = lo;
      }
    }
  }
  if (lane == 0 && bad) atomicOr(P.bad + bh, 1);
}

}  // namespace
}  // namespace headscope::vas::cuda
