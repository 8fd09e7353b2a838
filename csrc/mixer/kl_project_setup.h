// What the CPU and CUDA kernels of headscope::kl_project share around their solvers:
// argument checks, the double-precision copies of the inputs and the outputs.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace headscope::mixer {

struct Projection {
  int64_t problems = 0;  // product of the batch dims
  int64_t n = 0;
  int r = 0;
  at::Tensor U, V, z, iters, residual;  // outputs, allocated, in the schema's dtypes

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> outputs() const {
    return {U, V, z, iters, residual};
  }
};

// Validates the arguments (max_rank: what this backend's solver supports, with `hint`
// saying what to do beyond it) and prepares inputs and outputs.
Projection prepare_projection(const at::Tensor& log_u_ref, const at::Tensor& log_v_ref,
                              double tol, int64_t max_iter, int64_t max_rank, const char* hint);

}  // namespace headscope::mixer
