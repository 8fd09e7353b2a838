// CPU kernel of headscope::thin_mix: Y = U ((V^T X) / g), g = colsum(U), in
// O((n + m) r d) without forming the n x m mixing matrix.
#include "mixer/mixer_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

namespace headscope::mixer {
namespace {

constexpr int64_t kRowsPerTask = 256;

template <typename scalar_t, typename acc_t>
void thin_mix_kernel(const acc_t* U, const acc_t* V, const scalar_t* X, scalar_t* Y,
                     int64_t problems, int64_t n, int64_t m, int64_t r, int64_t d,
                     acc_t* partial /* problems x m_tasks x r x d */, acc_t* mix /* problems x r x d */) {
  const int64_t m_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t n_tasks = (n + kRowsPerTask - 1) / kRowsPerTask;

  // 1. partial[p][t] = V[rows of task t]^T X[rows of task t]
  at::parallel_for(0, problems * m_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> x(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task / m_tasks, t = task % m_tasks;
      acc_t* out = partial + task * r * d;
      std::fill(out, out + r * d, acc_t(0));
      const int64_t j1 = std::min(m, (t + 1) * kRowsPerTask);
      for (int64_t j = t * kRowsPerTask; j < j1; ++j) {
        const scalar_t* xj = X + (p * m + j) * d;
        for (int64_t c = 0; c < d; ++c) x[c] = static_cast<acc_t>(xj[c]);
        const acc_t* vj = V + (p * m + j) * r;
        for (int64_t k = 0; k < r; ++k) {
          const acc_t v = vj[k];
          acc_t* ok = out + k * d;
          for (int64_t c = 0; c < d; ++c) ok[c] += v * x[c];
        }
      }
    }
  });

  // 2. mix[p] = (sum over tasks of partial[p]) / g[p]
  at::parallel_for(0, problems, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> g(r);
    for (int64_t p = begin; p < end; ++p) {
      std::fill(g.begin(), g.end(), acc_t(0));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < r; ++k) g[k] += U[(p * n + i) * r + k];
      acc_t* out = mix + p * r * d;
      std::fill(out, out + r * d, acc_t(0));
      for (int64_t t = 0; t < m_tasks; ++t) {
        const acc_t* in = partial + (p * m_tasks + t) * r * d;
        for (int64_t e = 0; e < r * d; ++e) out[e] += in[e];
      }
      for (int64_t k = 0; k < r; ++k)
        for (int64_t c = 0; c < d; ++c) out[k * d + c] /= g[k];
    }
  });

  // 3. Y[rows] = U[rows] mix[p]
  at::parallel_for(0, problems * n_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> y(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task / n_tasks, t = task % n_tasks;
      const acc_t* mp = mix + p * r * d;
      const int64_t i1 = std::min(n, (t + 1) * kRowsPerTask);
      for (int64_t i = t * kRowsPerTask; i < i1; ++i) {
        std::fill(y.begin(), y.end(), acc_t(0));
        const acc_t* ui = U + (p * n + i) * r;
        for (int64_t k = 0; k < r; ++k) {
          const acc_t u = ui[k];
          const acc_t* mk = mp + k * d;
          for (int64_t c = 0; c < d; ++c) y[c] += u * mk[c];
        }
        scalar_t* yi = Y + (p * n + i) * d;
        for (int64_t c = 0; c < d; ++c) yi[c] = static_cast<scalar_t>(y[c]);
      }
    }
  });
}

at::Tensor thin_mix_cpu(const at::Tensor& U_in, const at::Tensor& V_in, const at::Tensor& X_in) {
  check_thin_mix_args(U_in, V_in, X_in);
  const auto U = U_in.contiguous();
  const auto V = V_in.contiguous();
  const auto X = X_in.contiguous();
  const int64_t n = U.size(-2), r = U.size(-1), m = V.size(-2), d = X.size(-1);
  auto out_sizes = U.sizes().vec();
  out_sizes.back() = d;
  auto Y = at::empty(out_sizes, X.options());
  const int64_t problems = n == 0 ? 0 : U.numel() / (n * r);
  if (Y.numel() == 0) return Y;

  const int64_t m_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  auto partial = at::empty({problems, m_tasks, r, d}, U.options());
  auto mix = at::empty({problems, r, d}, U.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, X.scalar_type(), "thin_mix_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;  // U's dtype, checked above
    thin_mix_kernel<scalar_t, acc_t>(U.const_data_ptr<acc_t>(), V.const_data_ptr<acc_t>(),
                                     X.const_data_ptr<scalar_t>(), Y.mutable_data_ptr<scalar_t>(),
                                     problems, n, m, r, d, partial.mutable_data_ptr<acc_t>(),
                                     mix.mutable_data_ptr<acc_t>());
  });
  return Y;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) { m.impl("thin_mix", &thin_mix_cpu); }

}  // namespace headscope::mixer
