// CUDA kernel of headscope::kl_project: one thread block solves one problem, the
// whole Newton loop (line search included) runs on the device, so a batch costs
// one launch and no host-device synchronisation at all. Arithmetic in double.
#include "mixer/kl_newton.h"
#include "common/kernel.h"
#include "mixer/kl_project_setup.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

namespace headscope::mixer::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileRows = kThreads / 2;  // one thread per (row, factor) in a tile
constexpr int kMaxRankCuda = 48;         // shared memory (~177 KB at r = 48) holds tiles and r x r systems

// Column sums, the Gram lower triangle (U^T U + V^T V) and the dual objective with its
// rounding scale (kl_newton.h) at one z, in shared memory.
struct Stats {
  double* gram;  // r * r
  double* cu;    // r
  double* cv;    // r
  double* dual;  // 2: sum_i LSE_i and sum_i |LSE_i| over the rows of both factors
};
constexpr int kStatsExtra = 2;  // Stats' entries beyond r * r + 2 r

// p = softmax(L[row] + sign * z), written to out (r entries); returns the row's LSE.
__device__ double softmax_row(const double* L, int64_t row, int r, double sign, const double* z,
                              double* out) {
  const double* l = L + row * r;
  double m = -INFINITY;
  for (int j = 0; j < r; ++j) {
    out[j] = l[j] + sign * z[j];
    m = fmax(m, out[j]);
  }
  double total = 0;
  for (int j = 0; j < r; ++j) {
    out[j] = exp(out[j] - m);
    total += out[j];
  }
  const double inv = 1.0 / total;
  for (int j = 0; j < r; ++j) out[j] *= inv;
  return m + log(total);
}

// All threads: fills s with the statistics of U = softmax(a + z), V = softmax(b - z).
// Rows go through shared memory a tile at a time; each statistic has one owner thread,
// so the sums need no atomics and are deterministic.
__device__ void evaluate(const double* a, const double* b, int64_t n, int r, const double* z,
                         double* tile /* 2 x kTileRows x r */, double* lse /* kThreads */,
                         Stats s) {
  const int tid = threadIdx.x;
  const int items = r * r + 2 * r + kStatsExtra;
  for (int e = tid; e < items; e += kThreads)  // every owner zeroes what it accumulates
    s.gram[e] = 0;  // Stats' arrays are consecutive
  for (int64_t start = 0; start < n; start += kTileRows) {
    const int factor = tid / kTileRows;  // 0: U, 1: V
    const int local = tid % kTileRows;
    double* out = tile + (factor * kTileRows + local) * r;
    const int64_t row = start + local;
    if (row < n) {
      lse[tid] = softmax_row(factor == 0 ? a : b, row, r, factor == 0 ? 1.0 : -1.0, z, out);
    } else {
      for (int j = 0; j < r; ++j) out[j] = 0;
      lse[tid] = 0;
    }
    __syncthreads();
    const double* tu = tile;
    const double* tv = tile + kTileRows * r;
    for (int e = tid; e < items; e += kThreads) {
      double acc = 0;
      if (e < r * r) {
        const int j = e / r, k = e % r;
        if (k > j) continue;
        for (int t = 0; t < kTileRows; ++t)
          acc += tu[t * r + j] * tu[t * r + k] + tv[t * r + j] * tv[t * r + k];
        s.gram[e] += acc;
      } else if (e >= r * r + 2 * r) {
        const bool magnitude = e == r * r + 2 * r + 1;
        for (int t = 0; t < kThreads; ++t) acc += magnitude ? fabs(lse[t]) : lse[t];
        s.dual[magnitude] += acc;
      } else if (e < r * r + r) {
        const int j = e - r * r;
        for (int t = 0; t < kTileRows; ++t) acc += tu[t * r + j];
        s.cu[j] += acc;
      } else {
        const int j = e - r * r - r;
        for (int t = 0; t < kTileRows; ++t) acc += tv[t * r + j];
        s.cv[j] += acc;
      }
    }
    __syncthreads();
  }
  __syncthreads();  // also when n == 0
}

__device__ double max_abs_diff(const double* x, const double* y, int r) {
  double m = 0;
  for (int j = 0; j < r; ++j) {
    const double v = fabs(x[j] - y[j]);
    if (!(v <= m)) m = v;  // keeps NaN
  }
  return m;
}

