// C++ API of the vas family: value-attention similarity (VAS) statistics per head and
// their aggregation to the 36 VAS features. Each call goes through the dispatcher.
// Semantics, shapes and policies: docs/vas.md.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace headscope {

// Per head of one layer: (B, H, 3) float32 = (d, c, r), the normalised mismatch, CKA and
// row KL of the reference implementation (extract_vas in vas_reference.py, docs/vas.md)
// between the attention `attn` (B, H, T, T) and the value Gram of the row-normalised
// `head_writes` (B, H, T, Dh), over the window of n = clamp(lengths[b]) positions starting
// at 0, or at offsets[b] (left padding) when `offsets` is given.
at::Tensor vas_head_stats(const at::Tensor& attn, const at::Tensor& head_writes,
                          const at::Tensor& lengths,
                          const std::optional<at::Tensor>& offsets = std::nullopt);

// The same statistics with the attention recomputed tile by tile from q (B, H, T, D) and
// k (B, Hkv, T, D): softmax(q k^T * scale + causal mask), never stored whole; no scale
// means D ** -0.5. Keys where the bool (B, T) `key_padding_mask` is true are left out of
// the softmax (padding). The attention pattern (docs/vas.md): `window` (a query sees the
// `window` most recent keys up to itself), `chunk` (only keys of its chunk), `block_ids`
// (B, T) int64 (a query in block b >= 0 also sees the later keys of b) and `softcap`
// (logits become softcap * tanh(logits / softcap)); 0 or none: no window, no chunks.
// window_bounds_blocks: the window and chunks bound block keys too (Gemma 3); false: a
// query sees its whole block (PaliGemma 2). chunk_origin (B,) int64, only with a chunk: the
// key index where each row's chunk 0 starts (any integer: negative when the keys start past
// it); none: the row's leading padding keys.
at::Tensor vas_head_stats_qk(const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& head_writes, const at::Tensor& lengths,
                             std::optional<double> scale = std::nullopt, bool causal = true,
                             const std::optional<at::Tensor>& offsets = std::nullopt,
                             const std::optional<at::Tensor>& key_padding_mask = std::nullopt,
                             std::optional<int64_t> window = std::nullopt,
                             std::optional<int64_t> chunk = std::nullopt,
                             const std::optional<at::Tensor>& block_ids = std::nullopt,
                             std::optional<double> softcap = std::nullopt,
                             bool window_bounds_blocks = true,
                             const std::optional<at::Tensor>& chunk_origin = std::nullopt);

// (B, L, H, 3) per-layer per-head stats -> (B, 36) float32 features in the reference
// implementation's column order (per layer mean/std/max/min over heads, then
// mean/std/max over layers).
at::Tensor vas_aggregate(const at::Tensor& head_stats);

}  // namespace headscope
