#include "mixer/mixer.h"

#include "common/typed_op.h"

namespace headscope {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
  static const auto op = HEADSCOPE_TYPED_OP(kl_project);
  return op.call(log_u_ref, log_v_ref, tol, max_iter);
}

at::Tensor kl_hvp(const at::Tensor& U, const at::Tensor& V, const at::Tensor& s) {
  static const auto op = HEADSCOPE_TYPED_OP(kl_hvp);
  return op.call(U, V, s);
}

at::Tensor thin_mix(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X) {
  static const auto op = HEADSCOPE_TYPED_OP(thin_mix);
  return op.call(U, V, X);
}

}  // namespace headscope
