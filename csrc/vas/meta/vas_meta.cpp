// Shape-only kernels of the vas ops for fake tensors (torch.compile, torch.export).
#include "vas/vas_checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace headscope::vas::meta {
namespace {

at::Tensor vas_head_stats_meta(const at::Tensor& attn, const at::Tensor& head_writes,
                               const at::Tensor& lengths,
                               const std::optional<at::Tensor>& offsets) {
  check_head_stats_args(attn, head_writes, lengths, offsets);
  return at::empty_symint({attn.sym_size(0), attn.sym_size(1), c10::SymInt(3)},
                          attn.options().dtype(at::kFloat));
}

at::Tensor vas_head_stats_qk_meta(const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& head_writes, const at::Tensor& lengths,
                                  std::optional<double> scale, bool causal,
                                  const std::optional<at::Tensor>& offsets,
                                  const std::optional<at::Tensor>& key_padding_mask,
                                  std::optional<int64_t> window, std::optional<int64_t> chunk,
                                  const std::optional<at::Tensor>& block_ids,
                                  std::optional<double> softcap, bool window_bounds_blocks,
                                  const std::optional<at::Tensor>& chunk_origin) {
  check_head_stats_qk_args(q, k, head_writes, lengths, scale, offsets, key_padding_mask, window,
                           chunk, block_ids, softcap, chunk_origin);
  return at::empty_symint({q.sym_size(0), q.sym_size(1), c10::SymInt(3)},
                          q.options().dtype(at::kFloat));
}

at::Tensor vas_aggregate_meta(const at::Tensor& head_stats) {
  check_aggregate_args(head_stats);
  return at::empty_symint({head_stats.sym_size(0), c10::SymInt(36)},
                          head_stats.options().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Meta, m) {
  m.impl("vas_head_stats", &vas_head_stats_meta);
  m.impl("vas_head_stats_qk", &vas_head_stats_qk_meta);
  m.impl("vas_aggregate", &vas_aggregate_meta);
}

}  // namespace headscope::vas::meta
