#include "mixer/mixer.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace headscope {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::kl_project", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, double, int64_t)>();
  return op.call(log_u_ref, log_v_ref, tol, max_iter);
}

at::Tensor kl_hvp(const at::Tensor& U, const at::Tensor& V, const at::Tensor& s) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::kl_hvp", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(U, V, s);
}

at::Tensor thin_mix(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::thin_mix", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(U, V, X);
}

}  // namespace headscope
