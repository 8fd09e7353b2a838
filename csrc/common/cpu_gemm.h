// The small matrix product of the CPU kernels (the q k^T tiles of vas_head_stats_qk, the
// value Gram tiles of vas_head_stats).
#pragma once

#include <cstdint>

namespace headscope {

// Row-major C (m x n, ldc) = alpha * A (m x k, lda) * B (k x n, ldb), instantiated for
// T = float. Register blocks of 6 rows by two vectors of columns (16 floats, 8 doubles): each
// row of B must have that many readable entries past the last block's start (up to
// 2 * kLanes<T> - 1 past column n; their values are not used). Single-threaded: it runs
// inside at::parallel_for tasks, where a threaded BLAS would oversubscribe the cores.
template <typename T>
void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* A, int64_t lda, const T* B,
             int64_t ldb, T* C, int64_t ldc);

}  // namespace headscope
