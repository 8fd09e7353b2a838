// Autograd of headscope::linear_attribution, s = z . w + b with z = (f - mean) / std. The
// backward is made of differentiable ATen ops (so double backward works), in the forward's
// accumulation dtype, each gradient returned in its input's dtype. With c = sum over rows of
// g (f - mean) and sw = w / std:
//   df = g sw,  dw = c / std,  dmean = -sw sum g,  dstd = -sw c / std,  dbias = sum g.
#include "attribution/attribution.h"
#include "attribution/attribution_checks.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace headscope::attribution::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class LinearAttribution : public torch::autograd::Function<LinearAttribution> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& features,
                            const at::Tensor& weight, const at::Tensor& mean,
                            const at::Tensor& std, const std::optional<at::Tensor>& bias) {
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->save_for_backward({features, weight, mean, std});
    ctx->saved_data["bias_dtype"] =
        static_cast<int64_t>(has_bias ? bias->scalar_type() : at::ScalarType::Undefined);
    at::AutoDispatchBelowADInplaceOrView guard;
    return headscope::linear_attribution(features, weight, mean, std, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &f = saved[0], &w = saved[1], &mean = saved[2], &std = saved[3];
    const auto& g_out = grads[0];
    if (!g_out.defined()) return variable_list(5);
    const auto acc = accum_dtype(f.scalar_type());
    const auto sd = std.to(acc);
    const auto sw = w.to(acc) / sd;
    const auto g = g_out.to(acc);
    const auto bias_dtype = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt());
    // the bias is an input edge (index 4) only when it was given
    const bool bias_grad = bias_dtype != at::ScalarType::Undefined && ctx->needs_input_grad(4);
    at::Tensor df, dw, dmean, dstd, dbias;
    if (ctx->needs_input_grad(0)) df = (g.unsqueeze(-1) * sw).to(f.scalar_type());
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(3)) {
      // rows (R, F) (a 1-dim features is one row) against the row gradients (R,)
      const auto centred = f.to(acc) - mean.to(acc);
      const auto rows = f.dim() == 1 ? centred.unsqueeze(0) : centred.flatten(0, -2);
      const auto c = at::matmul(g.flatten(), rows) / sd;
      if (ctx->needs_input_grad(1)) dw = c.to(w.scalar_type());
      if (ctx->needs_input_grad(3)) dstd = (-(sw * c)).to(std.scalar_type());
    }
    if (ctx->needs_input_grad(2) || bias_grad) {
      const auto g_sum = g.sum();
      if (ctx->needs_input_grad(2)) dmean = (-(sw * g_sum)).to(mean.scalar_type());
      if (bias_grad) dbias = g_sum.to(bias_dtype);
    }
    return {df, dw, dmean, dstd, dbias};
  }
};

at::Tensor linear_attribution_autograd(const at::Tensor& features, const at::Tensor& weight,
                                       const at::Tensor& mean, const at::Tensor& std,
                                       const std::optional<at::Tensor>& bias) {
  return LinearAttribution::apply(features, weight, mean, std, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Autograd, m) {
  m.impl("linear_attribution", &linear_attribution_autograd);
}

}  // namespace headscope::attribution::autograd
