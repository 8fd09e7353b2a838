// headscope::thin_mix, Y = (U / g) (V^T X) with g = colsum(U), is a composite of ATen
// ops: O((n + m) r d) without forming the n x m mixing matrix, the two skinny products in
// the backend's GEMM (BLAS on CPU, cuBLAS on CUDA, where it beat a hand-written kernel),
// autograd and double backward from ATen. float16/bfloat16 X is upcast to U's float32 so
// that every sum accumulates in float32.
#include "mixer/mixer_checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

namespace headscope::mixer::composite {
namespace {

at::Tensor thin_mix(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X) {
  check_thin_mix_args(U, V, X);
  // U / g has entries in [0, 1]; dividing V^T X by g instead overflows float32 when a
  // column sum is subnormal (found by fuzz/fuzz_mixer.cpp)
  const auto mix = at::matmul(V.mT(), X.to(U.scalar_type()));
  return at::matmul(U.div(U.sum(-2, true)), mix).to(X.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CompositeImplicitAutograd, m) { m.impl("thin_mix", &thin_mix); }

}  // namespace headscope::mixer::composite
