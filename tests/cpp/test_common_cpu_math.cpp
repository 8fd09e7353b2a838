// The vectorised helpers of the CPU kernels: the division-free log2, the 8 x 8 register
// transpose and the strided transpose built on it, and the small matrix product.
#include "common/cpu_gemm.h"
#include "common/cpu_math.h"
#include "common/cpu_simd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

using headscope::f8;

TEST(CpuMath, Log2WithinItsBoundOverTheClippedRange) {
  // the kernels take logs of p / q with p, q in [1e-12, ~1]: ratios in [1e-12, 1e12]
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> expo(-40.0f, 40.0f);
  double worst_ulp = 0;
  for (int n = 0; n < 200000; ++n) {
    f8 x;
    for (int k = 0; k < 8; ++k) x[k] = std::exp2(expo(gen));
    if (n == 0)
      for (int k = 0; k < 8; ++k) x[k] = 1.0f + static_cast<float>(k - 4) * 1.2e-7f;  // near 1
    if (n == 1 || n == 2)  // either side of the table's interval edges, where the worst cases lie
      for (int k = 0; k < 8; ++k)
        x[k] = std::nextafter(std::sqrt(0.5f) * (1.0f + k / 8.0f), n == 1 ? 0.0f : 2.0f);
    const f8 y = headscope::log2_8_pos(x);
    for (int k = 0; k < 8; ++k) {
      const double truth = std::log2(static_cast<double>(x[k]));
      if (truth == 0.0) {
        EXPECT_EQ(y[k], 0.0f);
        continue;
      }
      const float t = static_cast<float>(std::fabs(truth));
      const double ulp = std::nextafter(t, 1e30f) - t;
      worst_ulp = std::max(worst_ulp, std::fabs(y[k] - truth) / ulp);
    }
  }
  EXPECT_LT(worst_ulp, 2.5);  // the documented bound (an exhaustive sweep finds 2.47)
}

TEST(CpuMath, TransposeMatchesScalarForEveryEdgeShape) {
  for (int rows : {1, 7, 8, 9, 16, 23}) {
    for (int cols : {1, 5, 8, 15, 24}) {
      const int lds = cols + 3, ldd = rows + 5;
      std::vector<float> src(rows * lds), dst(cols * ldd, -1.0f);
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i);
      headscope::transpose(src.data(), lds, rows, cols, dst.data(), ldd);
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c)
          ASSERT_EQ(dst[c * ldd + r], src[r * lds + c]) << rows << "x" << cols << " at " << r << "," << c;
      for (int c = 0; c < cols; ++c)  // nothing written past the block
        for (int r = rows; r < ldd; ++r) ASSERT_EQ(dst[c * ldd + r], -1.0f);
    }
  }
}

template <typename T>
void check_gemm_on_ragged_shapes() {
  // a dot product of k terms (and the scaling by alpha) in any order is within
  // gamma_{k+1} = (k + 1) u / (1 - (k + 1) u) of the sum of its terms' magnitudes
  const int k = 37;
  const double u = std::numeric_limits<T>::epsilon() / 2, gamma = (k + 1) * u / (1 - (k + 1) * u);
  std::mt19937 gen(3);
  std::normal_distribution<T> nd;
  for (int m : {1, 5, 6, 13, 24}) {
    for (int n : {1, 4, 8, 16, 17, 40}) {
      const int lda = k + 1, ldb = n + 16 + 16, ldc = n + 2;  // B rows: 16 spare entries
      std::vector<T> A(m * lda), B(k * ldb), C(m * ldc, T(7));
      for (auto& v : A) v = nd(gen);
      for (auto& v : B) v = nd(gen);
      headscope::gemm_nn<T>(m, n, k, T(0.5), A.data(), lda, B.data(), ldb, C.data(), ldc);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          long double ref = 0, magnitude = 0;
          for (int q = 0; q < k; ++q) {
            ref += static_cast<long double>(A[i * lda + q]) * B[q * ldb + j];
            magnitude += std::fabs(static_cast<long double>(A[i * lda + q]) * B[q * ldb + j]);
          }
          ASSERT_NEAR(C[i * ldc + j], 0.5 * static_cast<double>(ref),
                      gamma * 0.5 * static_cast<double>(magnitude));
        }
        for (int j = n; j < ldc; ++j) ASSERT_EQ(C[i * ldc + j], T(7));  // untouched
      }
    }
  }
}

TEST(CpuMath, GemmMatchesLoopsOnRaggedShapes) { check_gemm_on_ragged_shapes<float>(); }

}  // namespace
