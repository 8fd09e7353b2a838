#include "vas/vas.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace headscope {

at::Tensor vas_head_stats(const at::Tensor& attn, const at::Tensor& head_writes,
                          const at::Tensor& lengths, const std::optional<at::Tensor>& offsets) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::vas_head_stats", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&)>();
  return op.call(attn, head_writes, lengths, offsets);
}

at::Tensor vas_head_stats_qk(const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& head_writes, const at::Tensor& lengths,
                             double scale, bool causal, const std::optional<at::Tensor>& offsets,
                             const std::optional<at::Tensor>& key_padding_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::vas_head_stats_qk", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, double, bool,
                                         const std::optional<at::Tensor>&,
                                         const std::optional<at::Tensor>&)>();
  return op.call(q, k, head_writes, lengths, scale, causal, offsets, key_padding_mask);
}

at::Tensor vas_aggregate(const at::Tensor& head_stats) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::vas_aggregate", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(head_stats);
}

}  // namespace headscope
