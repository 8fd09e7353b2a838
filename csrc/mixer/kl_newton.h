// Pieces of the Newton solver for the joint KL projection that the CPU and CUDA kernels
// share, as the reference implementation (kl_projection_reference.py, docs/mixer.md) has
// them: constants of the line search and the reduced r-1 solve.
//
// The dual variable z (length r, gauge z[r-1] = 0) gives
//   U = softmax_rows(log_u_ref + z),  V = softmax_rows(log_v_ref - z),
//   grad = colsum(U) - colsum(V),  H = diag(cu) - U^T U + diag(cv) - V^T V.
#pragma once

#include "common/host_device.h"

#include <cmath>

namespace headscope::mixer {

// Backtracking: accept when |g_new|^2 < |g|^2 (1 - kArmijo * alpha); halve alpha
// until it falls to kMinStep (the reference implementation's constants).
constexpr double kArmijo = 1e-4;
constexpr double kMinStep = 1e-10;
// The dual objective f(z) = sum_i LSE(log_u_i + z) + sum_i LSE(log_v_i - z) is convex with
// gradient colsum(U) - colsum(V). The reference's rule alone can accept a step that raises
// f into a region where softmax rows saturate and the dual is flat, where the next Newton
// steps are astronomically long and the line search stalls: a step is also refused when it
// raises f by more than rounding (kDualSlack relative to sum_i |LSE_i|, far below the rise
// of such a step).
constexpr double kDualSlack = 1e-8;

HEADSCOPE_HD inline bool accept_step(double grad_sq_trial, double grad_sq, double alpha,
                                     double dual_trial, double dual, double dual_scale) {
  return grad_sq_trial < grad_sq * (1 - kArmijo * alpha) &&
         dual_trial <= dual + kDualSlack * dual_scale;
}

// Added to the diagonal when the reduced Hessian is numerically singular (the reference
// implementation falls back to lstsq(Hr + 1e-10 I) there).
constexpr double kSingularShift = 1e-10;

// Solves Hr step = -grad[0:k] for k = r - 1, where Hr is the leading k x k block of
// the r x r row-major H. Gaussian elimination with partial pivoting on the work
// array `a` (k * (k + 1) doubles, the augmented system). Returns false when a pivot
// vanishes even after the diagonal shift (then step is left untouched).
HEADSCOPE_HD inline bool solve_reduced_newton(const double* H, const double* grad, int r,
                                              double* a, double* step) {
  const int k = r - 1;
  const int w = k + 1;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const double shift = attempt == 0 ? 0.0 : kSingularShift;
    for (int i = 0; i < k; ++i) {
      for (int j = 0; j < k; ++j) a[i * w + j] = H[i * r + j] + (i == j ? shift : 0.0);
      a[i * w + k] = -grad[i];
    }
    bool ok = true;
    for (int c = 0; c < k && ok; ++c) {
      int piv = c;
      for (int i = c + 1; i < k; ++i)
        if (fabs(a[i * w + c]) > fabs(a[piv * w + c])) piv = i;
      const double pivot = a[piv * w + c];
      if (!(fabs(pivot) > 1e-300)) {  // zero or NaN
        ok = false;
        break;
      }
      if (piv != c)
        for (int j = c; j < w; ++j) {
          const double t = a[c * w + j];
          a[c * w + j] = a[piv * w + j];
          a[piv * w + j] = t;
        }
      for (int i = c + 1; i < k; ++i) {
        const double f = a[i * w + c] / pivot;
        for (int j = c; j < w; ++j) a[i * w + j] -= f * a[c * w + j];
      }
    }
    if (!ok) continue;
    for (int i = k - 1; i >= 0; --i) {
      double s = a[i * w + k];
      for (int j = i + 1; j < k; ++j) s -= a[i * w + j] * step[j];
      step[i] = s / a[i * w + i];
    }
    return true;
  }
  return false;
}

}  // namespace headscope::mixer
