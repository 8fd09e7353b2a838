// The vas ops through the C++ API (headscope::vas_head_stats, ...), against dense loops
// written here from the definitions; no Python.
#include "headscope.h"
#include "test_util.h"

#include <ATen/Parallel.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/triu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace {

// (d, c, r) of one head from the dense n x n matrices, in double.
std::vector<double> dense_stats(const at::Tensor& A_full, const at::Tensor& V_full, int64_t s,
                                int64_t n) {
  const auto A = A_full.to(at::kDouble).contiguous();
  const auto V = V_full.to(at::kDouble).contiguous();
  const int64_t T = A.size(0), Dh = V.size(1);
  const double* a = A.data_ptr<double>();
  const double* v = V.data_ptr<double>();
  std::vector<double> Vn(n * Dh), Am(n * n), S(n * n);
  for (int64_t i = 0; i < n; ++i) {
    double nr = 0;
    for (int64_t c = 0; c < Dh; ++c) nr += v[(s + i) * Dh + c] * v[(s + i) * Dh + c];
    const double den = std::max(std::sqrt(nr), 1e-9);
    for (int64_t c = 0; c < Dh; ++c) Vn[i * Dh + c] = v[(s + i) * Dh + c] / den;
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double g = 0;
      for (int64_t c = 0; c < Dh; ++c) g += Vn[i * Dh + c] * Vn[j * Dh + c];
      S[i * n + j] = (g + 1.0) / 2.0;
      Am[i * n + j] = a[(s + i) * T + (s + j)];
    }
  auto center = [n](const std::vector<double>& K) {
    std::vector<double> r(n, 0), c(n, 0), out(n * n);
    double t = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        r[i] += K[i * n + j] / n;
        c[j] += K[i * n + j] / n;
        t += K[i * n + j] / (n * n);
      }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) out[i * n + j] = K[i * n + j] - c[j] - r[i] + t;
    return out;
  };
  const auto Ac = center(Am), Sc = center(S);
  double diff = 0, na = 0, ns = 0, num = 0, d1 = 0, d2 = 0;
  for (int64_t e = 0; e < n * n; ++e) {
    diff += (Ac[e] - Sc[e]) * (Ac[e] - Sc[e]);
    na += Am[e] * Am[e];
    ns += S[e] * S[e];
    num += Ac[e] * Sc[e];
    d1 += Ac[e] * Ac[e];
    d2 += Sc[e] * Sc[e];
  }
  const double d = std::sqrt(diff) / std::max(std::sqrt(na) * std::sqrt(ns), 1e-9);
  const double c = num / std::max(std::sqrt(d1 * d2), 1e-12);
  double mA = 0, mS = 0;
  for (int64_t i = 0; i < n; ++i) {
    double ra = 0, rs = 0;
    for (int64_t j = 0; j < n; ++j) {
      ra += Am[i * n + j];
      rs += S[i * n + j];
    }
    mA = std::max(mA, ra);
    mS = std::max(mS, rs);
  }
  mA = std::max(mA, 1e-12);
  mS = std::max(mS, 1e-12);
  double kl = 0;
  for (int64_t e = 0; e < n * n; ++e) {
    const double p = std::max(Am[e] / mA, 1e-12), q = std::max(S[e] / mS, 1e-12);
    kl += p * std::log(p / q);
  }
  return {d, c, kl / n};
}

int64_t window_len(int64_t len, int64_t T) { return std::min(std::max(std::min(len, T), int64_t(4)), T); }

void expect_stats(const at::Tensor& out, const at::Tensor& A, const at::Tensor& V,
                  const std::vector<int64_t>& lengths, const std::vector<int64_t>& offsets = {}) {
  const int64_t B = A.size(0), H = A.size(1), T = A.size(2);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{B, H, 3}));
  ASSERT_EQ(out.scalar_type(), at::kFloat);
  const auto o = out.contiguous();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = window_len(lengths[b], T);
    const int64_t s = offsets.empty() ? 0 : std::max<int64_t>(0, std::min(offsets[b], T - n));
    for (int64_t h = 0; h < H; ++h) {
      const auto want = dense_stats(A[b][h], V[b][h], s, n);
      for (int k = 0; k < 3; ++k) {
        const double got = o[b][h][k].item<double>();
        EXPECT_NEAR(got, want[k], 1e-6 + 1e-4 * std::abs(want[k]))
            << "b=" << b << " h=" << h << " stat=" << k;
      }
    }
  }
}

at::Tensor causal_softmax(at::Tensor logits, bool causal) {
  const int64_t T = logits.size(-1);
  if (causal) {
    const auto mask = at::ones({T, T}, at::kBool).triu(1);
    logits = logits.masked_fill(mask, -INFINITY);
  }
  return at::softmax(logits, -1);
}

using headscope::testing::error_of;

}  // namespace

TEST(Vas, HeadStatsMatchDenseDefinition) {
  at::manual_seed(1);
  for (bool causal : {false, true}) {
    const int64_t B = 3, H = 2, T = 150, Dh = 12;
    const auto A = causal_softmax(at::randn({B, H, T, T}).mul(2), causal);
    const auto V = at::randn({B, H, T, Dh});
    const std::vector<int64_t> lengths = {150, 2, 77};
    const auto out = headscope::vas_head_stats(A, V, at::tensor(lengths));
    expect_stats(out, A, V, lengths);
  }
}

