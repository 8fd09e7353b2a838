// Helpers of the CPU region-pooling kernels: value checks done while reading the
// inputs once, the per-batch list of image tokens, and the softmax numerators.
#pragma once

#include "attribution/attribution_checks.h"
#include "common/cpu_math.h"

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
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

// key_weights (B, Hw, Tk) read in place as acc_t (converted once if of another dtype):
// row(b, h)[t * s2] is query head h's factor on key t, Hw dividing H. None: given is false.
template <typename acc_t>
struct KeyWeights {
  at::Tensor values;  // owns a converted copy
  const acc_t* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0, group = 1;  // group: query heads per weight head
  bool given = false;
  // query head h's factors of batch row b; key t at [t * s2]
  const acc_t* row(int64_t b, int64_t h) const { return data + b * s0 + h / group * s1; }
};

// Reads key_weights for H query heads and checks that the factors of the image keys (the
// only ones read) are finite; throws naming arg.
template <typename acc_t>
KeyWeights<acc_t> read_key_weights(const char* op, const char* arg,
                                   const std::optional<at::Tensor>& key_weights, int64_t H,
                                   const RegionLists& regions) {
  KeyWeights<acc_t> w;
  if (!key_weights.has_value() || !key_weights->defined()) return w;
  w.values = key_weights->to(c10::CppTypeToScalarType<acc_t>::value);
  w.s0 = w.values.stride(0);
  w.s1 = w.values.stride(1);
  w.s2 = w.values.stride(2);
  const int64_t B = w.values.size(0), Hw = w.values.size(1);
  w.group = H / Hw;
  w.given = true;
  w.data = w.values.template const_data_ptr<acc_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hw; ++h) {
      const acc_t* row = w.data + b * w.s0 + h * w.s1;
      for (const int64_t t : regions.pos[b])
        if (!std::isfinite(row[t * w.s2]))
          fail_key_weight(op, arg, static_cast<double>(row[t * w.s2]), b, h, t);
    }
  return w;
}

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
