// Autograd of headscope::thin_mix. The backward is written in differentiable ATen
// ops, so double backward (gradgradcheck) works too. With g = colsum(U),
// M = V^T X, T = M / g and Y = U T:
//   dT = U^T dY,  dU = dY T^T + dg,  dg = -sum_c dT * T / g,
//   dM = dT / g,  dV = X dM^T,  dX = V dM.
#include "mixer/mixer.h"

#include <ATen/ops/matmul.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace headscope::mixer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class ThinMix : public torch::autograd::Function<ThinMix> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& U, const at::Tensor& V,
                            const at::Tensor& X) {
    ctx->save_for_backward({U, V, X});
    at::AutoDispatchBelowADInplaceOrView guard;
    return headscope::thin_mix(U, V, X);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &U = saved[0], &V = saved[1], &X = saved[2];
    const auto& dY_out = grads[0];
    if (!dY_out.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto acc = U.scalar_type();  // float16/bfloat16 X accumulate in U's dtype
    const auto Xa = X.to(acc);
    const auto dY = dY_out.to(acc);
    const auto g = U.sum(-2).unsqueeze(-1);  // (..., r, 1)
    const auto T = at::matmul(V.mT(), Xa).div(g);
    const auto dT = at::matmul(U.mT(), dY);
    at::Tensor dU, dV, dX;
    if (ctx->needs_input_grad(0)) {
      const auto dg = dT.mul(T).sum(-1, true).div(g).neg();  // (..., r, 1)
      dU = at::matmul(dY, T.mT()).add(dg.mT());
    }
    const auto dM = dT.div(g);
    if (ctx->needs_input_grad(1)) dV = at::matmul(Xa, dM.mT());
    if (ctx->needs_input_grad(2)) dX = at::matmul(V, dM).to(X.scalar_type());
    return {dU, dV, dX};
  }
};

at::Tensor thin_mix_autograd(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X) {
  return ThinMix::apply(U, V, X);
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Autograd, m) { m.impl("thin_mix", &thin_mix_autograd); }

}  // namespace headscope::mixer
