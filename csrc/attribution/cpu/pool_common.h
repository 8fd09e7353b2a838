// Helpers of the CPU region-pooling kernels: value checks done while reading the
// inputs once, the per-batch list of image tokens, and a vectorisable exp.
#pragma once

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

// exp(x) for x <= 88.7 with ~1 ulp relative error; x < -87 (and -inf) gives exactly 0.
// Written as straight-line float math so that loops over it vectorise (AVX2 with
// -march=native); Cephes' expf polynomial.
inline float exp_approx(float x) {
  const float xin = x;
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  x = x < -87.0f ? -87.0f : x;
  float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f;
  x = x + fx * 2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500E-4f;
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return xin < -87.0f ? 0.0f : y * scale;
}

// x[i] = exp(x[i] - m) for i < n; returns the sum of the results.
inline float exp_shift_sum(float* x, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float e = exp_approx(x[i] - m);
    x[i] = e;
    sum += e;
  }
  return sum;
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

template <typename T>
inline T max_of(const T* x, int64_t n) {
  T m[8];
  for (auto& v : m) v = -INFINITY;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
  for (; i < n; ++i) m[0] = x[i] > m[0] ? x[i] : m[0];
  T r = m[0];
  for (int j = 1; j < 8; ++j) r = m[j] > r ? m[j] : r;
  return r;
}

}  // namespace headscope::attribution::cpu
