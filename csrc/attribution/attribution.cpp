#include "attribution/attribution.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace headscope {

at::Tensor region_pool(const at::Tensor& attn, const at::Tensor& query_weights,
                       const at::Tensor& region_ids, int64_t num_regions,
                       c10::string_view reduce) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::region_pool", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, c10::string_view)>();
  return op.call(attn, query_weights, region_ids, num_regions, reduce);
}

at::Tensor region_pool_qk(const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& query_weights, const at::Tensor& region_ids,
                          int64_t num_regions, double scale, bool causal,
                          const std::optional<at::Tensor>& key_padding_mask,
                          c10::string_view reduce) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("headscope::region_pool_qk", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, int64_t, double, bool,
                            const std::optional<at::Tensor>&, c10::string_view)>();
  return op.call(q, k, query_weights, region_ids, num_regions, scale, causal, key_padding_mask,
                 reduce);
}

at::Tensor linear_attribution(const at::Tensor& features, const at::Tensor& weight,
                              const at::Tensor& mean, const at::Tensor& std, double bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::linear_attribution", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, double)>();
  return op.call(features, weight, mean, std, bias);
}

at::Tensor spearman(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::spearman", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(pred, target, dim);
}

at::Tensor pearson(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::pearson", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(pred, target, dim);
}

at::Tensor ward_regions(const at::Tensor& features, int64_t height, int64_t width,
                        int64_t num_regions) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("headscope::ward_regions", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)>();
  return op.call(features, height, width, num_regions);
}

}  // namespace headscope
