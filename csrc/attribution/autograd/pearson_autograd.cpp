// Autograd of headscope::pearson (fit_pearson's loss differentiates it). The backward is
// made of differentiable ATen ops. With r = sxy / sqrt(sxx syy) on centred x, y along dim:
//   dx = g (yc / sqrt(sxx syy) - r xc / sxx),  dy = g (xc / sqrt(sxx syy) - r yc / syy)
// (centring needs no extra term: both brackets already sum to zero along dim).
#include "attribution/attribution.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace headscope::attribution::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class Pearson : public torch::autograd::Function<Pearson> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& pred,
                            const at::Tensor& target, int64_t dim) {
    ctx->save_for_backward({pred, target});
    ctx->saved_data["dim"] = dim;
    at::AutoDispatchBelowADInplaceOrView guard;
    return headscope::pearson(pred, target, dim);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &y = saved[1];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const auto& g_out = grads[0];
    if (!g_out.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto xc = x - x.mean(dim, true);
    const auto yc = y - y.mean(dim, true);
    const auto sxx = (xc * xc).sum(dim, true);
    const auto syy = (yc * yc).sum(dim, true);
    const auto sxy = (xc * yc).sum(dim, true);
    const auto den = at::sqrt(sxx * syy);
    const auto r = sxy / den;
    const auto g = g_out.unsqueeze(dim < 0 ? dim + x.dim() : dim);
    at::Tensor dx, dy;
    if (ctx->needs_input_grad(0)) dx = g * (yc / den - r * xc / sxx);
    if (ctx->needs_input_grad(1)) dy = g * (xc / den - r * yc / syy);
    return {dx, dy, at::Tensor()};
  }
};

at::Tensor pearson_autograd(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  return Pearson::apply(pred, target, dim);
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Autograd, m) {
  m.impl("pearson", &pearson_autograd);
}

}  // namespace headscope::attribution::autograd
