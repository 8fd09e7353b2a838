// headscope::kl_hvp is a composite of ATen ops: registered once for every backend,
// differentiable and traceable for free.
//   H s = colsum(U) * s - U^T (U s) + colsum(V) * s - V^T (V s)
#include "mixer/mixer_checks.h"

#include <ATen/ops/matmul.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

namespace headscope::mixer::composite {
namespace {

at::Tensor covariance_product(const at::Tensor& P, const at::Tensor& s_col) {
  // sum_i [diag(p_i) s - p_i (p_i^T s)] with s_col = s[..., :, None]
  return P.sum(-2, true).mT().mul(s_col).sub(at::matmul(P.mT(), at::matmul(P, s_col))).squeeze(-1);
}

at::Tensor kl_hvp(const at::Tensor& U, const at::Tensor& V, const at::Tensor& s) {
  check_kl_hvp_args(U, V, s);
  const auto s_col = s.unsqueeze(-1);
  return covariance_product(U, s_col).add(covariance_product(V, s_col));
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CompositeImplicitAutograd, m) { m.impl("kl_hvp", &kl_hvp); }

}  // namespace headscope::mixer::composite
