// Autograd of headscope::linear_attribution and headscope::pearson (the two ops that
// fit_pearson-style training differentiates). The backwards are differentiable ATen ops.
//
// linear_attribution, s = z . w + b with z = (f - mean) / std:
//   df = g w / std,  dw = sum g z,  dmean = -(w / std) sum g,  dstd = -(w / std) sum g z.
// pearson, r = sxy / sqrt(sxx syy) on centred x, y along dim:
//   dx = g (yc / sqrt(sxx syy) - r xc / sxx),  dy = g (xc / sqrt(sxx syy) - r yc / syy)
// (centring needs no extra term: both brackets already sum to zero along dim).
#include "attribution/attribution.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace headscope::attribution {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class LinearAttribution : public torch::autograd::Function<LinearAttribution> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& features,
                            const at::Tensor& weight, const at::Tensor& mean,
                            const at::Tensor& std, double bias) {
    ctx->save_for_backward({features, weight, mean, std});
    at::AutoDispatchBelowADInplaceOrView guard;
    return headscope::linear_attribution(features, weight, mean, std, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &f = saved[0], &w = saved[1], &mean = saved[2], &std = saved[3];
    const auto& g_out = grads[0];
    if (!g_out.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
                                  at::Tensor()};
    // Accumulate in the parameters' dtype (features may be float16/bfloat16).
    const auto acc = w.scalar_type();
    const int64_t F = f.size(-1);
    const auto g = g_out.to(acc).unsqueeze(-1);  // (..., 1)
    const auto ws = w / std;
    at::Tensor df, dw, dmean, dstd;
    if (ctx->needs_input_grad(0)) df = (g * ws).to(f.scalar_type());
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(3)) {
      const auto z = (f.to(acc) - mean) / std;
      const auto gz = (g * z).reshape({-1, F}).sum(0);
      if (ctx->needs_input_grad(1)) dw = gz;
      if (ctx->needs_input_grad(3)) dstd = (-(ws * gz)).to(std.scalar_type());
    }
    if (ctx->needs_input_grad(2)) dmean = (-(ws * g.sum())).to(mean.scalar_type());
    if (dw.defined()) dw = dw.to(w.scalar_type());
    return {df, dw, dmean, dstd, at::Tensor()};
  }
};

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

at::Tensor linear_attribution_autograd(const at::Tensor& features, const at::Tensor& weight,
                                       const at::Tensor& mean, const at::Tensor& std,
                                       double bias) {
  return LinearAttribution::apply(features, weight, mean, std, bias);
}

at::Tensor pearson_autograd(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  return Pearson::apply(pred, target, dim);
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Autograd, m) {
  m.impl("linear_attribution", &linear_attribution_autograd);
  m.impl("pearson", &pearson_autograd);
}

}  // namespace headscope::attribution
