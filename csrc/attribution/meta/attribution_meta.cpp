// Meta (fake tensor) kernels of the attribution ops: the same argument checks as the
// real kernels, output shapes from symbolic sizes (torch.compile / torch.export).
#include "attribution/attribution_checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace headscope::attribution::meta {
namespace {

at::Tensor region_pool_meta(const at::Tensor& attn, const at::Tensor& query_weights,
                            const at::Tensor& region_ids, c10::SymInt num_regions,
                            c10::string_view reduce,
                            const std::optional<at::Tensor>& key_weights) {
  check_region_pool_args(attn, query_weights, region_ids, num_regions, reduce, key_weights);
  return at::empty_symint({attn.sym_size(0), num_regions, attn.sym_size(1)},
                          attn.options().dtype(accum_dtype(attn.scalar_type())));
}

at::Tensor region_pool_qk_meta(const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& query_weights, const at::Tensor& region_ids,
                               c10::SymInt num_regions, std::optional<double> scale,
                               bool causal, const std::optional<at::Tensor>& key_padding_mask,
                               c10::string_view reduce, std::optional<int64_t> window,
                               std::optional<int64_t> chunk,
                               const std::optional<at::Tensor>& block_ids,
                               std::optional<double> softcap, bool window_bounds_blocks,
                               const std::optional<at::Tensor>& key_weights,
                               const std::optional<at::Tensor>& chunk_origin) {
  check_region_pool_qk_args(q, k, query_weights, region_ids, num_regions, scale,
                            key_padding_mask, reduce, window, chunk, block_ids, softcap,
                            key_weights, chunk_origin);
  return at::empty_symint({q.sym_size(0), num_regions, q.sym_size(1)},
                          q.options().dtype(accum_dtype(q.scalar_type())));
}

at::Tensor linear_attribution_meta(const at::Tensor& features, const at::Tensor& weight,
                                   const at::Tensor& mean, const at::Tensor& std,
                                   const std::optional<at::Tensor>& bias) {
  check_linear_attribution_args(features, weight, mean, std, bias);
  auto sizes = features.sym_sizes().vec();
  sizes.pop_back();
  return at::empty_symint(sizes, features.options());
}

at::Tensor correlation_meta(const char* op, const at::Tensor& pred, const at::Tensor& target,
                            int64_t dim) {
  const int64_t d = check_correlation_args(op, pred, target, dim);
  auto sizes = pred.sym_sizes().vec();
  sizes.erase(sizes.begin() + d);
  return at::empty_symint(sizes, pred.options());
}

at::Tensor spearman_meta(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  return correlation_meta("headscope::spearman", pred, target, dim);
}
at::Tensor pearson_meta(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  return correlation_meta("headscope::pearson", pred, target, dim);
}

at::Tensor ward_regions_meta(const at::Tensor& features, c10::SymInt height, c10::SymInt width,
                             c10::SymInt num_regions, c10::SymInt frames) {
  check_ward_args(features, height, width, num_regions, frames);
  return at::empty_symint({features.sym_size(0)}, features.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, Meta, m) {
  m.impl("region_pool", &region_pool_meta);
  m.impl("region_pool_qk", &region_pool_qk_meta);
  m.impl("linear_attribution", &linear_attribution_meta);
  m.impl("spearman", &spearman_meta);
  m.impl("pearson", &pearson_meta);
  m.impl("ward_regions", &ward_regions_meta);
}

}  // namespace headscope::attribution::meta
