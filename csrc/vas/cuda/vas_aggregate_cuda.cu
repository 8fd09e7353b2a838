// CUDA kernel of headscope::vas_aggregate: (B, L, H, 3) head statistics to the 36 features,
// one thread per batch row, statistic and aggregate over heads.
#include "common/kernel.h"
#include "vas/vas_checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

namespace headscope::vas::cuda {
namespace {

__global__ void aggregate_kernel(const double* __restrict__ st, float* __restrict__ out,
                                 int64_t B, int64_t L, int64_t H) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= B * 12) return;
  const int64_t b = t / 12, qi = (t % 12) / 4, a = t % 4;  // one thread per (b, stat, head agg)
  double sum = 0, sq = 0, hi = -INFINITY;
  bool nan = false;
  // two passes over layers: mean, then population variance
  auto layer_stat = [&](int64_t l) -> double {
    const double* v = st + ((b * L + l) * H) * 3 + qi;
    double s = 0, mx = -INFINITY, mn = INFINITY;
    bool has_nan = false;
    for (int64_t h = 0; h < H; ++h) {
      const double x = v[h * 3];
      has_nan |= isnan(x);
      s += x;
      mx = fmax(mx, x);
      mn = fmin(mn, x);
    }
    const double mean = s / static_cast<double>(H);
    double var = 0;
    for (int64_t h = 0; h < H; ++h) var += (v[h * 3] - mean) * (v[h * 3] - mean);
    double r = a == 0 ? mean : a == 1 ? sqrt(var / static_cast<double>(H)) : a == 2 ? mx : mn;
    if (has_nan) r = NAN;
    // the reference implementation stores float32
    return static_cast<double>(static_cast<float>(r));
  };
  for (int64_t l = 0; l < L; ++l) {
    const double x = layer_stat(l);
    nan |= isnan(x);
    sum += x;
    hi = fmax(hi, x);
  }
  const double mean = sum / static_cast<double>(L);
  for (int64_t l = 0; l < L; ++l) {
    const double x = layer_stat(l);
    sq += (x - mean) * (x - mean);
  }
  float* o = out + b * 36 + qi * 12 + a * 3;
  o[0] = nan ? NAN : static_cast<float>(mean);
  o[1] = nan ? NAN : static_cast<float>(sqrt(sq / static_cast<double>(L)));
  o[2] = nan ? NAN : static_cast<float>(hi);
}

at::Tensor vas_aggregate_cuda(const at::Tensor& head_stats) {
  check_aggregate_args(head_stats);
  const c10::cuda::CUDAGuard guard(head_stats.device());
  const auto st = head_stats.to(at::kDouble).contiguous();
  const int64_t B = st.size(0), L = st.size(1), H = st.size(2);
  at::Tensor out = at::empty({B, 36}, head_stats.options().dtype(at::kFloat));
  if (B == 0) return out;
  const int64_t threads = 128, work = B * 12;
  aggregate_kernel<<<(work + threads - 1) / threads, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      st.const_data_ptr<double>(), out.data_ptr<float>(), B, L, H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CUDA, m) {
  m.impl("vas_aggregate", HEADSCOPE_KERNEL("vas_aggregate", vas_aggregate_cuda));
}

}  // namespace headscope::vas::cuda
