// CPU kernel of headscope::kl_project: the Newton solver of the reference implementation
// (kl_projection_reference.py, docs/mixer.md), one problem per task of at::parallel_for,
// everything in double whatever the input dtype.
#include "common/cpu_math.h"
#include "common/kernel.h"
#include "mixer/kl_newton.h"
#include "mixer/kl_project_setup.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace headscope::mixer::cpu {
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

// One log-reference matrix L (n x r) and the rows of P = softmax_rows(L + sign * z).
//
// softmax(L + sign z)_ij = exp(L_ij - rowmax_i - c_j) exp(c_j + sign z_j - M) / row sum, with
// c_j the column max of the row-centred L. The first factor, E, does not depend on z: computed
// once, it turns each Newton evaluation into n*r multiplications instead of n*r exponentials.
// When a factor could underflow (extreme inputs or z), evaluation falls back to the
// reference implementation's direct form, exp(L_ij + sign z_j - max_j(...)).
template <typename scalar_t>
class SoftmaxRows {
 public:
  SoftmaxRows(const scalar_t* L, int64_t n, int r, int sign, double* E)
      : L_(L), n_(n), r_(r), sign_(sign), E_(E), c_(r), s_(r), rowmax_(n) {
    std::fill(c_.begin(), c_.end(), -std::numeric_limits<double>::infinity());
    // E first holds the row-centred L, then its exponential.
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* li = L + i * r;
      double* ei = E + i * r;
      double rowmax = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < r; ++j) rowmax = std::max(rowmax, static_cast<double>(li[j]));
      rowmax_[i] = rowmax;
      for (int j = 0; j < r; ++j) {
        ei[j] = static_cast<double>(li[j]) - rowmax;
        c_[j] = std::max(c_[j], ei[j]);
      }
    }
    // The range check and the exponentials are separate loops: a min-reduction (or any
    // branch) in the loop would keep the compiler from vectorising exp_nonpositive. When
    // the range is too wide the fast form is not used and E is never read.
    double lowest = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < r; ++j) lowest = std::min(lowest, E[i * r + j] - c_[j]);
    for (int64_t i = 0; i < n; ++i) {
      double* ei = E + i * r;
      for (int j = 0; j < r; ++j) ei[j] = exp_nonpositive(ei[j] - c_[j]);
    }
    fast_ok_ = n > 0 && lowest >= -kFastRange;  // NaN inputs reach the residual either way
  }

  // Writes the rows of P to rows (n x r) and adds its column sums to colsum; returns
  // {sum_i LSE_i, sum_i |LSE_i|} of the rows of L + sign z (the dual objective's terms).
  std::pair<double, double> evaluate(const double* z, double* rows, double* colsum) {
    double dual = 0, scale = 0;
    double hi = -std::numeric_limits<double>::infinity(), lo = -hi;
    for (int j = 0; j < r_; ++j) {
      s_[j] = c_[j] + sign_ * z[j];
      hi = std::max(hi, s_[j]);
      lo = std::min(lo, s_[j]);
    }
    const bool fast = fast_ok_ && hi - lo <= kFastRange;
    if (fast)
      for (int j = 0; j < r_; ++j) s_[j] = exp_nonpositive(s_[j] - hi);
    for (int64_t i = 0; i < n_; ++i) {
      double* u = rows + i * r_;
      double shift;  // LSE_i = shift + log(total)
      if (fast) {
        shift = rowmax_[i] + hi;
        const double* ei = E_ + i * r_;
        for (int j = 0; j < r_; ++j) u[j] = ei[j] * s_[j];
      } else {
        const scalar_t* li = L_ + i * r_;
        double m = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < r_; ++j) m = std::max(m, li[j] + sign_ * z[j]);
        shift = m;
        for (int j = 0; j < r_; ++j) u[j] = std::exp(li[j] + sign_ * z[j] - m);
      }
      double total = 0;
      for (int j = 0; j < r_; ++j) total += u[j];
      const double inv = 1.0 / total;
      for (int j = 0; j < r_; ++j) {
        u[j] *= inv;
        colsum[j] += u[j];
      }
      const double lse = shift + std::log(total);
      dual += lse;
      scale += std::fabs(lse);
    }
    return {dual, scale};
  }

 private:
  const scalar_t* L_;
  int64_t n_;
  int r_;
  int sign_;
  double* E_;
  std::vector<double> c_, s_, rowmax_;
  bool fast_ok_ = false;
};

// G = P^T P for the rows of P (count x r), four rows at a time so that each
// load and store of G carries four multiply-adds.
void gram(const double* __restrict__ P, int64_t count, int r, double* __restrict__ G) {
  std::fill(G, G + r * r, 0.0);
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    const double *p0 = P + i * r, *p1 = p0 + r, *p2 = p1 + r, *p3 = p2 + r;
    for (int j = 0; j < r; ++j) {
      const double a0 = p0[j], a1 = p1[j], a2 = p2[j], a3 = p3[j];
      double* gj = G + j * r;
      for (int k = 0; k < r; ++k) gj[k] += a0 * p0[k] + a1 * p1[k] + a2 * p2[k] + a3 * p3[k];
    }
  }
  for (; i < count; ++i) {
    const double* p0 = P + i * r;
    for (int j = 0; j < r; ++j)
      for (int k = 0; k < r; ++k) G[j * r + k] += p0[j] * p0[k];
  }
}

