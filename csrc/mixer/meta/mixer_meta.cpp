// Shape-only kernels of the mixer ops for fake tensors (torch.compile, torch.export).
#include "mixer/mixer_checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

namespace headscope::mixer {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project_meta(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
  check_kl_project_args(log_u_ref, log_v_ref, tol, max_iter);
  const auto sizes = log_u_ref.sym_sizes();
  const auto batch = sizes.slice(0, sizes.size() - 2);
  std::vector<c10::SymInt> batch_r(batch.begin(), batch.end());
  batch_r.push_back(sizes.back());
  const auto opts = log_u_ref.options();
  return {at::empty_symint(sizes, opts), at::empty_symint(sizes, opts),
          at::empty_symint(batch_r, opts), at::empty_symint(batch, opts.dtype(at::kLong)),
          at::empty_symint(batch, opts.dtype(at::kDouble))};
}

at::Tensor thin_mix_meta(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X) {
  check_thin_mix_args(U, V, X);
  std::vector<c10::SymInt> sizes(U.sym_sizes().begin(), U.sym_sizes().end());
  sizes.back() = X.sym_size(-1);
  return at::empty_symint(sizes, X.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Meta, m) {
  m.impl("kl_project", &kl_project_meta);
  m.impl("thin_mix", &thin_mix_meta);
}

}  // namespace headscope::mixer
