#include "attribution/attribution.h"

#include "common/typed_op.h"

namespace headscope {

at::Tensor region_pool(const at::Tensor& attn, const at::Tensor& query_weights,
                       const at::Tensor& region_ids, c10::SymInt num_regions,
                       c10::string_view reduce, const std::optional<at::Tensor>& key_weights) {
  static const auto op = HEADSCOPE_TYPED_OP(region_pool);
  return op.call(attn, query_weights, region_ids, std::move(num_regions), reduce, key_weights);
}

at::Tensor region_pool_qk(const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& query_weights, const at::Tensor& region_ids,
                          c10::SymInt num_regions, std::optional<double> scale, bool causal,
                          const std::optional<at::Tensor>& key_padding_mask,
                          c10::string_view reduce, std::optional<int64_t> window,
                          std::optional<int64_t> chunk, const std::optional<at::Tensor>& block_ids,
                          std::optional<double> softcap, bool window_bounds_blocks,
                          const std::optional<at::Tensor>& key_weights,
                          const std::optional<at::Tensor>& chunk_origin) {
  static const auto op = HEADSCOPE_TYPED_OP(region_pool_qk);
  return op.call(q, k, query_weights, region_ids, std::move(num_regions), scale, causal,
                 key_padding_mask, reduce, window, chunk, block_ids, softcap,
                 window_bounds_blocks, key_weights, chunk_origin);
}

at::Tensor region_pool_qk_layers(at::TensorList q, at::TensorList k,
                                 const at::Tensor& query_weights, const at::Tensor& region_ids,
                                 c10::SymInt num_regions, std::optional<at::ArrayRef<double>> scale,
                                 bool causal, const std::optional<at::Tensor>& key_padding_mask,
                                 c10::string_view reduce, at::OptionalIntArrayRef window,
                                 at::OptionalIntArrayRef chunk,
                                 const std::optional<at::Tensor>& block_ids,
                                 std::optional<double> softcap, bool window_bounds_blocks,
                                 std::optional<at::TensorList> key_weights,
                                 const std::optional<at::Tensor>& chunk_origin) {
  static const auto op = HEADSCOPE_TYPED_OP(region_pool_qk_layers);
  return op.call(q, k, query_weights, region_ids, std::move(num_regions), scale, causal,
                 key_padding_mask, reduce, window, chunk, block_ids, softcap,
                 window_bounds_blocks, key_weights, chunk_origin);
}

at::Tensor linear_attribution(const at::Tensor& features, const at::Tensor& weight,
                              const at::Tensor& mean, const at::Tensor& std,
                              const std::optional<at::Tensor>& bias) {
  static const auto op = HEADSCOPE_TYPED_OP(linear_attribution);
  return op.call(features, weight, mean, std, bias);
}

at::Tensor spearman(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  static const auto op = HEADSCOPE_TYPED_OP(spearman);
  return op.call(pred, target, dim);
}

at::Tensor pearson(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  static const auto op = HEADSCOPE_TYPED_OP(pearson);
  return op.call(pred, target, dim);
}

at::Tensor ward_regions(const at::Tensor& features, c10::SymInt height, c10::SymInt width,
                        c10::SymInt num_regions, c10::SymInt frames) {
  static const auto op = HEADSCOPE_TYPED_OP(ward_regions);
  return op.call(features, std::move(height), std::move(width), std::move(num_regions),
                 std::move(frames));
}

}  // namespace headscope
