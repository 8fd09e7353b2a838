// Argument checks shared by every backend of the vas ops (the window rule: vas_math.h).
#pragma once

#include "common/checks.h"
#include "vas/vas_math.h"

#include <ATen/core/Tensor.h>

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
                              const std::optional<at::Tensor>& key_padding_mask,
                              const std::optional<int64_t>& window = std::nullopt,
                              const std::optional<int64_t>& chunk = std::nullopt,
                              const std::optional<at::Tensor>& block_ids = std::nullopt,
                              const std::optional<double>& softcap = std::nullopt,
                              const std::optional<at::Tensor>& chunk_origin = std::nullopt);
void check_aggregate_args(const at::Tensor& head_stats);

// Values of lengths (and offsets): 0 <= lengths[b] <= T, 0 <= offsets[b],
// offsets[b] + lengths[b] <= T. Takes CPU int64 tensors (the CUDA kernels copy them).
void check_window_values(const char* op, const at::Tensor& lengths_cpu,
                         const at::Tensor* offsets_cpu, int64_t T);

}  // namespace headscope::vas
