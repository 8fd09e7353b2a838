// A small register-blocked float matrix product for the vas CPU kernels (6 x 16 blocks,
// GCC/Clang vector extensions, FMA where the target has it). Single-threaded: it runs
// inside at::parallel_for tasks, where a threaded BLAS would oversubscribe the cores.
#include "vas/cpu/vas_cpu_math.h"

#include <algorithm>
#include <cstring>

namespace headscope::vas::cpu {
namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 ld8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8 bc8(float x) { return v8{x, x, x, x, x, x, x, x}; }

template <int MR>
inline void block(int64_t k, float alpha, const float* A, int64_t lda, const float* B,
                  int64_t ldb, float* C, int64_t ldc, int64_t nj) {
  v8 c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = bc8(0.0f);
  for (int64_t kk = 0; kk < k; ++kk) {
    const v8 b0 = ld8(B + kk * ldb), b1 = ld8(B + kk * ldb + 8);
    for (int r = 0; r < MR; ++r) {
      const v8 a = bc8(A[r * lda + kk]);
      c0[r] += a * b0;
      c1[r] += a * b1;
    }
  }
  const v8 al = bc8(alpha);
  for (int r = 0; r < MR; ++r) {
    const v8 x0 = c0[r] * al, x1 = c1[r] * al;
    if (nj == 16) {  // the common case: two vector stores, no memcpy call
      std::memcpy(C + r * ldc, &x0, sizeof x0);
      std::memcpy(C + r * ldc + 8, &x1, sizeof x1);
    } else {
      float tmp[16];
      std::memcpy(tmp, &x0, sizeof x0);
      std::memcpy(tmp + 8, &x1, sizeof x1);
      std::memcpy(C + r * ldc, tmp, sizeof(float) * nj);
    }
  }
}

}  // namespace

void gemm_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    int64_t i0 = 0;
    for (; i0 + 6 <= m; i0 += 6)
      block<6>(k, alpha, A + i0 * lda, lda, B + j0, ldb, C + i0 * ldc + j0, ldc, nj);
    const int64_t rest = m - i0;
    const float* a = A + i0 * lda;
    float* c = C + i0 * ldc + j0;
    switch (rest) {
      case 5: block<5>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      case 4: block<4>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      case 3: block<3>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      case 2: block<2>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      case 1: block<1>(k, alpha, a, lda, B + j0, ldb, c, ldc, nj); break;
      default: break;
    }
  }
}

}  // namespace headscope::vas::cpu
