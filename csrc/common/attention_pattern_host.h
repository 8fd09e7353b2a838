// The host side of the attention patterns of the q/k ops: for the CPU kernels, each batch
// row's AttentionPattern with the last key of each block (to bound a query's keys), and the
// masking and soft-capping of a row of logits; for both, the chunks' origins. Shared by the vas and attribution kernels.
#pragma once

#include "common/attention_pattern.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace headscope {

struct PatternRows {
  std::vector<AttentionPattern> row;  // per batch row
  std::vector<int64_t> block_first;   // [B, Tk]: the first key of key j's block (blocks only)
  std::vector<int64_t> block_last;    // [B, Tk]: the last key of key j's block (blocks only)
  at::Tensor blocks;                  // block_ids as int64, contiguous (kept alive)
  int64_t Tk = 0;
  double softcap = 0;  // 0: none

  // The keys [lo, hi] query position i of batch row b may see under pattern p (row[b], or
  // a layer's variant of it; none when lo > hi), and its block qb.
  void keys(const AttentionPattern& p, int64_t b, int64_t i, int64_t& lo, int64_t& hi,
            int64_t& qb) const {
    qb = p.query_block(i, Tk);
    lo = p.first_key(i, qb, qb >= 0 ? block_first[b * Tk + i] : 0);
    hi = p.last_key(i, Tk, qb, qb >= 0 ? block_last[b * Tk + i] : -1);
  }
  // Soft-caps logits l[0, n) of keys [j0, j0 + n), all within query i's [lo, hi], and sets
  // those of keys it does not see (keys of other blocks beyond its causal window) to -inf;
  // padding is the kernels' own.
  template <typename T>
  void apply(const AttentionPattern& p, T* l, int64_t i, int64_t qb, int64_t j0,
             int64_t n) const {
    if (softcap > 0) {
      const T cap = static_cast<T>(softcap);
      for (int64_t c = 0; c < n; ++c) l[c] = softcap_logit(l[c], cap);
    }
    if (!p.has_blocks()) return;  // without blocks, every key of [lo, hi] is seen
    for (int64_t c = 0; c < n; ++c)
      if (!p.plainly_seen(i, j0 + c) && !p.sees(i, qb, j0 + c))
        l[c] = -std::numeric_limits<T>::infinity();
  }
};

// Each row's leading padding keys: int64 (B,) on the mask's device (ATen ops, no host sync).
at::Tensor leading_padding(const at::Tensor& key_padding_mask);

// The key index where each row's chunk 0 starts, int64 (B,) contiguous on the inputs'
// device (no host sync): the ops' chunk_origin when given, else the row's leading padding
// keys of key_padding_mask (bool (B, Tk), True = padding); undefined when neither is
// given (0 in every row).
at::Tensor chunk_origins(const std::optional<at::Tensor>& chunk_origin,
                         const std::optional<at::Tensor>& key_padding_mask);

// The pattern of each batch row: window, chunk 0 for none (a layer's variant of row[b] may
// set others), the chunks' origin (chunk_origins()), block_ids int64 (B, Tk) (read only
// when causal).
PatternRows pattern_rows(int64_t B, int64_t Tk, bool causal, int64_t window, int64_t chunk,
                         const std::optional<at::Tensor>& block_ids,
                         const std::optional<at::Tensor>& key_padding_mask,
                         std::optional<double> softcap, bool window_bounds_blocks,
                         const std::optional<at::Tensor>& chunk_origin);

}  // namespace headscope
