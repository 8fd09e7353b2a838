#include "mixer/mixer_checks.h"

#include "common/checks.h"

#include <cmath>

namespace headscope::mixer {

namespace {
void check_factor_pair(const char* op, const char* name_a, const at::Tensor& a,
                       const char* name_b, const at::Tensor& b) {
  check_min_dim(op, name_a, a, 2);
  check_min_dim(op, name_b, b, 2);
  check_dtype_in(op, name_a, a, {at::kFloat, at::kDouble});
  HEADSCOPE_CHECK_ARG(b.scalar_type() == a.scalar_type(), op, name_b, "must have the dtype of '",
                      name_a, "' (", c10::toString(a.scalar_type()), "), got ", describe(b));
  check_same_device(op, name_a, a, name_b, b);
  HEADSCOPE_CHECK_ARG(b.dim() == a.dim(), op, name_b, "must have as many dimensions as '",
                      name_a, "' (", a.dim(), "), got ", describe(b));
  check_same_batch(op, name_a, a, name_b, b, 2);
  HEADSCOPE_CHECK_ARG(a.sym_size(-1) >= 1, op, name_a,
                      "must have at least one column (rank r >= 1), got ", describe(a));
  check_same_size(op, name_a, a, -1, name_b, b, -1);
}
}  // namespace

void check_kl_project_args(const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol,
                           int64_t max_iter) {
  constexpr const char* op = "headscope::kl_project";
  check_factor_pair(op, "log_u_ref", log_u_ref, "log_v_ref", log_v_ref);
  // W = U diag(1/g) V^T has unit row and column sums only when it is square.
  HEADSCOPE_CHECK_ARG(log_v_ref.sym_size(-2) == log_u_ref.sym_size(-2), op, "log_v_ref",
                      "must have as many rows as 'log_u_ref' (", log_u_ref.sym_size(-2),
                      "): a doubly-stochastic W = U diag(1/g) V^T needs n == m; got ",
                      describe(log_v_ref));
  TORCH_CHECK(std::isfinite(tol) && tol >= 0, op, ": argument 'tol' must be finite and >= 0, got ",
              tol);
  TORCH_CHECK(max_iter >= 0, op, ": argument 'max_iter' must be >= 0, got ", max_iter);
}

void check_thin_mix_args(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X) {
  constexpr const char* op = "headscope::thin_mix";
  check_factor_pair(op, "U", U, "V", V);
  check_min_dim(op, "X", X, 2);
  check_same_device(op, "U", U, "X", X);
  HEADSCOPE_CHECK_ARG(X.dim() == U.dim(), op, "X", "must have as many dimensions as 'U' (",
                      U.dim(), "), got ", describe(X));
  check_same_batch(op, "U", U, "X", X, 2);
  check_same_size(op, "V", V, -2, "X", X, -2);
  if (U.scalar_type() == at::kDouble) {
    check_dtype_in(op, "X", X, {at::kDouble});
  } else {
    check_dtype_in(op, "X", X, {at::kFloat, at::kHalf, at::kBFloat16});
  }
}

void check_kl_hvp_args(const at::Tensor& U, const at::Tensor& V, const at::Tensor& s) {
  constexpr const char* op = "headscope::kl_hvp";
  check_factor_pair(op, "U", U, "V", V);
  check_min_dim(op, "s", s, 1);
  HEADSCOPE_CHECK_ARG(s.scalar_type() == U.scalar_type(), op, "s", "must have the dtype of 'U' (",
                      c10::toString(U.scalar_type()), "), got ", describe(s));
  check_same_device(op, "U", U, "s", s);
  HEADSCOPE_CHECK_ARG(s.dim() == U.dim() - 1, op, "s", "must have shape (..., r) with the batch "
                      "dimensions of 'U' (", U.dim() - 1, " dimensions), got ", describe(s));
  check_same_batch(op, "U", U, 2, "s", s, 1);
  check_same_size(op, "U", U, -1, "s", s, -1);
}

}  // namespace headscope::mixer
