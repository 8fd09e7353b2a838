// Argument validation shared by the mixer's CPU, CUDA and Meta kernels.
#pragma once

#include <ATen/core/Tensor.h>

namespace headscope::mixer {

// log_u_ref, log_v_ref: (..., n, r), same shape, float32/float64, r >= 1; tol >= 0; max_iter >= 0.
void check_kl_project_args(const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol,
                           int64_t max_iter);

// U: (..., n, r), V: (..., m, r), X: (..., m, d), equal batch dims. U and V share a dtype
// (float32/float64); X has U's dtype, or float16/bfloat16 when U is float32.
void check_thin_mix_args(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X);

// U, V: (..., n, r) factor pair as for thin_mix; s: (..., r) with U's batch dims and dtype.
void check_kl_hvp_args(const at::Tensor& U, const at::Tensor& V, const at::Tensor& s);
}  // namespace headscope::mixer
