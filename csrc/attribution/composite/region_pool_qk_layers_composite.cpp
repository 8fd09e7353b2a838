// headscope::region_pool_qk_layers as one region_pool_qk per layer, concatenated into
// layer-major columns: the kernel of every backend without one of its own (CUDA, where
// each layer is an asynchronous launch anyway, and Meta for fake tensors). The CPU has
// cpu/region_pool_cpu.cpp, which pools every layer in one pass.
#include "attribution/attribution.h"
#include "attribution/attribution_checks.h"

#include <ATen/ops/cat.h>
#include <torch/library.h>

#include <vector>

namespace headscope::attribution::composite {
namespace {

at::Tensor region_pool_qk_layers(at::TensorList q, at::TensorList k,
                                 const at::Tensor& query_weights, const at::Tensor& region_ids,
                                 c10::SymInt num_regions,
                                 std::optional<at::ArrayRef<double>> scale, bool causal,
                                 const std::optional<at::Tensor>& key_padding_mask,
                                 c10::string_view reduce, at::OptionalIntArrayRef window,
                                 at::OptionalIntArrayRef chunk,
                                 const std::optional<at::Tensor>& block_ids,
                                 std::optional<double> softcap, bool window_bounds_blocks,
                                 std::optional<at::TensorList> key_weights,
                                 const std::optional<at::Tensor>& chunk_origin) {
  check_region_pool_qk_layers_args(q, k, query_weights, region_ids, num_regions, scale,
                                   key_padding_mask, reduce, window, chunk, block_ids, softcap,
                                   key_weights, chunk_origin);
  std::vector<at::Tensor> layers;
  layers.reserve(q.size());
  for (size_t l = 0; l < q.size(); ++l)
    layers.push_back(headscope::region_pool_qk(
        q[l], k[l], query_weights, region_ids, num_regions,
        scale.has_value() ? std::optional<double>((*scale)[l]) : std::nullopt, causal,
        key_padding_mask, reduce, layer_length(window, l), layer_length(chunk, l), block_ids,
        softcap, window_bounds_blocks,
        key_weights.has_value() ? std::optional<at::Tensor>((*key_weights)[l]) : std::nullopt,
        // a layer without chunks takes no origin
        layer_length(chunk, l) > 0 ? chunk_origin : std::nullopt));
  return at::cat(layers, 2);
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CompositeExplicitAutograd, m) {
  m.impl("region_pool_qk_layers", &region_pool_qk_layers);
}

}  // namespace headscope::attribution::composite
