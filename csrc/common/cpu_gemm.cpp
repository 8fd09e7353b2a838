#include "common/cpu_gemm.h"

#include "common/cpu_simd.h"

#include <algorithm>
#include <cstring>

namespace headscope {
namespace {

// An MR x (2 W) block of C (W = lanes of T): every k step loads two vectors of B's row and
// broadcasts MR entries of A, 2 MR independent multiply-add chains (FMA where the target
// has it).
template <int MR, typename T>
inline void block(int64_t k, T alpha, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                  int64_t ldc, int64_t nj) {
  constexpr int W = kLanes<T>;
  using V = Vec<T>;
  V c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = V{};
  for (int64_t kk = 0; kk < k; ++kk) {
    const V b0 = vload(B + kk * ldb), b1 = vload(B + kk * ldb + W);
    for (int r = 0; r < MR; ++r) {
      const V a = vsplat(A[r * lda + kk]);
      c0[r] += a * b0;
      c1[r] += a * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    const V x0 = c0[r] * alpha, x1 = c1[r] * alpha;
    if (nj == 2 * W) {  // the common case: two vector stores, no memcpy call
      vstore(C + r * ldc, x0);
      vstore(C + r * ldc + W, x1);
    } else {
      T tmp[2 * W];
      vstore(tmp, x0);
      vstore(tmp + W, x1);
      std::memcpy(C + r * ldc, tmp, sizeof(T) * nj);
    }
  }
}

}  // namespace

template <typename T>
void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* A, int64_t lda, const T* B,
             int64_t ldb, T* C, int64_t ldc) {
  constexpr int64_t NB = 2 * kLanes<T>;
  for (int64_t j0 = 0; j0 < n; j0 += NB) {
    const int64_t nj = std::min<int64_t>(NB, n - j0);
    int64_t i0 = 0;
    for (; i0 + 6 <= m; i0 += 6)
      block<6>(k, alpha, A + i0 * lda, lda, B + j0, ldb, C + i0 * ldc + j0, ldc, nj);
    const T* a = A + i0 * lda;
    T* c = C + i0 * ldc + j0;
    switch (m - i0) {
      case 5: block<5>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      case 4: block<4>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      case 3: block<3>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      case 2: block<2>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      case 1: block<1>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      default: break;
    }
  }
}

template void gemm_nn<float>(int64_t, int64_t, int64_t, float, const float*, int64_t,
                             const float*, int64_t, float*, int64_t);

}  // namespace headscope