TEST(Vas, AttentionSinkKeepsCentredStatistics) {
  // Rows that put almost all their weight on key 0 (an attention sink): ||Ac|| is a small
  // fraction of ||A||, and c must not come from differences of sums of A's size.
  at::manual_seed(3);
  for (bool causal : {false, true}) {
    const int64_t B = 2, H = 2, T = 150, Dh = 12;
    auto logits = at::randn({B, H, T, T});
    logits.select(-1, 0).add_(12.0);
    const auto A = causal_softmax(logits, causal);
    const auto V = at::randn({B, H, T, Dh});
    const std::vector<int64_t> lengths = {150, 40};
    expect_stats(headscope::vas_head_stats(A, V, at::tensor(lengths)), A, V, lengths);
  }
}

TEST(Vas, CalledFromInsideAParallelRegion) {
  // The op's own at::parallel_for then runs inline on each outer thread: per-thread
  // scratch must still be private to each call.
  at::manual_seed(6);
  const int64_t B = 1, H = 8, T = 200, Dh = 16;
  const auto A = causal_softmax(at::randn({B, H, T, T}).mul(2), false);
  const auto V = at::randn({B, H, T, Dh});
  const auto lengths = at::tensor(std::vector<int64_t>{T});
  const auto expected = headscope::vas_head_stats(A, V, lengths);
  std::vector<at::Tensor> got(4);
  at::parallel_for(0, 4, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) got[i] = headscope::vas_head_stats(A, V, lengths);
  });
  for (const auto& g : got) EXPECT_TRUE(at::equal(g, expected));
}

TEST(Vas, HalfAndStridedInputs) {
  at::manual_seed(2);
  const int64_t B = 2, H = 3, T = 40, Dh = 8;
  const auto A = causal_softmax(at::randn({B, H, T, T}), true).to(at::kHalf);
  const auto V_bthd = at::randn({B, T, H, Dh}).to(at::kBFloat16);
  const auto V = V_bthd.transpose(1, 2);  // (B, H, T, Dh) view, not contiguous
  ASSERT_FALSE(V.is_contiguous());
  const std::vector<int64_t> lengths = {40, 31};
  const auto out = headscope::vas_head_stats(A, V, at::tensor(lengths));
  expect_stats(out, A.to(at::kFloat), V.to(at::kFloat), lengths);
}

TEST(Vas, OffsetsSelectTheLeftPaddedWindow) {
  at::manual_seed(3);
  const int64_t B = 2, H = 1, T = 30, Dh = 5;
  const auto A = at::softmax(at::randn({B, H, T, T}), -1);
  const auto V = at::randn({B, H, T, Dh});
  const std::vector<int64_t> lengths = {12, 2}, offsets = {18, 28};
  const auto out = headscope::vas_head_stats(A, V, at::tensor(lengths), at::tensor(offsets));
  expect_stats(out, A, V, lengths, offsets);
}

TEST(Vas, QkEqualsMaterialisedAttention) {
  at::manual_seed(4);
  const int64_t B = 2, H = 4, Hkv = 2, T = 70, D = 16, Dh = 8;
  const auto q = at::randn({B, H, T, D});
  const auto k = at::randn({B, Hkv, T, D});
  const auto V = at::randn({B, H, T, Dh});
  const auto lengths = at::tensor(std::vector<int64_t>{70, 45});
  const double scale = 0.25;
  for (bool causal : {true, false}) {
    const auto k_rep = k.repeat_interleave(H / Hkv, 1);
    const auto A = causal_softmax(at::matmul(q, k_rep.transpose(-1, -2)).mul(scale), causal);
    const auto want = headscope::vas_head_stats(A, V, lengths);
    const auto got = headscope::vas_head_stats_qk(q, k, V, lengths, scale, causal);
    EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-6)) << "causal=" << causal;
  }
}

TEST(Vas, QkKeyPaddingMaskLeavesKeysOut) {
  at::manual_seed(6);
  const int64_t B = 2, H = 2, T = 40, D = 8, Dh = 4;
  const auto q = at::randn({B, H, T, D});
  const auto k = at::randn({B, H, T, D});
  const auto V = at::randn({B, H, T, Dh});
  const auto lengths = at::tensor(std::vector<int64_t>{40, 30});
  const auto offsets = at::tensor(std::vector<int64_t>{0, 10});
  auto pad = at::zeros({B, T}, at::kBool);
  pad.select(0, 1).narrow(0, 0, 10).fill_(true);  // batch row 1: left padding of 10
  for (bool causal : {true, false}) {
    // padding keys' logits to -inf: each row's softmax over the keys in use
    const auto logits = at::matmul(q, k.transpose(-1, -2)).mul(0.5);
    const auto A = causal_softmax(logits.masked_fill(pad.view({B, 1, 1, T}), -INFINITY), causal);
    const auto want = headscope::vas_head_stats(A, V, lengths, offsets);
    const auto got = headscope::vas_head_stats_qk(q, k, V, lengths, 0.5, causal, offsets, pad);
    EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-6)) << "causal=" << causal;
    const auto unmasked = headscope::vas_head_stats_qk(q, k, V, lengths, 0.5, causal, offsets);
    EXPECT_FALSE(at::allclose(unmasked.select(0, 1), want.select(0, 1), 1e-4, 1e-6));
  }
}

