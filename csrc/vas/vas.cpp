#include "vas/vas.h"

#include "common/typed_op.h"

namespace headscope {

at::Tensor vas_head_stats(const at::Tensor& attn, const at::Tensor& head_writes,
                          const at::Tensor& lengths, const std::optional<at::Tensor>& offsets) {
  static const auto op = HEADSCOPE_TYPED_OP(vas_head_stats);
  return op.call(attn, head_writes, lengths, offsets);
}

at::Tensor vas_head_stats_qk(const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& head_writes, const at::Tensor& lengths,
                             std::optional<double> scale, bool causal,
                             const std::optional<at::Tensor>& offsets,
                             const std::optional<at::Tensor>& key_padding_mask,
                             std::optional<int64_t> window, std::optional<int64_t> chunk,
                             const std::optional<at::Tensor>& block_ids,
                             std::optional<double> softcap, bool window_bounds_blocks,
                             const std::optional<at::Tensor>& chunk_origin) {
  static const auto op = HEADSCOPE_TYPED_OP(vas_head_stats_qk);
  return op.call(q, k, head_writes, lengths, scale, causal, offsets, key_padding_mask, window,
                 chunk, block_ids, softcap, window_bounds_blocks, chunk_origin);
}

at::Tensor vas_aggregate(const at::Tensor& head_stats) {
  static const auto op = HEADSCOPE_TYPED_OP(vas_aggregate);
  return op.call(head_stats);
}

}  // namespace headscope
