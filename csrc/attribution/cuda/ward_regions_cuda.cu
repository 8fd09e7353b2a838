// ward_regions for CUDA tensors: the merge loop is sequential (one heap), so it runs on
// a host copy of the features (M x C, small next to a model's activations) and the
// labels go back to the device. Same results as the CPU kernel.
#include "attribution/attribution_checks.h"
#include "attribution/cpu/ward_regions_cpu.h"
#include "common/kernel.h"
#include "common/checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

namespace headscope::attribution::cuda {
namespace {

at::Tensor ward_regions_cuda(const at::Tensor& features, int64_t height, int64_t width,
                             int64_t num_regions, int64_t frames) {
  const char* op = "headscope::ward_regions";
  check_ward_args(features, height, width, num_regions, frames);
  const c10::cuda::CUDAGuard guard(features.device());
  // a fresh host copy (the clustering overwrites it)
  auto X = features.to(at::kDouble).cpu().contiguous();
  const int64_t M = frames * height * width, C = X.size(1);
  double* xp = X.mutable_data_ptr<double>();
  for (int64_t i = 0; i < M * C; ++i)
    HEADSCOPE_CHECK_ARG(std::isfinite(xp[i]), op, "features",
                        "must hold only finite values, got ", xp[i], " at [", i / C, ", ",
                        i % C, "]");
  auto labels = at::empty({M}, X.options().dtype(at::kLong));
  cpu::ward_grid_labels(xp, frames, height, width, C, num_regions,
                        labels.mutable_data_ptr<int64_t>());
  return labels.to(features.device());
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CUDA, m) {
  m.impl("ward_regions", HEADSCOPE_KERNEL("ward_regions", ward_regions_cuda));
}

}  // namespace headscope::attribution::cuda