TEST(Vas, QkSlidingWindowAndBidirectionalBlock) {
  at::manual_seed(7);
  const int64_t B = 1, H = 2, T = 300, D = 8, Dh = 6, window = 40;
  const auto q = at::randn({B, H, T, D});
  const auto k = at::randn({B, H, T, D});
  const auto V = at::randn({B, H, T, Dh});
  const auto lengths = at::tensor(std::vector<int64_t>{T});
  auto block_ids = at::full({B, T}, -1, at::kLong);
  block_ids.narrow(1, 100, 80).fill_(0);  // a block longer than the window
  // the pattern from its definition: j > i - window and (j <= i or both in the block)
  auto keep = at::zeros({T, T}, at::kBool);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = std::max<int64_t>(0, i - window + 1); j < T; ++j)
      if (j <= i || (i >= 100 && i < 180 && j >= 100 && j < 180)) keep[i][j] = true;
  const auto logits = at::matmul(q, k.transpose(-1, -2)).mul(0.5 / 3.0).tanh().mul(3.0);
  const auto A = at::softmax(logits.masked_fill(keep.logical_not(), -INFINITY), -1);
  const auto want = headscope::vas_head_stats(A, V, lengths);
  const auto got = headscope::vas_head_stats_qk(q, k, V, lengths, 0.5, true, std::nullopt,
                                                std::nullopt, window, std::nullopt, block_ids,
                                                3.0);
  EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-6)) << got << want;
  const auto plain = headscope::vas_head_stats_qk(q, k, V, lengths, 0.5, true);
  EXPECT_FALSE(at::allclose(plain, want, 1e-4, 1e-6));
}

TEST(Vas, AggregateMatchesLoops) {
  at::manual_seed(5);
  const int64_t B = 2, L = 4, H = 3;
  const auto st = at::rand({B, L, H, 3}, at::kDouble);
  const auto out = headscope::vas_aggregate(st);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{B, 36}));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t qi = 0; qi < 3; ++qi)
      for (int64_t a = 0; a < 4; ++a) {
        std::vector<double> lay(L);
        for (int64_t l = 0; l < L; ++l) {
          std::vector<double> x(H);
          for (int64_t h = 0; h < H; ++h) x[h] = st[b][l][h][qi].item<double>();
          double m = 0, v = 0;
          for (double e : x) m += e / H;
          for (double e : x) v += (e - m) * (e - m) / H;
          const double vals[4] = {m, std::sqrt(v), *std::max_element(x.begin(), x.end()),
                                  *std::min_element(x.begin(), x.end())};
          lay[l] = vals[a];
        }
        double m = 0, v = 0;
        for (double e : lay) m += e / L;
        for (double e : lay) v += (e - m) * (e - m) / L;
        const int64_t col = qi * 12 + a * 3;
        EXPECT_NEAR(out[b][col].item<double>(), m, 1e-6);
        EXPECT_NEAR(out[b][col + 1].item<double>(), std::sqrt(v), 1e-6);
        EXPECT_NEAR(out[b][col + 2].item<double>(), *std::max_element(lay.begin(), lay.end()), 1e-6);
      }
}

TEST(Vas, NonFiniteInputGivesNanHead) {
  const auto A = at::softmax(at::randn({1, 2, 10, 10}), -1);
  auto V = at::randn({1, 2, 10, 4});
  V[0][1][3][0].fill_(NAN);
  const auto out = headscope::vas_head_stats(A, V, at::tensor(std::vector<int64_t>{10}));
  EXPECT_TRUE(at::isnan(out[0][1]).all().item<bool>());
  EXPECT_TRUE(at::isfinite(out[0][0]).all().item<bool>());
}

TEST(Vas, BadInputsNameTheArgument) {
  const auto A = at::softmax(at::randn({2, 2, 6, 6}), -1);
  const auto V = at::randn({2, 2, 6, 3});
  const auto L = at::full({2}, 6, at::kLong);
  EXPECT_NE(error_of([&] { headscope::vas_head_stats(A, V.narrow(1, 0, 1), L); })
                .find("headscope::vas_head_stats: argument 'head_writes'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { headscope::vas_head_stats(A, V, L.add(1)); })
                .find("argument 'lengths'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { headscope::vas_head_stats(A, V, L.to(at::kInt)); })
                .find("argument 'lengths'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { headscope::vas_head_stats_qk(A, A.narrow(1, 0, 1), V, L, INFINITY, true); })
                .find("argument 'scale'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { headscope::vas_aggregate(at::rand({2, 3, 4})); })
                .find("headscope::vas_aggregate: argument 'head_stats'"),
            std::string::npos);
}
