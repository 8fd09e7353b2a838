// Helpers of the CPU region-pooling kernels: value checks done while reading the
// inputs once, the per-batch list of image tokens, and the softmax numerators.
#pragma once

#include "common/cpu_math.h"

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace headscope::attribution::cpu {

// Image tokens of each batch row: positions t with region_ids[b, t] >= 0 and their region,
// plus region sizes. Throws (naming region_ids) on a value outside [-1, num_regions).
struct RegionLists {
  std::vector<std::vector<int64_t>> pos, reg;  // [b] -> positions / regions (ascending t)
  std::vector<int64_t> count;                   // [b * K + k] tokens in region k
};
RegionLists build_region_lists(const char* op, const at::Tensor& region_ids, int64_t num_regions);

// Per batch row: the normalised weights w[b, q] / sum_q w[b, q] (double) and the list of
// queries with a nonzero weight. Throws on negative/non-finite weights and empty spans.
struct SpanWeights {
  std::vector<std::vector<int64_t>> active;  // [b] -> q with w != 0
  std::vector<std::vector<double>> weight;   // [b] -> w / sum (aligned with active)
};
SpanWeights build_span_weights(const char* op, const at::Tensor& query_weights);

// x[i] = exp(x[i] - m) for i < n (m >= every x[i]; -inf gives 0); returns the sum of the
// results.
inline float exp_shift_sum(float* x, int64_t n, float m) {
  return exp_shift_scale(x, x, n, m, 1.0f);
}
inline double exp_shift_sum(double* x, int64_t n, double m) {
  double sum = 0.;
  for (int64_t i = 0; i < n; ++i) {
    const double e = std::exp(x[i] - m);
    x[i] = e;
    sum += e;
  }
  return sum;
}

}  // namespace headscope::attribution::cpu
