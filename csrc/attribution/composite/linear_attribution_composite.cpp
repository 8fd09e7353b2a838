// headscope::linear_attribution, ((features - mean) / std) . weight + bias, as a composite
// of ATen ops: the forward of every backend without a kernel of its own (CUDA included; the
// CPU has cpu/linear_attribution_cpu.cpp, which the benchmark shows faster). Autograd is
// autograd/linear_attribution_autograd.cpp, fake tensors the Meta kernel. A std entry that
// is not finite and positive makes every score NaN (checking the values instead would cost
// a device synchronisation per call).
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
  // weight / std rounded once to the accumulation dtype: divided in the widest dtype of the
  // three (a float32 quotient is the rounded float64 one, so float32 needs no copies)
  const auto div_dtype =
      c10::promoteTypes(c10::promoteTypes(weight.scalar_type(), std.scalar_type()), acc);
  const auto valid = std.gt(0).logical_and(std.isfinite());
  const auto scaled_weight = at::where(valid, weight.to(div_dtype).div(std.to(div_dtype)),
                                       std::numeric_limits<double>::quiet_NaN())
                                 .to(acc);
  auto scores = at::matmul(features.to(acc).sub(mean.to(acc)), scaled_weight);
  if (bias.has_value() && bias->defined()) scores = scores.add(bias->to(acc));
  return scores.to(features.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CompositeExplicitAutograd, m) {
  m.impl("linear_attribution", &linear_attribution);
}

}  // namespace headscope::attribution::composite
