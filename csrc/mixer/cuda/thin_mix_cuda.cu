// CUDA kernels of headscope::thin_mix, Y = U ((V^T X) / g), in three passes that
// each read their inputs once: (1) per chunk of rows, partial V^T X; (2) per problem,
// sum the partials and divide by g = colsum(U); (3) per chunk of rows, Y = U mix.
// Sums run in a fixed order (no atomics): results are deterministic.
#include "mixer/mixer_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace headscope::mixer {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = 256;  // rows of X (pass 1) or Y (pass 3) per block
constexpr int kTileRows = 16;       // rows staged in shared memory at a time (pass 1)

// Pass 1. grid (m_tasks, problems). partial[p][t] = V[rows]^T X[rows] (r x d).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    partial_vtx_kernel(const acc_t* __restrict__ V, const scalar_t* __restrict__ X,
                       acc_t* __restrict__ partial, int64_t m, int r, int d) {
  extern __shared__ unsigned char smem_raw[];
  acc_t* vs = reinterpret_cast<acc_t*>(smem_raw);  // kTileRows x r
  acc_t* xs = vs + kTileRows * r;                  // kTileRows x d
  const int64_t p = blockIdx.y, t = blockIdx.x;
  const int64_t row0 = t * kRowsPerBlock;
  const int64_t rows = min(static_cast<int64_t>(kRowsPerBlock), m - row0);
  const int outputs = r * d;
  acc_t* out = partial + (p * gridDim.x + t) * outputs;
  // Outputs are owned by threads; several passes over the rows when r*d > 8 * kThreads.
  constexpr int kPerThread = 8;
  for (int base = 0; base < outputs; base += kThreads * kPerThread) {
    acc_t acc[kPerThread] = {};
    for (int64_t j0 = 0; j0 < rows; j0 += kTileRows) {
      const int tile = static_cast<int>(min(static_cast<int64_t>(kTileRows), rows - j0));
      for (int e = threadIdx.x; e < tile * r; e += kThreads)
        vs[e] = V[(p * m + row0 + j0) * r + e];
      for (int e = threadIdx.x; e < tile * d; e += kThreads)
        xs[e] = static_cast<acc_t>(X[(p * m + row0 + j0) * d + e]);
      __syncthreads();
#pragma unroll
      for (int q = 0; q < kPerThread; ++q) {
        const int e = base + q * kThreads + threadIdx.x;
        if (e < outputs) {
          const int k = e / d, c = e % d;
          for (int j = 0; j < tile; ++j) acc[q] += vs[j * r + k] * xs[j * d + c];
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < kPerThread; ++q) {
      const int e = base + q * kThreads + threadIdx.x;
      if (e < outputs) out[e] = acc[q];
    }
  }
}

// Pass 2. grid (problems). mix[p] = sum_t partial[p][t] / g[:, None].
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    reduce_mix_kernel(const acc_t* __restrict__ U, const acc_t* __restrict__ partial,
                      acc_t* __restrict__ mix, int64_t n, int r, int d, int64_t m_tasks) {
  extern __shared__ unsigned char smem_raw[];
  acc_t* g = reinterpret_cast<acc_t*>(smem_raw);  // r
  const int64_t p = blockIdx.x;
  // g[k]: warps stride over k; lanes over rows, then a warp reduction.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int k = warp; k < r; k += kThreads / 32) {
    acc_t s = 0;
    for (int64_t i = lane; i < n; i += 32) s += U[(p * n + i) * r + k];
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffffu, s, off);
    if (lane == 0) g[k] = s;
  }
  __syncthreads();
  const int outputs = r * d;
  for (int e = threadIdx.x; e < outputs; e += kThreads) {
    acc_t s = 0;
    for (int64_t t = 0; t < m_tasks; ++t) s += partial[(p * m_tasks + t) * outputs + e];
    mix[p * outputs + e] = s / g[e / d];
  }
}

// Pass 3. grid (n_tasks, problems). Y[rows] = U[rows] mix[p].
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    apply_mix_kernel(const acc_t* __restrict__ U, const acc_t* __restrict__ mix,
                     scalar_t* __restrict__ Y, int64_t n, int r, int d) {
  const int64_t p = blockIdx.y;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t rows = min(static_cast<int64_t>(kRowsPerBlock), n - row0);
  const acc_t* mp = mix + p * r * d;
  for (int64_t e = threadIdx.x; e < rows * d; e += kThreads) {
    const int64_t i = row0 + e / d;
    const int c = static_cast<int>(e % d);
    const acc_t* ui = U + (p * n + i) * r;
    acc_t y = 0;
    for (int k = 0; k < r; ++k) y += ui[k] * mp[k * d + c];
    Y[(p * n + i) * d + c] = static_cast<scalar_t>(y);
  }
}

at::Tensor thin_mix_cuda(const at::Tensor& U_in, const at::Tensor& V_in, const at::Tensor& X_in) {
  check_thin_mix_args(U_in, V_in, X_in);
  c10::cuda::CUDAGuard guard(U_in.device());
  const auto U = U_in.contiguous();
  const auto V = V_in.contiguous();
  const auto X = X_in.contiguous();
  const int64_t n = U.size(-2), r = U.size(-1), m = V.size(-2), d = X.size(-1);
  auto out_sizes = U.sizes().vec();
  out_sizes.back() = d;
  auto Y = at::empty(out_sizes, X.options());
  if (Y.numel() == 0) return Y;
  const int64_t problems = U.numel() / (n * r);
  TORCH_CHECK(problems <= 65535, "headscope::thin_mix: argument 'U' has ", problems,
              " batch entries; the CUDA kernel supports at most 65535");
  TORCH_CHECK(r <= 4096, "headscope::thin_mix: argument 'U' has rank r = ", r,
              "; the CUDA kernel supports r <= 4096");
  TORCH_CHECK(r * d <= (1 << 20), "headscope::thin_mix: r * d = ", r * d,
              " is too large for the CUDA kernel (at most 2^20)");
  const int64_t m_tasks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t n_tasks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  auto partial = at::empty({problems, m_tasks, r, d}, U.options());
  auto mix = at::empty({problems, r, d}, U.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int ri = static_cast<int>(r), di = static_cast<int>(d);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, X.scalar_type(), "thin_mix_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;  // U's dtype, checked above
    if (m_tasks > 0) {
      const size_t smem1 = sizeof(acc_t) * kTileRows * (r + d);
      auto k1 = partial_vtx_kernel<scalar_t, acc_t>;
      C10_CUDA_CHECK(cudaFuncSetAttribute(k1, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem1)));
      k1<<<dim3(m_tasks, problems), kThreads, smem1, stream>>>(
          V.const_data_ptr<acc_t>(), X.const_data_ptr<scalar_t>(),
          partial.mutable_data_ptr<acc_t>(), m, ri, di);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    reduce_mix_kernel<acc_t><<<problems, kThreads, sizeof(acc_t) * r, stream>>>(
        U.const_data_ptr<acc_t>(), partial.const_data_ptr<acc_t>(), mix.mutable_data_ptr<acc_t>(),
        n, ri, di, m_tasks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    apply_mix_kernel<scalar_t, acc_t><<<dim3(n_tasks, problems), kThreads, 0, stream>>>(
        U.const_data_ptr<acc_t>(), mix.const_data_ptr<acc_t>(), Y.mutable_data_ptr<scalar_t>(),
        n, ri, di);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return Y;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CUDA, m) { m.impl("thin_mix", &thin_mix_cuda); }

}  // namespace headscope::mixer
