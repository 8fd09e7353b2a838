// C++ API of the attribution family (vStream): region pooling of attention, the
// linear attribution head, rank/linear correlations and Ward regions on a patch grid.
// Each call goes through the dispatcher, so CPU, CUDA and autograd kernels all apply.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/string_view.h>

#include <optional>

namespace headscope {

// attn (B, H, Tq, Tk) attention probabilities of one layer, query_weights (B, Tq) >= 0
// (0 outside the span), region_ids int64 (B, Tk) in [-1, num_regions) (-1: no region).
// Returns (B, K, H): the query-weighted mean attention mass on each region's keys;
// reduce "mean" divides by the region's size. float32 out for float32/16/bf16 in.
// key_weights (B, Hw, Tk) float, Hw dividing H, finite at image keys (the only ones read):
// each attention weight to key t is multiplied by key_weights[b, h / (H / Hw), t] before
// the region sum (Hw = H: one weight per head; Hw = Hkv: one per group of grouped-query
// heads; Hw = 1: shared by all heads), e.g. value norms ||v_t W_O^h|| (docs/attribution.md).
// Any strides (a view of a longer buffer is read in place).
at::Tensor region_pool(const at::Tensor& attn, const at::Tensor& query_weights,
                       const at::Tensor& region_ids, c10::SymInt num_regions,
                       c10::string_view reduce = "sum",
                       const std::optional<at::Tensor>& key_weights = std::nullopt);

// The same from q (B, H, Tq, D) and k (B, Hkv, Tk, D) (Hkv divides H), streaming:
// softmax(scale * q k^T) (no scale: D ** -0.5) with causal (bottom-right aligned) and
// key_padding_mask (B, Tk) bool, true = padding (ignored) masking, never storing
// (B, H, Tq, Tk). The attention pattern, as vas_head_stats_qk's (docs/attribution.md):
// `window`, `chunk` (0 or none: none), `block_ids` (B, Tk) int64, `softcap` and
// `window_bounds_blocks` (false: a query sees its whole block whatever the window), and
// `chunk_origin` (B,) int64, only with a chunk: the key index where each row's chunk 0
// starts (none: the row's leading padding keys).
// key_weights as region_pool's (Hw divides H, so k's Hkv heads are one choice).
at::Tensor region_pool_qk(const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& query_weights, const at::Tensor& region_ids,
                          c10::SymInt num_regions, std::optional<double> scale = std::nullopt,
                          bool causal = true,
                          const std::optional<at::Tensor>& key_padding_mask = std::nullopt,
                          c10::string_view reduce = "sum",
                          std::optional<int64_t> window = std::nullopt,
                          std::optional<int64_t> chunk = std::nullopt,
                          const std::optional<at::Tensor>& block_ids = std::nullopt,
                          std::optional<double> softcap = std::nullopt,
                          bool window_bounds_blocks = true,
                          const std::optional<at::Tensor>& key_weights = std::nullopt,
                          const std::optional<at::Tensor>& chunk_origin = std::nullopt);

// region_pool_qk of L layers in one call: q[l] (B, H, Tq, D), k[l] (B, Hkv, Tk, D), every
// layer of the first one's sizes; scale none (D ** -0.5) or one per layer. Returns
// (B, K, L * H), column l * H + h (the layer-major order of an attribution head's features).
// window, chunk: none, or one length per layer (0: none in that layer); block_ids, softcap
// and chunk_origin (given only when some layer has chunks) apply to every layer. key_weights: none, or one (B, Hw, Tk) tensor per layer (the
// per-layer value norms are computed layer by layer: a list needs no stacking copy).
at::Tensor region_pool_qk_layers(at::TensorList q, at::TensorList k,
                                 const at::Tensor& query_weights, const at::Tensor& region_ids,
                                 c10::SymInt num_regions,
                                 std::optional<at::ArrayRef<double>> scale = std::nullopt,
                                 bool causal = true,
                                 const std::optional<at::Tensor>& key_padding_mask = std::nullopt,
                                 c10::string_view reduce = "sum",
                                 at::OptionalIntArrayRef window = std::nullopt,
                                 at::OptionalIntArrayRef chunk = std::nullopt,
                                 const std::optional<at::Tensor>& block_ids = std::nullopt,
                                 std::optional<double> softcap = std::nullopt,
                                 bool window_bounds_blocks = true,
                                 std::optional<at::TensorList> key_weights = std::nullopt,
                                 const std::optional<at::Tensor>& chunk_origin = std::nullopt);

// features (..., F) -> (...): ((features - mean) / std) . weight + bias, bias a 0-dim
// tensor (none: 0). A std entry that is not finite and positive makes the scores NaN.
at::Tensor linear_attribution(const at::Tensor& features, const at::Tensor& weight,
                              const at::Tensor& mean, const at::Tensor& std,
                              const std::optional<at::Tensor>& bias = std::nullopt);

// Spearman (average ranks for ties) and Pearson correlation of pred and target along dim.
// A constant slice gives NaN (as scipy), a NaN entry gives NaN.
at::Tensor spearman(const at::Tensor& pred, const at::Tensor& target, int64_t dim = -1);
at::Tensor pearson(const at::Tensor& pred, const at::Tensor& target, int64_t dim = -1);

// features (M, C), M = frames * height * width patches, frame by frame, each frame's in
// row-major order -> int64 labels (M,): Ward agglomerative clustering with grid
// connectivity (4 neighbours in a frame, and the same place in the previous and next
// frame) down to num_regions clusters, labels numbered by first appearance.
at::Tensor ward_regions(const at::Tensor& features, c10::SymInt height, c10::SymInt width,
                        c10::SymInt num_regions, c10::SymInt frames = 1);

}  // namespace headscope
