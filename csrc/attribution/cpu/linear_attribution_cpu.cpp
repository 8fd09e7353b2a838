// CPU kernel of linear_attribution: ((features - mean) / std) . weight + bias, one pass over
// each row of features with the (features - mean) never stored, rows in parallel. The ATen
// composite (composite/linear_attribution_composite.cpp) serves the other backends; this
// kernel gives the same values (weight / std rounded once to the accumulation dtype, the
// same NaN policy), summed in a fixed order per row, so the bits do not depend on threads.
#include "attribution/attribution_checks.h"
#include "common/kernel.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace headscope::attribution::cpu {
namespace {

at::Tensor linear_attribution_cpu(const at::Tensor& features, const at::Tensor& weight,
                                  const at::Tensor& mean, const at::Tensor& std,
                                  const std::optional<at::Tensor>& bias) {
  check_linear_attribution_args(features, weight, mean, std, bias);
  auto out_sizes = features.sizes().vec();
  const int64_t F = out_sizes.back();
  out_sizes.pop_back();
  auto out = at::empty(out_sizes, features.options());
  const int64_t rows = out.numel();
  if (rows == 0) return out;
  const auto rows_f = features.contiguous();
  // The parameters in double: weight / std divided there and rounded once to the
  // accumulation dtype is what the composite computes (a float32 quotient is the rounded
  // double one), and every float dtype converts to double exactly.
  const auto w = weight.to(at::kDouble).contiguous(), sd = std.to(at::kDouble).contiguous(),
             mu = mean.to(at::kDouble).contiguous();
  const double b = bias.has_value() && bias->defined() ? bias->item<double>() : 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(),
                                  "headscope_linear_attribution_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> scaled_weight(F), centre(F);
    const double *wp = w.const_data_ptr<double>(), *sp = sd.const_data_ptr<double>(),
                 *mp = mu.const_data_ptr<double>();
    for (int64_t j = 0; j < F; ++j) {
      // a std that is not finite and positive makes every score NaN
      scaled_weight[j] = sp[j] > 0 && std::isfinite(sp[j])
                             ? static_cast<acc_t>(wp[j] / sp[j])
                             : std::numeric_limits<acc_t>::quiet_NaN();
      centre[j] = static_cast<acc_t>(mp[j]);
    }
    const acc_t* ws = scaled_weight.data();
    const acc_t* mc = centre.data();
    const scalar_t* fp = rows_f.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const acc_t b0 = static_cast<acc_t>(b);
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* x = fp + r * F;
        // eight independent partial sums: the compiler keeps them in vector registers
        acc_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t j = 0;
        for (; j + 8 <= F; j += 8)
          for (int u = 0; u < 8; ++u)
            s[u] += (static_cast<acc_t>(x[j + u]) - mc[j + u]) * ws[j + u];
        for (; j < F; ++j) s[0] += (static_cast<acc_t>(x[j]) - mc[j]) * ws[j];
        const acc_t total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        op[r] = static_cast<scalar_t>(total + b0);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("linear_attribution", HEADSCOPE_KERNEL("linear_attribution", linear_attribution_cpu));
}

}  // namespace headscope::attribution::cpu
