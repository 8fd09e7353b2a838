// Autograd of headscope::kl_project by implicit differentiation at the solution; the
// Newton iterations are never differentiated.
//
// With J_i = diag(u_i) - u_i u_i^T (softmax Jacobian of row i), the solution moves as
// dU_i = J_i (da_i + dz), dV_i = K_i (db_i - dz), and equal column sums force
// H dz = -sum_i J_i da_i + sum_i K_i db_i (H the dual Hessian, gauge dz[r-1] = 0).
// The vector-Jacobian product is therefore
//   w = colsum(J gU) - colsum(K gV) + gz,   lambda = [Hr^{-1} w[:r-1], 0],
//   grad_log_u_ref = J (gU - lambda),       grad_log_v_ref = K (gV + lambda),
// one (r-1) x (r-1) solve per problem.
#include "mixer/mixer.h"

#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/diag_embed.h>
#include <ATen/ops/linalg_solve.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace headscope::mixer::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// J_i g_i for every row i of the softmax output P.
at::Tensor softmax_vjp(const at::Tensor& P, const at::Tensor& g) {
  return P.mul(g.sub(P.mul(g).sum(-1, true)));
}

class KLProject : public torch::autograd::Function<KLProject> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& log_u_ref,
                               const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [U, V, z, iters, residual] = headscope::kl_project(log_u_ref, log_v_ref, tol, max_iter);
    ctx->save_for_backward({U, V});
    ctx->mark_non_differentiable({iters, residual});
    return {U, V, z, iters, residual};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &U = saved[0], &V = saved[1];
    const auto gU = grads[0].defined() ? grads[0] : at::zeros_like(U);
    const auto gV = grads[1].defined() ? grads[1] : at::zeros_like(V);
    auto w = softmax_vjp(U, gU).sum(-2).sub(softmax_vjp(V, gV).sum(-2));  // (..., r)
    if (grads[2].defined()) w = w.add(grads[2]);
    const int64_t r = U.size(-1);
    at::Tensor lambda = at::zeros_like(w);
    if (r > 1) {
      const auto H = at::diag_embed(U.sum(-2).add(V.sum(-2)))
                         .sub(at::matmul(U.mT(), U))
                         .sub(at::matmul(V.mT(), V));
      const auto Hr = H.narrow(-2, 0, r - 1).narrow(-1, 0, r - 1);
      const auto lr = at::linalg_solve(Hr, w.narrow(-1, 0, r - 1));
      lambda = at::constant_pad_nd(lr, {0, 1});  // gauge: lambda[r-1] = 0
    }
    const auto l = lambda.unsqueeze(-2);  // broadcast over rows
    return {softmax_vjp(U, gU.sub(l)), softmax_vjp(V, gV.add(l)), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project_autograd(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
  auto out = KLProject::apply(log_u_ref, log_v_ref, tol, max_iter);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Autograd, m) { m.impl("kl_project", &kl_project_autograd); }

}  // namespace headscope::mixer::autograd
