// Which keys a query sees under the attention patterns of the q/k ops (vas_head_stats_qk,
// region_pool_qk, region_pool_qk_layers): causal, a sliding window, chunks and
// bidirectional blocks, composed as transformers' masking_utils composes them: Gemma 3's
// window AND chunk AND (causal OR same block) (window_bounds_blocks), or PaliGemma 2's
// (window AND chunk AND causal) OR same block; padding is applied on top by the kernels.
// One definition for the CPU and CUDA kernels (HEADSCOPE_HD).
//
// Positions are key indices: a query at position i is the query whose own key is key i
// (region_pool_qk aligns its Tq queries with the last Tq keys; vas_head_stats_qk has one
// length for both).
#pragma once

#include "common/host_device.h"

#include <cmath>
#include <cstdint>

namespace headscope {

// The pattern of one batch row.
struct AttentionPattern {
  bool causal = true;
  int64_t window = 0;  // > 0: key j is seen by query i only if j > i - window
  int64_t chunk = 0;   // > 0: only keys of i's chunk [origin + m chunk, origin + (m + 1) chunk)
  int64_t origin = 0;  // the key index where chunk 0 starts (any integer: before the first
                       // key when the cache starts past it); by default the row's leading
                       // padding keys (transformers counts chunks from the first real token)
  const int64_t* blocks = nullptr;  // block id of each key (block_ids[b]), negative: none
  int64_t bstride = 1;
  bool window_bounds_blocks = true;  // the window and chunks bound a block's keys too (Gemma 3);
                             // false: a query sees its whole block (PaliGemma 2)

  HEADSCOPE_HD bool has_blocks() const { return causal && blocks != nullptr; }
  HEADSCOPE_HD int64_t block(int64_t j) const { return blocks[j * bstride]; }
  // The block of query position i among tk keys (negative: none; a query left of the keys,
  // possible in region_pool_qk with Tq > Tk, has none).
  HEADSCOPE_HD int64_t query_block(int64_t i, int64_t tk) const {
    return has_blocks() && i >= 0 && i < tk ? block(i) : -1;
  }
  // The first key of i's chunk. Only origin mod chunk matters: computed from the
  // remainders, so that no origin overflows.
  HEADSCOPE_HD int64_t chunk_start(int64_t i) const {
    const int64_t r = (i % chunk - origin % chunk) % chunk;  // in (-chunk, chunk)
    return i - (r < 0 ? r + chunk : r);
  }
  // The lowest key the window and chunks let query i see (may be negative: from key 0).
  HEADSCOPE_HD int64_t window_start(int64_t i) const {
    int64_t lo = 0;
    if (window > 0 && i - window + 1 > lo) lo = i - window + 1;
    if (chunk > 0 && chunk_start(i) > lo) lo = chunk_start(i);
    return lo;
  }
  // The lowest key query i (of block qb) may see. block_first: the first key of its block
  // (qb >= 0), or any bound at or below it.
  HEADSCOPE_HD int64_t first_key(int64_t i, int64_t qb, int64_t block_first) const {
    const int64_t lo = window_start(i);
    return !window_bounds_blocks && qb >= 0 && block_first < lo ? block_first : lo;
  }
  // The highest key query i may see among tk keys (below first_key: none). block_last: the
  // last key of i's block (qb >= 0), or any bound at or above it.
  HEADSCOPE_HD int64_t last_key(int64_t i, int64_t tk, int64_t qb, int64_t block_last) const {
    int64_t hi = causal ? i : tk - 1;
    const int64_t chunk_end = chunk > 0 ? chunk_start(i) + chunk - 1 : tk - 1;
    if (chunk_end < hi) hi = chunk_end;
    if (qb >= 0) {
      const int64_t b = window_bounds_blocks && chunk_end < block_last ? chunk_end : block_last;
      if (b > hi) hi = b;
    }
    return hi < tk - 1 ? hi : tk - 1;
  }
  // Whether query i (of block qb) sees key j (padding aside).
  HEADSCOPE_HD bool sees(int64_t i, int64_t qb, int64_t j) const {
    const bool same_block = qb >= 0 && block(j) == qb;
    if (same_block && !window_bounds_blocks) return true;
    if (window > 0 && j <= i - window) return false;
    if (chunk > 0 && chunk_start(j) != chunk_start(i)) return false;
    return !causal || j <= i || same_block;
  }
  // Whether key j within [window_start(i), i] needs sees(): every such key is seen
  // (the window, the chunk and causal all allow it); only keys outside it can be hidden.
  HEADSCOPE_HD bool plainly_seen(int64_t i, int64_t j) const {
    return j <= i && j >= window_start(i);
  }
};

// The pattern of a batch, as the CUDA kernels take it: batch row b's is row0 with block_ids'
// row b and its chunks' origin (origin: a device array, chunk_origins(); nullptr for 0),
// and the logits' soft cap (0: none).
struct BatchPattern {
  AttentionPattern row0;
  int64_t bstride0 = 0;  // block_ids' batch stride
  const int64_t* origin = nullptr;
  double softcap = 0;
  HEADSCOPE_HD AttentionPattern row(int64_t b) const {
    AttentionPattern p = row0;
    if (p.blocks != nullptr) p.blocks += b * bstride0;
    if (origin != nullptr) p.origin = origin[b];
    return p;
  }
};

// Gemma 2's logit soft-capping, cap tanh(l / cap); a non-finite logit (an infinity in q or
// k) becomes NaN, so that the head's result is NaN as without a cap.
template <typename T>
HEADSCOPE_HD inline T softcap_logit(T l, T cap) {
  return l - l == T(0) ? cap * std::tanh(l / cap) : l - l;
}

}  // namespace headscope
