// headscope::linear_attribution, ((features - mean) / std) . weight + bias, is a composite
// of ATen ops: one registration serves every backend, fake tensors and autograd (double
// backward included). A std entry that is not finite and positive makes every score NaN
// (checking the values instead would cost a device synchronisation per call).
#include "attribution/attribution_checks.h"

#include <ATen/ops/matmul.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <limits>

namespace headscope::attribution::composite {
namespace {

at::Tensor linear_attribution(const at::Tensor& features, const at::Tensor& weight,
                              const at::Tensor& mean, const at::Tensor& std,
                              const std::optional<at::Tensor>& bias) {
  check_linear_attribution_args(features, weight, mean, std, bias);
  const auto acc = accum_dtype(features.scalar_type());
  // weight / std divided in double, then rounded once to the accumulation dtype
  const auto sd = std.to(at::kDouble);
  const auto valid = sd.gt(0).logical_and(sd.isfinite());
  const auto scaled_weight =
      at::where(valid, weight.to(at::kDouble).div(sd), std::numeric_limits<double>::quiet_NaN())
          .to(acc);
  auto scores = at::matmul(features.to(acc).sub(mean.to(acc)), scaled_weight);
  if (bias.has_value() && bias->defined()) scores = scores.add(bias->to(acc));
  return scores.to(features.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CompositeImplicitAutograd, m) {
  m.impl("linear_attribution", &linear_attribution);
}

}  // namespace headscope::attribution::composite
