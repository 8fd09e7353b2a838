#include "mixer/kl_project_setup.h"

#include "mixer/mixer_checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/accumulate.h>

namespace headscope::mixer {

Projection prepare_projection(const at::Tensor& log_u_ref, const at::Tensor& log_v_ref,
                              double tol, int64_t max_iter, int64_t max_rank, const char* hint) {
  check_kl_project_args(log_u_ref, log_v_ref, tol, max_iter);
  const auto sizes = log_u_ref.sizes();
  const auto batch = sizes.slice(0, sizes.size() - 2);
  TORCH_CHECK(sizes.back() <= max_rank, "headscope::kl_project: argument 'log_u_ref' has rank r = ",
              sizes.back(), "; this kernel supports r <= ", max_rank, " (", hint, ")");
  Projection p;
  p.problems = c10::multiply_integers(batch);
  p.n = sizes[sizes.size() - 2];
  p.r = static_cast<int>(sizes.back());
  const auto opts = log_u_ref.options();
  p.U = at::empty(sizes, opts);
  p.V = at::empty(sizes, opts);
  auto batch_r = batch.vec();
  batch_r.push_back(p.r);
  p.z = at::empty(batch_r, opts);
  p.iters = at::empty(batch, opts.dtype(at::kLong));
  p.residual = at::empty(batch, opts.dtype(at::kDouble));
  return p;
}

}  // namespace headscope::mixer
