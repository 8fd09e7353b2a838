// CPU kernel of headscope::vas_aggregate: (B, L, H, 3) head statistics to the 36
// features, one batch row per task.
#include "common/kernel.h"
#include "vas/vas_checks.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace headscope::vas::cpu {
namespace {

at::Tensor vas_aggregate_cpu(const at::Tensor& head_stats) {
  check_aggregate_args(head_stats);
  const auto st = head_stats.to(at::kDouble).contiguous();
  const int64_t B = st.size(0), L = st.size(1), H = st.size(2);
  at::Tensor out = at::empty({B, 36}, head_stats.options().dtype(at::kFloat));
  const double* x = st.data_ptr<double>();
  float* o = out.data_ptr<float>();
  // NaN-propagating max / min (NumPy's max and min return NaN when any entry is NaN)
  auto mx = [](double a, double v) { return std::isnan(a) ? a : (std::isnan(v) || v > a ? v : a); };
  auto mn = [](double a, double v) { return std::isnan(a) ? a : (std::isnan(v) || v < a ? v : a); };
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> lay(L * 4);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t qi = 0; qi < 3; ++qi) {
        for (int64_t l = 0; l < L; ++l) {
          const double* v = x + ((b * L + l) * H) * 3 + qi;
          double sum = 0, hi = v[0], lo = v[0];
          for (int64_t h = 0; h < H; ++h) {
            sum += v[h * 3];
            hi = mx(hi, v[h * 3]);
            lo = mn(lo, v[h * 3]);
          }
          const double mean = sum / static_cast<double>(H);
          double var = 0;
          for (int64_t h = 0; h < H; ++h) var += (v[h * 3] - mean) * (v[h * 3] - mean);
          // the reference stores the per-layer stats as float32
          lay[l * 4 + 0] = static_cast<float>(mean);
          lay[l * 4 + 1] = static_cast<float>(std::sqrt(var / static_cast<double>(H)));
          lay[l * 4 + 2] = static_cast<float>(hi);
          lay[l * 4 + 3] = static_cast<float>(lo);
        }
        for (int64_t a = 0; a < 4; ++a) {
          double sum = 0, hi = lay[a];
          for (int64_t l = 0; l < L; ++l) {
            sum += lay[l * 4 + a];
            hi = mx(hi, lay[l * 4 + a]);
          }
          const double mean = sum / static_cast<double>(L);
          double var = 0;
          for (int64_t l = 0; l < L; ++l) var += (lay[l * 4 + a] - mean) * (lay[l * 4 + a] - mean);
          float* ob = o + b * 36 + qi * 12 + a * 3;
          ob[0] = static_cast<float>(mean);
          ob[1] = static_cast<float>(std::sqrt(var / static_cast<double>(L)));
          ob[2] = static_cast<float>(hi);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("vas_aggregate", HEADSCOPE_KERNEL("vas_aggregate", vas_aggregate_cpu));
}

}  // namespace headscope::vas::cpu
