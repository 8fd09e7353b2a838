// CUDA kernels of pearson (one block per row, double sums) and spearman (average ranks by
// counting, O(n^2 / threads) per row, then the Pearson kernel on the ranks).
#include "attribution/attribution_checks.h"
#include "common/kernel.h"
#include "common/cuda_reduce.cuh"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

namespace headscope::attribution::cuda {
namespace {

using namespace headscope::cuda_reduce;

constexpr int kThreads = 256;

// ---- correlations -------------------------------------------------------------------------------

// out[row] = Pearson(x[row], y[row]) (double in, rows x n contiguous); NaN for a NaN entry
// or a constant row; clipped to [-1, 1].
template <typename out_t>
__global__ void pearson_kernel(const double* __restrict__ x, const double* __restrict__ y,
                               int64_t n, out_t* __restrict__ out) {
  __shared__ double red[32];
  const int64_t row = blockIdx.x;
  const double* a = x + row * n;
  const double* b = y + row * n;
  const double a0 = a[0], b0 = b[0];
  double sa = 0, sb = 0, nan = 0, diff_a = 0, diff_b = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    sa += a[i];
    sb += b[i];
    nan += (isnan(a[i]) || isnan(b[i])) ? 1.0 : 0.0;
    diff_a += a[i] != a0 ? 1.0 : 0.0;
    diff_b += b[i] != b0 ? 1.0 : 0.0;
  }
  sa = block_sum(sa, red);
  sb = block_sum(sb, red);
  nan = block_sum(nan, red);
  diff_a = block_sum(diff_a, red);
  diff_b = block_sum(diff_b, red);
  const double ma = sa / static_cast<double>(n), mb = sb / static_cast<double>(n);
  double sxy = 0, sxx = 0, syy = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double dx = a[i] - ma, dy = b[i] - mb;
    sxy += dx * dy;
    sxx += dx * dx;
    syy += dy * dy;
  }
  sxy = block_sum(sxy, red);
  sxx = block_sum(sxx, red);
  syy = block_sum(syy, red);
  if (threadIdx.x == 0) {
    double r;
    if (nan > 0 || diff_a == 0 || diff_b == 0 || sxx == 0 || syy == 0) {
      r = std::numeric_limits<double>::quiet_NaN();
    } else {
      r = sxy / sqrt(sxx * syy);
      r = r > 1.0 ? 1.0 : (r < -1.0 ? -1.0 : r);
    }
    out[row] = static_cast<out_t>(r);
  }
}

// ranks[row, i] = #{j : x_j < x_i} + (#{j : x_j == x_i} + 1) / 2 (1-based average rank);
// NaN for a NaN entry. Grid (ceil(n / threads), rows); rows tiled through shared memory.
__global__ void rank_kernel(const double* __restrict__ x, int64_t rows, int64_t n,
                            double* __restrict__ ranks) {
  __shared__ double tile[kThreads];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {  // gridDim.y <= 65535
    const double* a = x + row * n;
    const double xi = i < n ? a[i] : 0.0;
    int64_t less = 0, equal = 0;
    for (int64_t j0 = 0; j0 < n; j0 += blockDim.x) {
      const int64_t j = j0 + threadIdx.x;
      tile[threadIdx.x] = j < n ? a[j] : 0.0;
      __syncthreads();
      const int64_t m = n - j0 < blockDim.x ? n - j0 : blockDim.x;
      for (int64_t t = 0; t < m; ++t) {
        const double v = tile[t];
        less += v < xi;
        equal += v == xi;
      }
      __syncthreads();
    }
    if (i < n)
      ranks[row * n + i] = isnan(xi) ? xi : static_cast<double>(less) +
                                                0.5 * static_cast<double>(equal + 1);
  }
}

template <bool kRank>
at::Tensor correlation_cuda(const char* op, const at::Tensor& pred, const at::Tensor& target,
                            int64_t dim) {
  const c10::cuda::CUDAGuard guard(pred.device());
  auto p = prepare_correlation(op, pred, target, dim);
  const int64_t rows = p.rows, n = p.n;
  if (rows == 0) return p.out;
  at::Tensor x = p.x, y = p.y, out = p.out;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if constexpr (kRank) {
    auto rx = at::empty(x.sizes(), x.options()), ry = at::empty(y.sizes(), y.options());
    const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads),
                    static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
    rank_kernel<<<grid, kThreads, 0, stream>>>(x.const_data_ptr<double>(), rows, n,
                                               rx.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    rank_kernel<<<grid, kThreads, 0, stream>>>(y.const_data_ptr<double>(), rows, n,
                                               ry.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    x = rx;
    y = ry;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(),
                                  "headscope_correlation_cuda", [&] {
    const unsigned blocks = static_cast<unsigned>(rows);
    auto kernel = pearson_kernel<scalar_t>;
    kernel<<<blocks, kThreads, 0, stream>>>(
        x.const_data_ptr<double>(), y.const_data_ptr<double>(), n,
        out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor spearman_cuda(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  return correlation_cuda<true>("headscope::spearman", pred, target, dim);
}
at::Tensor pearson_cuda(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  return correlation_cuda<false>("headscope::pearson", pred, target, dim);
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CUDA, m) {
  m.impl("spearman", HEADSCOPE_KERNEL("spearman", spearman_cuda));
  m.impl("pearson", HEADSCOPE_KERNEL("pearson", pearson_cuda));
}

}  // namespace headscope::attribution::cuda
