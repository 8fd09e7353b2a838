// Argument checks and the window rule shared by every backend of the vas ops.
#pragma once

#include "common/checks.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace headscope::vas {

// Shapes, ranks, dtypes and devices (works on fake/meta tensors: symbolic sizes).
void check_head_stats_args(const at::Tensor& attn, const at::Tensor& head_writes,
                           const at::Tensor& lengths, const std::optional<at::Tensor>& offsets);
void check_head_stats_qk_args(const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& head_writes, const at::Tensor& lengths,
                              const std::optional<double>& scale,
                              const std::optional<at::Tensor>& offsets,
                              const std::optional<at::Tensor>& key_padding_mask);
void check_aggregate_args(const at::Tensor& head_stats);

// Values of lengths (and offsets): 0 <= lengths[b] <= T, 0 <= offsets[b],
// offsets[b] + lengths[b] <= T. Takes CPU int64 tensors (the CUDA kernels copy them).
void check_window_values(const char* op, const at::Tensor& lengths_cpu,
                         const at::Tensor* offsets_cpu, int64_t T);

// The seed's used length: T_used = max(min(T_b, T_max), 4), then bounded by T_max.
inline int64_t window_len(int64_t length, int64_t T) {
  return std::min(std::max(std::min(length, T), int64_t(4)), T);
}
// First position of the window: 0 (the seed's first-T rule) or, with offsets (left
// padding), offsets[b], moved left where needed so that the window fits in T.
inline int64_t window_start(int64_t offset, int64_t n, int64_t T) {
  return std::max<int64_t>(0, std::min(offset, T - n));
}

}  // namespace headscope::vas
