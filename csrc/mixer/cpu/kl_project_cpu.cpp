// CPU kernel of headscope::kl_project: the seed's Newton solver, one problem per
// task of at::parallel_for, everything in double whatever the input dtype.
#include "mixer/kl_newton.h"
#include "mixer/mixer_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace headscope::mixer {
namespace {

// The product form below is exact to rounding while every factor stays above e^-kFastRange.
constexpr double kFastRange = 200.0;

double max_abs_diff(const double* a, const double* b, int r) {  // NaN-propagating
  double m = 0;
  for (int j = 0; j < r; ++j) {
    const double v = std::fabs(a[j] - b[j]);
    if (!(v <= m)) m = v;
  }
  return m;
}

// One log-reference matrix L (n x r) and the statistics of P = softmax_rows(L + sign * z).
//
// softmax(L + sign z)_ij = exp(L_ij - rowmax_i - c_j) exp(c_j + sign z_j - M) / row sum, with
// c_j the column max of the row-centred L. The first factor, E, does not depend on z: computed
// once, it turns each Newton evaluation into n*r multiplications instead of n*r exponentials.
// When either factor could underflow (extreme inputs or z), evaluation falls back to the
// seed's direct form, exp(L_ij + sign z_j - max_j(...)).
class SoftmaxRows {
 public:
  SoftmaxRows(const double* L, int64_t n, int r, int sign, double* E)
      : L_(L), n_(n), r_(r), sign_(sign), E_(E), c_(r, 0.0), row_(r), s_(r) {
    std::vector<double> rowmax(n);
    std::fill(c_.begin(), c_.end(), -std::numeric_limits<double>::infinity());
    for (int64_t i = 0; i < n; ++i) {
      const double* li = L + i * r;
      rowmax[i] = *std::max_element(li, li + r);
      for (int j = 0; j < r; ++j) c_[j] = std::max(c_[j], li[j] - rowmax[i]);
    }
    double lowest = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < r; ++j) {
        const double e = L[i * r + j] - rowmax[i] - c_[j];
        lowest = std::min(lowest, e);
        E_[i * r + j] = std::exp(e);
      }
    fast_ok_ = n > 0 && lowest >= -kFastRange;  // false for NaN as well
  }

  // Adds the column sums of P to colsum and, when gram != nullptr, the lower triangle of
  // P^T P to gram (r x r, row-major).
  void accumulate(const double* z, double* colsum, double* gram) {
    double hi = -std::numeric_limits<double>::infinity(), lo = -hi;
    for (int j = 0; j < r_; ++j) {
      s_[j] = c_[j] + sign_ * z[j];
      hi = std::max(hi, s_[j]);
      lo = std::min(lo, s_[j]);
    }
    const bool fast = fast_ok_ && hi - lo <= kFastRange;
    if (fast)
      for (int j = 0; j < r_; ++j) s_[j] = std::exp(s_[j] - hi);
    double* u = row_.data();
    for (int64_t i = 0; i < n_; ++i) {
      if (fast) {
        const double* ei = E_ + i * r_;
        for (int j = 0; j < r_; ++j) u[j] = ei[j] * s_[j];
      } else {
        row_exp(i, z, u);
      }
      normalise_and_add(u, colsum, gram);
    }
  }

  // Writes P (direct form, as the seed computes it) to out and adds its column sums.
  template <typename scalar_t>
  void write(const double* z, scalar_t* out, double* colsum) {
    double* u = row_.data();
    for (int64_t i = 0; i < n_; ++i) {
      row_exp(i, z, u);
      normalise_and_add(u, colsum, nullptr);
      for (int j = 0; j < r_; ++j) out[i * r_ + j] = static_cast<scalar_t>(u[j]);
    }
  }

 private:
  void row_exp(int64_t i, const double* z, double* u) const {
    const double* li = L_ + i * r_;
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < r_; ++j) {
      u[j] = li[j] + sign_ * z[j];
      m = std::max(m, u[j]);
    }
    for (int j = 0; j < r_; ++j) u[j] = std::exp(u[j] - m);
  }

  void normalise_and_add(double* u, double* colsum, double* gram) const {
    double total = 0;
    for (int j = 0; j < r_; ++j) total += u[j];
    const double inv = 1.0 / total;
    for (int j = 0; j < r_; ++j) {
      u[j] *= inv;
      colsum[j] += u[j];
    }
    if (gram)
      for (int j = 0; j < r_; ++j) {
        double* gj = gram + j * r_;
        for (int k = 0; k <= j; ++k) gj[k] += u[j] * u[k];
      }
  }

  const double* L_;
  int64_t n_;
  int r_;
  int sign_;
  double* E_;
  std::vector<double> c_, row_, s_;
  bool fast_ok_ = false;
};

// Column sums and Gram matrices of U and V at one z.
struct State {
  std::vector<double> cu, cv, gram;  // gram = U^T U + V^T V (lower triangle)
  double grad_sq = 0;
  explicit State(int r) : cu(r), cv(r), gram(r * r) {}
};

struct Solution {
  int64_t iters;
  double residual;
};

