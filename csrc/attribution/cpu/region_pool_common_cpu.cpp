#include "attribution/cpu/region_pool_common_cpu.h"

#include "attribution/attribution_checks.h"

#include <ATen/Dispatch.h>

#include <cmath>

namespace headscope::attribution::cpu {

RegionLists build_region_lists(const char* op, const at::Tensor& region_ids,
                               int64_t num_regions) {
  const int64_t B = region_ids.size(0), Tk = region_ids.size(1);
  const int64_t s0 = region_ids.stride(0), s1 = region_ids.stride(1);
  const int64_t* r = region_ids.const_data_ptr<int64_t>();
  RegionLists out;
  out.pos.resize(B);
  out.reg.resize(B);
  out.count.assign(B * num_regions, 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Tk; ++t) {
      const int64_t k = r[b * s0 + t * s1];
      if (k == -1) continue;
      if (k < -1 || k >= num_regions) fail_region_id(op, k, b, t, num_regions);
      out.pos[b].push_back(t);
      out.reg[b].push_back(k);
      ++out.count[b * num_regions + k];
    }
  }
  return out;
}

SpanWeights build_span_weights(const char* op, const at::Tensor& query_weights) {
  const int64_t B = query_weights.size(0), Tq = query_weights.size(1);
  SpanWeights out;
  out.active.resize(B);
  out.weight.resize(B);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query_weights.scalar_type(),
                                  "headscope_span_weights", [&] {
    const scalar_t* w = query_weights.const_data_ptr<scalar_t>();
    const int64_t s0 = query_weights.stride(0), s1 = query_weights.stride(1);
    for (int64_t b = 0; b < B; ++b) {
      double sum = 0;
      for (int64_t q = 0; q < Tq; ++q) {
        const double v = static_cast<double>(w[b * s0 + q * s1]);
        if (!(std::isfinite(v) && v >= 0)) fail_query_weight(op, v, b, q);
        if (v == 0) continue;
        out.active[b].push_back(q);
        out.weight[b].push_back(v);
        sum += v;
      }
      if (!(sum > 0)) fail_empty_span(op, b);
      for (auto& v : out.weight[b]) v /= sum;
    }
  });
  return out;
}

}  // namespace headscope::attribution::cpu
