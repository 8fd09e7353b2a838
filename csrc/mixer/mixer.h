// C++ API of the mixer family: the joint KL projection of two low-rank factors and
// the thin doubly-stochastic mixer. Each call goes through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace headscope {

// Projects positive references exp(log_u_ref), exp(log_v_ref) (both (..., n, r)) to
// row-stochastic U, V with equal column sums g. Returns (U, V, z, iters, residual);
// residual > tol means the problem did not converge (docs/mixer.md).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol = 1e-11,
    int64_t max_iter = 80);

// The Hessian of the projection's dual at (U, V) applied to s (..., r).
at::Tensor kl_hvp(const at::Tensor& U, const at::Tensor& V, const at::Tensor& s);

// Y = U ((V^T X) / g[:, None]), g = U.sum(-2): the dense W = U diag(1/g) V^T applied to X.
at::Tensor thin_mix(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X);

}  // namespace headscope
