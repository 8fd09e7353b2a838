// CPU kernel of headscope::thin_mix: Y = U ((V^T X) / g), g = colsum(U), in
// O((n + m) r d) without forming the n x m mixing matrix. The two skinny products go
// to BLAS, which beats hand-written loops for them on CPU; float16/bfloat16 X is
// upcast to float32 so that every sum accumulates in float32.
#include "mixer/mixer_checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

namespace headscope::mixer {
namespace {

at::Tensor thin_mix_cpu(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X) {
  check_thin_mix_args(U, V, X);
  const auto mix = at::matmul(V.mT(), X.to(U.scalar_type()));  // (..., r, d)
  mix.div_(U.sum(-2).unsqueeze(-1));
  return at::matmul(U, mix).to(X.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) { m.impl("thin_mix", &thin_mix_cpu); }

}  // namespace headscope::mixer