template <typename scalar_t>
Solution solve_one(const double* a, const double* b, int64_t n, int r, double tol,
                   int64_t max_iter, double* scratch, scalar_t* U, scalar_t* V, scalar_t* z_out) {
  SoftmaxRows pu(a, n, r, +1, scratch);
  SoftmaxRows pv(b, n, r, -1, scratch + n * r);

  auto evaluate = [&](const std::vector<double>& z, State& s) {
    std::fill(s.cu.begin(), s.cu.end(), 0.0);
    std::fill(s.cv.begin(), s.cv.end(), 0.0);
    std::fill(s.gram.begin(), s.gram.end(), 0.0);
    pu.accumulate(z.data(), s.cu.data(), s.gram.data());
    pv.accumulate(z.data(), s.cv.data(), s.gram.data());
    s.grad_sq = 0;
    for (int j = 0; j < r; ++j) s.grad_sq += (s.cu[j] - s.cv[j]) * (s.cu[j] - s.cv[j]);
  };

  std::vector<double> z(r, 0.0), zn(r), grad(r), H(r * r), step(std::max(r - 1, 1)),
      work(r * r + r);
  State state(r), trial(r);
  evaluate(z, state);
  int64_t it = 0;
  for (; it < max_iter; ++it) {
    if (max_abs_diff(state.cu.data(), state.cv.data(), r) < tol) break;
    for (int j = 0; j < r; ++j) {
      grad[j] = state.cu[j] - state.cv[j];
      for (int k = 0; k <= j; ++k) {
        const double h = (j == k ? state.cu[j] + state.cv[j] : 0.0) - state.gram[j * r + k];
        H[j * r + k] = H[k * r + j] = h;
      }
    }
    if (!solve_reduced_newton(H.data(), grad.data(), r, work.data(), step.data())) break;
    bool accepted = false;
    for (double alpha = 1.0; alpha > kMinStep; alpha *= 0.5) {
      for (int j = 0; j + 1 < r; ++j) zn[j] = z[j] + alpha * step[j];
      zn[r - 1] = 0;
      evaluate(zn, trial);
      if (trial.grad_sq < state.grad_sq * (1 - kArmijo * alpha)) {
        std::swap(z, zn);
        std::swap(state, trial);
        accepted = true;
        break;
      }
    }
    if (!accepted) break;
  }
  // The seed reports it + 1 (the number of states it examined), capped at max_iter.
  const int64_t iters = std::min(it + 1, max_iter);

  std::vector<double> cu(r, 0.0), cv(r, 0.0);
  pu.write(z.data(), U, cu.data());
  pv.write(z.data(), V, cv.data());
  for (int j = 0; j < r; ++j) z_out[j] = static_cast<scalar_t>(z[j]);
  return {iters, max_abs_diff(cu.data(), cv.data(), r)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project_cpu(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
  check_kl_project_args(log_u_ref, log_v_ref, tol, max_iter);
  const auto sizes = log_u_ref.sizes();
  const int64_t n = sizes[sizes.size() - 2];
  const int64_t r64 = sizes.back();
  TORCH_CHECK(r64 <= 4096, "headscope::kl_project: argument 'log_u_ref' has rank r = ", r64,
              "; the dense r x r Newton system supports r <= 4096");
  const int r = static_cast<int>(r64);
  const auto batch = sizes.slice(0, sizes.size() - 2);
  const int64_t problems = c10::multiply_integers(batch);

  const auto a = log_u_ref.to(at::kDouble).contiguous();
  const auto b = log_v_ref.to(at::kDouble).contiguous();
  auto U = at::empty(sizes, log_u_ref.options());
  auto V = at::empty(sizes, log_u_ref.options());
  auto batch_r = batch.vec();
  batch_r.push_back(r);
  auto z = at::empty(batch_r, log_u_ref.options());
  auto iters = at::empty(batch, log_u_ref.options().dtype(at::kLong));
  auto residual = at::empty(batch, log_u_ref.options().dtype(at::kDouble));
  auto scratch = at::empty({problems, 2, n, r}, a.options());

  AT_DISPATCH_FLOATING_TYPES(log_u_ref.scalar_type(), "kl_project_cpu", [&] {
    const double* pa = a.const_data_ptr<double>();
    const double* pb = b.const_data_ptr<double>();
    scalar_t* pU = U.mutable_data_ptr<scalar_t>();
    scalar_t* pV = V.mutable_data_ptr<scalar_t>();
    scalar_t* pz = z.mutable_data_ptr<scalar_t>();
    int64_t* pit = iters.mutable_data_ptr<int64_t>();
    double* pres = residual.mutable_data_ptr<double>();
    double* pscratch = scratch.mutable_data_ptr<double>();
    at::parallel_for(0, problems, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t off = p * n * r;
        const auto sol = solve_one(pa + off, pb + off, n, r, tol, max_iter,
                                   pscratch + 2 * off, pU + off, pV + off, pz + p * r);
        pit[p] = sol.iters;
        pres[p] = sol.residual;
      }
    });
  });
  return {U, V, z, iters, residual};
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) { m.impl("kl_project", &kl_project_cpu); }

}  // namespace headscope::mixer
