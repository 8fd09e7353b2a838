// Argument checks of the attribution ops, shared by the CPU, CUDA and Meta kernels.
// Shape and dtype checks use symbolic sizes (so they run on fake tensors); the value
// checks (region ids in range, weights of a span) read the data and are for real kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>

namespace headscope::attribution {

// float32 results for float32/float16/bfloat16 inputs, float64 for float64.
at::ScalarType accum_dtype(at::ScalarType t);

// Returns true for reduce == "mean", false for "sum"; errors otherwise.
bool parse_reduce(const char* op, c10::string_view reduce);

void check_region_pool_args(const at::Tensor& attn, const at::Tensor& query_weights,
                            const at::Tensor& region_ids, const c10::SymInt& num_regions,
                            c10::string_view reduce,
                            const std::optional<at::Tensor>& key_weights = std::nullopt);

void check_region_pool_qk_args(const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& query_weights, const at::Tensor& region_ids,
                               const c10::SymInt& num_regions,
                               const std::optional<double>& scale,
                               const std::optional<at::Tensor>& key_padding_mask,
                               c10::string_view reduce,
                               const std::optional<int64_t>& window = std::nullopt,
                               const std::optional<int64_t>& chunk = std::nullopt,
                               const std::optional<at::Tensor>& block_ids = std::nullopt,
                               const std::optional<double>& softcap = std::nullopt,
                               const std::optional<at::Tensor>& key_weights = std::nullopt,
                               const std::optional<at::Tensor>& chunk_origin = std::nullopt);

// Every layer's q[l], k[l] as region_pool_qk's q, k (named "q[l]", "k[l]"), all layers of
// the first one's sizes, scale (when given) one finite value per layer, window and chunk
// (when given) one length >= 0 per layer, key_weights (when given) one tensor per layer
// (named "key_weights[l]"), chunk_origin only when some layer has chunks.
void check_region_pool_qk_layers_args(at::TensorList q, at::TensorList k,
                                      const at::Tensor& query_weights,
                                      const at::Tensor& region_ids,
                                      const c10::SymInt& num_regions,
                                      const std::optional<at::ArrayRef<double>>& scale,
                                      const std::optional<at::Tensor>& key_padding_mask,
                                      c10::string_view reduce,
                                      at::OptionalIntArrayRef window = std::nullopt,
                                      at::OptionalIntArrayRef chunk = std::nullopt,
                                      const std::optional<at::Tensor>& block_ids = std::nullopt,
                                      const std::optional<double>& softcap = std::nullopt,
                                      std::optional<at::TensorList> key_weights = std::nullopt,
                                      const std::optional<at::Tensor>& chunk_origin = std::nullopt);

// Layer l's entry of region_pool_qk_layers' window or chunk list (0 without a list).
inline int64_t layer_length(at::OptionalIntArrayRef lengths, size_t l) {
  return lengths.has_value() ? (*lengths)[l] : 0;
}

void check_linear_attribution_args(const at::Tensor& features, const at::Tensor& weight,
                                   const at::Tensor& mean, const at::Tensor& std,
                                   const std::optional<at::Tensor>& bias);

// Returns dim wrapped into [0, pred.dim()).
int64_t check_correlation_args(const char* op, const at::Tensor& pred, const at::Tensor& target,
                               int64_t dim);

// Checked arguments and allocated output of spearman/pearson: both inputs as contiguous
// float64 rows (rows x n) with the correlation dim last.
struct CorrelationRows {
  at::Tensor out;  // pred's sizes without dim, pred's dtype
  at::Tensor x, y;
  int64_t rows = 0, n = 0;
};
CorrelationRows prepare_correlation(const char* op, const at::Tensor& pred,
                                    const at::Tensor& target, int64_t dim);

void check_ward_args(const at::Tensor& features, const c10::SymInt& height,
                     const c10::SymInt& width, const c10::SymInt& num_regions,
                     const c10::SymInt& frames);

// Value checks through ATen ops (any device; one host sync each). The CPU kernels do the
// same checks inline while they read the data.
void check_region_ids_values(const char* op, const at::Tensor& region_ids, int64_t num_regions);
void check_query_weights_values(const char* op, const at::Tensor& query_weights);

// key_weights (any device): finite at every image key (region_ids >= 0), the only entries
// the ops read. Throws naming the first bad entry.
void check_key_weights_values(const char* op, const char* arg, const at::Tensor& key_weights,
                              const at::Tensor& region_ids);

// Both checks above with a single host synchronisation when the values are valid.
void check_pool_values(const char* op, const at::Tensor& region_ids, int64_t num_regions,
                       const at::Tensor& query_weights);

// Shared messages so every backend words the value errors the same way.
[[noreturn]] void fail_region_id(const char* op, int64_t value, int64_t b, int64_t t,
                                 int64_t num_regions);
[[noreturn]] void fail_query_weight(const char* op, double value, int64_t b, int64_t q);
[[noreturn]] void fail_empty_span(const char* op, int64_t b);
[[noreturn]] void fail_key_weight(const char* op, const char* arg, double value, int64_t b,
                                  int64_t h, int64_t t);

}  // namespace headscope::attribution
