#include "common/attention_pattern_host.h"

#include <ATen/ops/cumprod.h>
#include <ATen/ops/sum.h>

#include <tuple>
#include <unordered_map>
#include <utility>

namespace headscope {

at::Tensor leading_padding(const at::Tensor& key_padding_mask) {
  return at::sum(at::cumprod(key_padding_mask.to(at::kLong), 1), {1}).contiguous();
}

at::Tensor chunk_origins(const std::optional<at::Tensor>& chunk_origin,
                         const std::optional<at::Tensor>& key_padding_mask) {
  if (chunk_origin.has_value() && chunk_origin->defined()) return chunk_origin->contiguous();
  if (key_padding_mask.has_value() && key_padding_mask->defined())
    return leading_padding(*key_padding_mask);
  return at::Tensor();
}

PatternRows pattern_rows(int64_t B, int64_t Tk, bool causal, int64_t window, int64_t chunk,
                         const std::optional<at::Tensor>& block_ids,
                         const std::optional<at::Tensor>& key_padding_mask,
                         std::optional<double> softcap, bool window_bounds_blocks,
                         const std::optional<at::Tensor>& chunk_origin) {
  PatternRows P;
  P.Tk = Tk;
  P.softcap = softcap.value_or(0.0);
  const bool with_blocks = causal && block_ids.has_value() && block_ids->defined();
  P.row.assign(B, AttentionPattern{causal, window, chunk, 0, nullptr, 1, window_bounds_blocks});
  const at::Tensor origin = B * Tk > 0 ? chunk_origins(chunk_origin, key_padding_mask)
                                       : at::Tensor();
  if (origin.defined())
    for (int64_t b = 0; b < B; ++b) P.row[b].origin = origin.const_data_ptr<int64_t>()[b];
  if (with_blocks) {
    P.blocks = block_ids->contiguous();
    const int64_t* ids = P.blocks.const_data_ptr<int64_t>();
    P.block_first.assign(B * Tk, -1);
    P.block_last.assign(B * Tk, -1);
    std::unordered_map<int64_t, std::pair<int64_t, int64_t>> span;  // id -> first, last key
    for (int64_t b = 0; b < B; ++b) {
      const int64_t* r = ids + b * Tk;
      P.row[b].blocks = r;
      span.clear();
      for (int64_t j = 0; j < Tk; ++j)
        if (r[j] >= 0) span.try_emplace(r[j], j, j).first->second.second = j;
      for (int64_t j = 0; j < Tk; ++j)
        if (r[j] >= 0) std::tie(P.block_first[b * Tk + j], P.block_last[b * Tk + j]) = span[r[j]];
    }
  }
  return P;
}

}  // namespace headscope
