// Row helpers of the CPU correlation kernels (double precision).
#pragma once

#include <cstdint>
#include <vector>

namespace headscope::attribution::cpu {

// 1-based average ranks of x[0..n) (ties share the mean of their positions).
void average_ranks(const double* x, int64_t n, double* ranks, std::vector<int64_t>& order);
// Pearson correlation; NaN for a NaN entry or a constant input; clipped to [-1, 1].
double pearson_row(const double* x, const double* y, int64_t n);

}  // namespace headscope::attribution::cpu
