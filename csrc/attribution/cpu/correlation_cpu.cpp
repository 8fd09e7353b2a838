// CPU kernels of spearman and pearson along one dim, in double precision.
#include "attribution/attribution_checks.h"
#include "attribution/cpu/correlation_cpu.h"
#include "common/kernel.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace headscope::attribution::cpu {

void average_ranks(const double* x, int64_t n, double* ranks, std::vector<int64_t>& order) {
  order.resize(n);
  std::iota(order.begin(), order.end(), int64_t(0));
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] < x[b]; });
  int64_t i = 0;
  while (i < n) {
    int64_t j = i + 1;
    while (j < n && x[order[j]] == x[order[i]]) ++j;
    const double r = 0.5 * static_cast<double>(i + j - 1) + 1.0;  // mean of 1-based i+1..j
    for (int64_t t = i; t < j; ++t) ranks[order[t]] = r;
    i = j;
  }
}

double pearson_row(const double* x, const double* y, int64_t n) {
  // A constant input has no correlation (scipy: NaN); tested exactly, not through the
  // centred sums, whose rounding can leave a tiny nonzero variance.
  bool x_const = true, y_const = true;
  for (int64_t i = 1; i < n; ++i) {
    x_const = x_const && x[i] == x[0];
    y_const = y_const && y[i] == y[0];
  }
  if (x_const || y_const) return std::numeric_limits<double>::quiet_NaN();
  double mx = 0, my = 0;
  for (int64_t i = 0; i < n; ++i) {
    mx += x[i];
    my += y[i];
  }
  mx /= static_cast<double>(n);
  my /= static_cast<double>(n);
  double sxy = 0, sxx = 0, syy = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double dx = x[i] - mx, dy = y[i] - my;
    sxy += dx * dy;
    sxx += dx * dx;
    syy += dy * dy;
  }
  if (std::isnan(sxy) || std::isnan(sxx) || std::isnan(syy))
    return std::numeric_limits<double>::quiet_NaN();
  if (sxx == 0 || syy == 0) return std::numeric_limits<double>::quiet_NaN();  // constant
  const double r = sxy / std::sqrt(sxx * syy);
  return std::max(-1.0, std::min(1.0, r));
}

namespace {

template <bool kRank>
at::Tensor correlation_cpu(const char* op, const at::Tensor& pred, const at::Tensor& target,
                           int64_t dim) {
  const auto p = prepare_correlation(op, pred, target, dim);
  const int64_t rows = p.rows, n = p.n;
  if (rows == 0) return p.out;
  const auto &x = p.x, &y = p.y, &out = p.out;
  const double* xp = x.const_data_ptr<double>();
  const double* yp = y.const_data_ptr<double>();
  std::vector<double> res(rows);
  at::parallel_for(0, rows, std::max<int64_t>(1, 2048 / n), [&](int64_t begin, int64_t end) {
    std::vector<double> rx, ry;
    std::vector<int64_t> order;
    for (int64_t r = begin; r < end; ++r) {
      const double* a = xp + r * n;
      const double* b = yp + r * n;
      bool has_nan = false;
      for (int64_t i = 0; i < n && !has_nan; ++i) has_nan = std::isnan(a[i]) || std::isnan(b[i]);
      if (has_nan) {
        res[r] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      if constexpr (kRank) {
        rx.resize(n);
        ry.resize(n);
        average_ranks(a, n, rx.data(), order);
        average_ranks(b, n, ry.data(), order);
        res[r] = pearson_row(rx.data(), ry.data(), n);
      } else {
        res[r] = pearson_row(a, b, n);
      }
    }
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(),
                                  "headscope_correlation_out", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) o[r] = static_cast<scalar_t>(res[r]);
  });
  return out;
}

at::Tensor spearman_cpu(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  return correlation_cpu<true>("headscope::spearman", pred, target, dim);
}
at::Tensor pearson_cpu(const at::Tensor& pred, const at::Tensor& target, int64_t dim) {
  return correlation_cpu<false>("headscope::pearson", pred, target, dim);
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("spearman", HEADSCOPE_KERNEL("spearman", spearman_cpu));
  m.impl("pearson", HEADSCOPE_KERNEL("pearson", pearson_cpu));
}

}  // namespace headscope::attribution::cpu
