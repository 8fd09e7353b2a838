// CPU kernel of linear_attribution: ((features - mean) / std) . weight + bias per row.
#include "attribution/attribution_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace headscope::attribution::cpu {
namespace {

at::Tensor linear_attribution_cpu(const at::Tensor& features, const at::Tensor& weight,
                                  const at::Tensor& mean, const at::Tensor& std, double bias) {
  const auto p = prepare_linear_attribution(features, weight, mean, std);
  const int64_t rows = p.rows, F = p.F;
  if (rows == 0) return p.out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(),
                                  "headscope_linear_attribution_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* ws = p.scaled_weight.const_data_ptr<acc_t>();
    const acc_t* mu = p.mean.const_data_ptr<acc_t>();
    const scalar_t* fp = p.features.const_data_ptr<scalar_t>();
    scalar_t* op = p.out.mutable_data_ptr<scalar_t>();
    const acc_t b0 = static_cast<acc_t>(bias);
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* x = fp + r * F;
        acc_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t j = 0;
        for (; j + 8 <= F; j += 8)
          for (int u = 0; u < 8; ++u)
            s[u] += (static_cast<acc_t>(x[j + u]) - mu[j + u]) * ws[j + u];
        for (; j < F; ++j) s[0] += (static_cast<acc_t>(x[j]) - mu[j]) * ws[j];
        acc_t total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        op[r] = static_cast<scalar_t>(total + b0);
      }
    });
  });
  return p.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("linear_attribution", &linear_attribution_cpu);
}

}  // namespace headscope::attribution::cpu
