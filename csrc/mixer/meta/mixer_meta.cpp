// Shape-only kernel of kl_project for fake tensors (torch.compile, torch.export); the
// mixer's composite ops need none.
#include "mixer/mixer_checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

namespace headscope::mixer::meta {
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

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Meta, m) {
  m.impl("kl_project", &kl_project_meta);
}

}  // namespace headscope::mixer::meta