__device__ double sq_diff(const double* x, const double* y, int r) {
  double s = 0;
  for (int j = 0; j < r; ++j) s += (x[j] - y[j]) * (x[j] - y[j]);
  return s;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    kl_project_kernel(const double* __restrict__ a_all, const double* __restrict__ b_all,
                      int64_t n, int r, double tol, int64_t max_iter, scalar_t* U_all,
                      scalar_t* V_all, scalar_t* z_all, int64_t* iters_all, double* res_all) {
  extern __shared__ double smem[];
  const int64_t p = blockIdx.x;
  const double* a = a_all + p * n * r;
  const double* b = b_all + p * n * r;
  double* tile = smem;                       // 2 * kTileRows * r
  double* lse = tile + 2 * kTileRows * r;    // kThreads: the tile rows' LSE
  double* bufs = lse + kThreads;             // 2 x (r*r + 2r + 2): current state and trial
  const int stats_len = r * r + 2 * r + kStatsExtra;
  double* z = bufs + 2 * stats_len;          // r
  double* zn = z + r;                        // r
  double* step = zn + r;                     // r
  double* grad = step + r;                   // r
  double* H = grad + r;                      // r * r
  double* work = H + r * r;                  // r * r
  __shared__ double grad_sq[2];
  __shared__ int flag;
  const int tid = threadIdx.x;

  auto stats = [&](int i) {
    double* base = bufs + i * stats_len;
    return Stats{base, base + r * r, base + r * r + r, base + r * r + 2 * r};
  };
  int cur = 0;
  for (int j = tid; j < r; j += kThreads) z[j] = 0;
  __syncthreads();
  evaluate(a, b, n, r, z, tile, lse, stats(cur));
  if (tid == 0) grad_sq[cur] = sq_diff(stats(cur).cu, stats(cur).cv, r);

  int64_t it = 0;
  for (; it < max_iter; ++it) {
    if (tid == 0) {
      const Stats s = stats(cur);
      flag = 0;
      if (!(max_abs_diff(s.cu, s.cv, r) < tol)) {
        for (int j = 0; j < r; ++j) {
          grad[j] = s.cu[j] - s.cv[j];
          for (int k = 0; k <= j; ++k)
            H[j * r + k] = H[k * r + j] = (j == k ? s.cu[j] + s.cv[j] : 0.0) - s.gram[j * r + k];
        }
        flag = solve_reduced_newton(H, grad, r, work, step) ? 1 : 2;
      }
    }
    __syncthreads();
    if (flag != 1) break;  // converged (0) or singular system (2)
    bool accepted = false;
    for (double alpha = 1.0; alpha > kMinStep; alpha *= 0.5) {
      for (int j = tid; j < r; j += kThreads) zn[j] = j + 1 < r ? z[j] + alpha * step[j] : 0.0;
      __syncthreads();
      evaluate(a, b, n, r, zn, tile, lse, stats(1 - cur));
      if (tid == 0) {
        grad_sq[1 - cur] = sq_diff(stats(1 - cur).cu, stats(1 - cur).cv, r);
        flag = accept_step(grad_sq[1 - cur], grad_sq[cur], alpha, stats(1 - cur).dual[0],
                           stats(cur).dual[0], stats(cur).dual[1]);
      }
      __syncthreads();
      if (flag) {
        for (int j = tid; j < r; j += kThreads) z[j] = zn[j];
        cur = 1 - cur;
        accepted = true;
        __syncthreads();
        break;
      }
    }
    if (!accepted) break;
  }

  // Outputs at the final z, with the same arithmetic as the evaluations.
  for (int64_t row = tid; row < n; row += kThreads) {
    double* buf = tile + tid * r;
    softmax_row(a, row, r, 1.0, z, buf);
    for (int j = 0; j < r; ++j) U_all[(p * n + row) * r + j] = static_cast<scalar_t>(buf[j]);
    softmax_row(b, row, r, -1.0, z, buf);
    for (int j = 0; j < r; ++j) V_all[(p * n + row) * r + j] = static_cast<scalar_t>(buf[j]);
  }
  if (tid == 0) {
    for (int j = 0; j < r; ++j) z_all[p * r + j] = static_cast<scalar_t>(z[j]);
    iters_all[p] = it + 1 < max_iter ? it + 1 : max_iter;
    res_all[p] = max_abs_diff(stats(cur).cu, stats(cur).cv, r);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project_cuda(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
  c10::cuda::CUDAGuard guard(log_u_ref.device());
  auto p = prepare_projection(log_u_ref, log_v_ref, tol, max_iter, kMaxRankCuda,
                              "use the CPU kernel");
  const int64_t n = p.n;
  const int r = p.r;
  if (p.problems == 0) return p.outputs();
  const auto a = log_u_ref.to(at::kDouble).contiguous();
  const auto b = log_v_ref.to(at::kDouble).contiguous();

  const size_t smem =
      sizeof(double) * (2 * kTileRows * r + kThreads + 2 * (r * r + 2 * r + kStatsExtra) +
                        4 * r + 2 * r * r);
  const auto* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(smem <= props->sharedMemPerBlockOptin, "headscope::kl_project: rank r = ", r,
              " needs ", smem, " bytes of shared memory per block; this GPU offers ",
              props->sharedMemPerBlockOptin, " (use the CPU kernel or a smaller r)");
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(p.U.scalar_type(), "kl_project_cuda", [&] {
    auto kernel = kl_project_kernel<scalar_t>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    kernel<<<static_cast<unsigned>(p.problems), kThreads, smem, stream>>>(
        a.const_data_ptr<double>(), b.const_data_ptr<double>(), n, r, tol, max_iter,
        p.U.mutable_data_ptr<scalar_t>(), p.V.mutable_data_ptr<scalar_t>(),
        p.z.mutable_data_ptr<scalar_t>(), p.iters.mutable_data_ptr<int64_t>(),
        p.residual.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return p.outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CUDA, m) {
  m.impl("kl_project", HEADSCOPE_KERNEL("kl_project", kl_project_cuda));
}

}  // namespace headscope::mixer::cuda