// Column sums of U and V at one z.
struct State {
  std::vector<double> cu, cv;
  double grad_sq = 0;
  double dual = 0, dual_scale = 0;  // the dual objective and its rounding scale
  explicit State(int r) : cu(r), cv(r) {}
};

struct Solution {
  int64_t iters;
  double residual;
};

// scratch: 4 n r doubles, E of both factors, then the rows [U; V] (2n x r) of the last
// evaluation. Only the current state's Hessian needs rows, and it is formed right after the
// evaluation that accepted the state, so one rows buffer serves the state and the trials.
template <typename scalar_t>
Solution solve_one(const scalar_t* a, const scalar_t* b, int64_t n, int r, double tol,
                   int64_t max_iter, double* scratch, scalar_t* U, scalar_t* V, scalar_t* z_out) {
  SoftmaxRows<scalar_t> pu(a, n, r, +1, scratch);
  SoftmaxRows<scalar_t> pv(b, n, r, -1, scratch + n * r);
  double* rows = scratch + 2 * n * r;

  auto evaluate = [&](const std::vector<double>& z, State& s) {
    std::fill(s.cu.begin(), s.cu.end(), 0.0);
    std::fill(s.cv.begin(), s.cv.end(), 0.0);
    const auto [du, su] = pu.evaluate(z.data(), rows, s.cu.data());
    const auto [dv, sv] = pv.evaluate(z.data(), rows + n * r, s.cv.data());
    s.dual = du + dv;
    s.dual_scale = su + sv;
    s.grad_sq = 0;
    for (int j = 0; j < r; ++j) s.grad_sq += (s.cu[j] - s.cv[j]) * (s.cu[j] - s.cv[j]);
  };

  std::vector<double> z(r, 0.0), zn(r), grad(r), H(r * r), step(std::max(r - 1, 1)),
      work(r * r + r);
  State state(r), trial(r);
  evaluate(z, state);
  bool rows_at_z = true;
  int64_t it = 0;
  for (; it < max_iter; ++it) {
    if (max_abs_diff(state.cu.data(), state.cv.data(), r) < tol) break;
    // H = diag(cu + cv) - [U; V]^T [U; V]
    gram(rows, 2 * n, r, H.data());
    for (int j = 0; j < r; ++j) {
      grad[j] = state.cu[j] - state.cv[j];
      for (int k = 0; k < r; ++k)
        H[j * r + k] = (j == k ? state.cu[j] + state.cv[j] : 0.0) - H[j * r + k];
    }
    if (!solve_reduced_newton(H.data(), grad.data(), r, work.data(), step.data())) break;
    bool accepted = false;
    for (double alpha = 1.0; alpha > kMinStep; alpha *= 0.5) {
      for (int j = 0; j + 1 < r; ++j) zn[j] = z[j] + alpha * step[j];
      zn[r - 1] = 0;
      evaluate(zn, trial);
      if (accept_step(trial.grad_sq, state.grad_sq, alpha, trial.dual, state.dual,
                      state.dual_scale)) {
        std::swap(z, zn);
        std::swap(state, trial);
        accepted = true;
        break;
      }
    }
    rows_at_z = accepted;
    if (!accepted) break;
  }
  // The reference implementation reports it + 1 (the number of states it examined),
  // capped at max_iter.
  const int64_t iters = std::min(it + 1, max_iter);

  if (!rows_at_z) evaluate(z, state);  // the line search stalled: rows hold a rejected trial
  for (int64_t e = 0; e < n * r; ++e) {
    U[e] = static_cast<scalar_t>(rows[e]);
    V[e] = static_cast<scalar_t>(rows[n * r + e]);
  }
  for (int j = 0; j < r; ++j) z_out[j] = static_cast<scalar_t>(z[j]);
  return {iters, max_abs_diff(state.cu.data(), state.cv.data(), r)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project_cpu(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
  auto p = prepare_projection(log_u_ref, log_v_ref, tol, max_iter, 4096,
                              "the dense r x r Newton system");
  const int64_t n = p.n;
  const int r = p.r;
  const auto a = log_u_ref.contiguous();
  const auto b = log_v_ref.contiguous();
  AT_DISPATCH_FLOATING_TYPES(p.U.scalar_type(), "kl_project_cpu", [&] {
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pb = b.const_data_ptr<scalar_t>();
    scalar_t* pU = p.U.mutable_data_ptr<scalar_t>();
    scalar_t* pV = p.V.mutable_data_ptr<scalar_t>();
    scalar_t* pz = p.z.mutable_data_ptr<scalar_t>();
    int64_t* pit = p.iters.mutable_data_ptr<int64_t>();
    double* pres = p.residual.mutable_data_ptr<double>();
    at::parallel_for(0, p.problems, 1, [&](int64_t begin, int64_t end) {
      // One scratch per task, reused by its problems: O(threads * n * r), not O(batch * n * r).
      auto scratch = at::empty({4, n, r}, at::TensorOptions().dtype(at::kDouble));
      for (int64_t i = begin; i < end; ++i) {
        const int64_t off = i * n * r;
        const auto sol = solve_one(pa + off, pb + off, n, r, tol, max_iter,
                                   scratch.mutable_data_ptr<double>(), pU + off, pV + off,
                                   pz + i * r);
        pit[i] = sol.iters;
        pres[i] = sol.residual;
      }
    });
  });
  return p.outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("kl_project", HEADSCOPE_KERNEL("kl_project", kl_project_cpu));
}

}  // namespace headscope::mixer::cpu
