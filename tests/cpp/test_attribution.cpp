// GoogleTest of the attribution family through the C++ API (headscope::region_pool, ...),
// against straightforward loops written here; no Python.
#include "headscope.h"
#include "test_util.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <vector>

namespace {

// Reference: out[b, k, h] = sum_q w[b, q] / sum(w[b]) * sum_{t: r[b, t] == k} attn[b, h, q, t].
std::vector<double> ref_pool(const at::Tensor& attn, const at::Tensor& w, const at::Tensor& rid,
                             int64_t K, bool mean) {
  const auto a = attn.to(at::kDouble).contiguous();
  const auto wd = w.to(at::kDouble).contiguous();
  const auto r = rid.contiguous();
  const int64_t B = a.size(0), H = a.size(1), Tq = a.size(2), Tk = a.size(3);
  const double* ap = a.const_data_ptr<double>();
  const double* wp = wd.const_data_ptr<double>();
  const int64_t* rp = r.const_data_ptr<int64_t>();
  std::vector<double> out(B * K * H, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    double ws = 0;
    for (int64_t q = 0; q < Tq; ++q) ws += wp[b * Tq + q];
    std::vector<int64_t> cnt(K, 0);
    for (int64_t t = 0; t < Tk; ++t)
      if (rp[b * Tk + t] >= 0) ++cnt[rp[b * Tk + t]];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q = 0; q < Tq; ++q)
        for (int64_t t = 0; t < Tk; ++t) {
          const int64_t k = rp[b * Tk + t];
          if (k < 0) continue;
          out[(b * K + k) * H + h] += wp[b * Tq + q] / ws * ap[((b * H + h) * Tq + q) * Tk + t];
        }
    if (mean)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t h = 0; h < H; ++h)
          out[(b * K + k) * H + h] = cnt[k] ? out[(b * K + k) * H + h] / cnt[k] : 0.0;
  }
  return out;
}

void expect_close(const at::Tensor& got, const std::vector<double>& want, double tol) {
  const auto g = got.to(at::kDouble).contiguous();
  ASSERT_EQ(g.numel(), static_cast<int64_t>(want.size()));
  const double* p = g.const_data_ptr<double>();
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(p[i], want[i], tol * (1 + std::abs(want[i]))) << "at flat index " << i;
}

at::Tensor random_regions(int64_t B, int64_t Tk, int64_t K) {
  auto rid = at::randint(-1, K, {B, Tk}, at::kLong);
  return rid;
}

using headscope::testing::error_of;

}  // namespace

TEST(Attribution, RegionPoolMatchesLoops) {
  at::manual_seed(0);
  const int64_t B = 2, H = 3, Tq = 4, Tk = 23, K = 5;
  const auto attn = at::softmax(at::randn({B, H, Tq, Tk}, at::kDouble), -1);
  auto w = at::rand({B, Tq}, at::kDouble);
  const auto rid = random_regions(B, Tk, K);
  for (bool mean : {false, true}) {
    const auto out = headscope::region_pool(attn, w, rid, K, mean ? "mean" : "sum");
    ASSERT_EQ(out.sizes(), (at::IntArrayRef{B, K, H}));
    expect_close(out, ref_pool(attn, w, rid, K, mean), 1e-12);
  }
}

TEST(Attribution, RegionPoolQKMatchesSoftmaxPath) {
  at::manual_seed(1);
  const int64_t B = 2, H = 6, Hkv = 2, Tq = 3, Tk = 300, D = 16, K = 4;
  const auto q = at::randn({B, H, Tq, D}, at::kDouble);
  const auto k = at::randn({B, Hkv, Tk, D}, at::kDouble);
  const auto w = at::rand({B, Tq}, at::kDouble);
  const auto rid = random_regions(B, Tk, K);
  const double scale = 0.25;
  const auto out = headscope::region_pool_qk(q, k, w, rid, K, scale, /*causal=*/true,
                                             std::nullopt, "sum");
  // softmax of the masked scores, looping over heads (query head h reads kv head h / 3)
  auto attn = at::zeros({B, H, Tq, Tk}, at::kDouble);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const auto s = q[b][h].matmul(k[b][h / (H / Hkv)].t()) * scale;  // (Tq, Tk)
      auto masked = s.clone();
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t t = i + Tk - Tq + 1; t < Tk; ++t) masked[i][t] = -INFINITY;
      attn[b][h].copy_(at::softmax(masked, -1));
    }
  expect_close(out, ref_pool(attn, w, rid, K, false), 1e-10);
  // the defaults are scale = D ** -0.5 (0.25 here) and causal
  EXPECT_TRUE(at::equal(headscope::region_pool_qk(q, k, w, rid, K), out));
}

TEST(Attribution, RegionPoolQKLayersIsEveryLayersRegionPoolQK) {
  at::manual_seed(2);
  const int64_t B = 2, H = 4, Hkv = 2, Tq = 3, Tk = 50, D = 8, K = 5;
  const auto w = at::rand({B, Tq}) + 0.1;
  const auto rid = random_regions(B, Tk, K);
  const std::vector<double> scales = {0.2, 0.3};
  std::vector<at::Tensor> q, k, per_layer;
  for (int64_t l = 0; l < 2; ++l) {
    q.push_back(at::randn({B, H, Tq, D}));
    k.push_back(at::randn({B, Hkv, Tk, D}));
    per_layer.push_back(headscope::region_pool_qk(q[l], k[l], w, rid, K, scales[l]));
  }
  // (B, K, L * H), column l * H + h
  EXPECT_TRUE(at::equal(headscope::region_pool_qk_layers(q, k, w, rid, K, scales),
                        at::cat(per_layer, 2)));
}

TEST(Attribution, RegionPoolKeyWeights) {
  at::manual_seed(5);
  const int64_t B = 2, H = 4, Hkv = 2, Tq = 3, Tk = 40, D = 8, K = 5;
  const auto attn = at::softmax(at::randn({B, H, Tq, Tk}, at::kDouble), -1);
  const auto w = at::rand({B, Tq}, at::kDouble) + 0.1;
  const auto rid = random_regions(B, Tk, K);
  // key weights of one row per query head, or one shared row: the loops on attn * weights
  for (int64_t Hw : {H, int64_t{1}}) {
    const auto kw = at::randn({B, Hw, Tk}, at::kDouble);
    const auto out = headscope::region_pool(attn, w, rid, K, "sum", kw);
    expect_close(out, ref_pool(attn * kw.repeat_interleave(H / Hw, 1).unsqueeze(2), w, rid, K,
                               false), 1e-12);
  }
  // q/k: a weight row per kv head is that row repeated for each query head of its group
  const auto q = at::randn({B, H, Tq, D}, at::kDouble), k = at::randn({B, Hkv, Tk, D}, at::kDouble);
  const auto kw = at::rand({B, Hkv, Tk}, at::kDouble);
  const auto grouped = headscope::region_pool_qk(q, k, w, rid, K, 0.3, true, std::nullopt, "sum",
                                                 std::nullopt, std::nullopt, std::nullopt,
                                                 std::nullopt, true, kw);
  const auto per_head = headscope::region_pool_qk(q, k, w, rid, K, 0.3, true, std::nullopt,
                                                  "sum", std::nullopt, std::nullopt, std::nullopt,
                                                  std::nullopt, true,
                                                  kw.repeat_interleave(H / Hkv, 1));
  EXPECT_TRUE(at::equal(grouped, per_head));
  EXPECT_FALSE(at::allclose(grouped, headscope::region_pool_qk(q, k, w, rid, K, 0.3)));
  // layers: one tensor per layer
  const std::vector<at::Tensor> layer_weights = {kw, kw * 2};
  const auto layers = headscope::region_pool_qk_layers(
      {q, q}, {k, k}, w, rid, K, std::vector<double>{0.3, 0.3}, true, std::nullopt, "sum",
      std::nullopt, std::nullopt, std::nullopt, std::nullopt, true, layer_weights);
  EXPECT_TRUE(at::allclose(layers, at::cat({grouped, grouped * 2}, 2), 1e-14, 0));
  // a non-finite factor of an image key is an error; other keys' factors are never read
  auto bad = kw.clone();
  bad[1][0][3] = NAN;
  auto image_at_3 = rid.clone(), none_at_3 = rid.clone();
  image_at_3[1][3] = 0;
  none_at_3[1][3] = -1;
  EXPECT_TRUE(at::equal(headscope::region_pool(attn, w, none_at_3, K, "sum", bad),
                        headscope::region_pool(attn, w, none_at_3, K, "sum", kw)));
  const auto msg =
      error_of([&] { headscope::region_pool(attn, w, image_at_3, K, "sum", bad); });
  EXPECT_NE(msg.find("headscope::region_pool: argument 'key_weights' must hold finite values, "
                     "got nan at [1, 0, 3]"), std::string::npos) << msg;
}

// Whether query position i sees key j: window, chunks from 0, causal or the same block
// (block ids; negative: none), the block bounded by the window and chunks (Gemma 3) or
// not (PaliGemma 2), written from the definition (docs/attribution.md).
static bool sees(int64_t i, int64_t j, int64_t window, int64_t chunk,
                 const std::vector<int64_t>& blocks, bool window_bounds_blocks) {
  const bool same_block = blocks[i] >= 0 && blocks[j] == blocks[i];
  if (same_block && !window_bounds_blocks) return true;
  if (window > 0 && j <= i - window) return false;
  if (chunk > 0 && j / chunk != i / chunk) return false;
  return j <= i || same_block;
}

TEST(Attribution, RegionPoolQKPatterns) {
  at::manual_seed(3);
  const int64_t B = 1, H = 2, Tq = 20, Tk = 200, D = 8, K = 3;
  const auto q = at::randn({B, H, Tq, D}, at::kDouble);
  const auto k = at::randn({B, H, Tk, D}, at::kDouble);
  const auto w = at::rand({B, Tq}, at::kDouble);
  const auto rid = random_regions(B, Tk, K);
  std::vector<int64_t> blocks(Tk, -1);
  for (int64_t t = 150; t < 190; ++t) blocks[t] = 4;  // queries 150.. see up to key 189
  const auto block_ids = at::tensor(blocks).view({1, Tk});
  const double scale = 0.3, cap = 2.0;
  for (int64_t window : {0, 25})
    for (int64_t chunk : {0, 64})
      for (bool bounds : {true, false}) {
        const auto out = headscope::region_pool_qk(q, k, w, rid, K, scale, true, std::nullopt,
                                                   "sum", window, chunk, block_ids, cap, bounds);
        auto attn = at::zeros({B, H, Tq, Tk}, at::kDouble);
        for (int64_t h = 0; h < H; ++h) {
          auto s = q[0][h].matmul(k[0][h].t()).mul(scale / cap).tanh().mul(cap);
          for (int64_t i = 0; i < Tq; ++i)
            for (int64_t t = 0; t < Tk; ++t)
              if (!sees(i + Tk - Tq, t, window, chunk, blocks, bounds)) s[i][t] = -INFINITY;
          attn[0][h].copy_(at::softmax(s, -1));
        }
        expect_close(out, ref_pool(attn, w, rid, K, false), 1e-10);
      }
  // per-layer windows: each layer's own
  const std::vector<int64_t> windows = {25, 0}, chunks = {0, 64};
  std::vector<at::Tensor> per_layer;
  for (int64_t l = 0; l < 2; ++l)
    per_layer.push_back(headscope::region_pool_qk(q, k, w, rid, K, scale, true, std::nullopt,
                                                  "sum", windows[l], chunks[l], block_ids, cap));
  EXPECT_TRUE(at::equal(headscope::region_pool_qk_layers({q, q}, {k, k}, w, rid, K,
                                                         std::vector<double>{scale, scale}, true,
                                                         std::nullopt, "sum", windows, chunks,
                                                         block_ids, cap),
                        at::cat(per_layer, 2)));
}

// Chunks counted from an origin before the keys (a key cache past the first chunk): origin
// -5 puts the chunk boundaries at keys 59, 123, 187, written from the definition; every op
// of the C++ API takes it.
TEST(Attribution, RegionPoolQKChunkOrigin) {
  at::manual_seed(4);
  const int64_t B = 1, H = 2, Tq = 20, Tk = 200, D = 8, K = 3, chunk = 64, origin = -5;
  const auto q = at::randn({B, H, Tq, D}, at::kDouble);
  const auto k = at::randn({B, H, Tk, D}, at::kDouble);
  const auto w = at::rand({B, Tq}, at::kDouble);
  const auto rid = random_regions(B, Tk, K);
  const auto chunk_origin = at::full({B}, origin, at::kLong);
  const double scale = 0.3;
  const auto out = headscope::region_pool_qk(q, k, w, rid, K, scale, true, std::nullopt, "sum",
                                             std::nullopt, chunk, std::nullopt, std::nullopt,
                                             true, std::nullopt, chunk_origin);
  const auto first_of = [&](int64_t p) { return p - ((p - origin) % chunk); };  // p > origin
  auto attn = at::zeros({B, H, Tq, Tk}, at::kDouble);
  for (int64_t h = 0; h < H; ++h) {
    auto s = q[0][h].matmul(k[0][h].t()).mul(scale);
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t t = 0; t < Tk; ++t)
        if (t > i + Tk - Tq || first_of(t) != first_of(i + Tk - Tq)) s[i][t] = -INFINITY;
    attn[0][h].copy_(at::softmax(s, -1));
  }
  expect_close(out, ref_pool(attn, w, rid, K, false), 1e-10);
  // the queries 180..199 straddle the boundary at 187: from key 0 the chunks differ
  EXPECT_FALSE(at::allclose(out, headscope::region_pool_qk(q, k, w, rid, K, scale, true,
                                                           std::nullopt, "sum", std::nullopt,
                                                           chunk)));
  EXPECT_TRUE(at::equal(headscope::region_pool_qk_layers({q, q}, {k, k}, w, rid, K,
                                                         std::vector<double>{scale, scale}, true,
                                                         std::nullopt, "sum", std::nullopt,
                                                         std::vector<int64_t>{chunk, 0},
                                                         std::nullopt, std::nullopt, true,
                                                         std::nullopt, chunk_origin)
                            .narrow(2, 0, H),
                        out));
  const auto msg = error_of([&] {
    headscope::region_pool_qk(q, k, w, rid, K, scale, true, std::nullopt, "sum", std::nullopt,
                              std::nullopt, std::nullopt, std::nullopt, true, std::nullopt,
                              chunk_origin);
  });
  EXPECT_NE(msg.find("headscope::region_pool_qk: argument 'chunk_origin' must come with a "
                     "'chunk' > 0"),
            std::string::npos)
      << msg;
}

TEST(Attribution, LinearAttribution) {
  at::manual_seed(2);
  const int64_t F = 11;
  const auto f = at::randn({3, 4, F}, at::kDouble);
  const auto wt = at::randn({F}, at::kDouble), mu = at::randn({F}, at::kDouble);
  const auto sd = at::rand({F}, at::kDouble) + 0.5;
  const auto out = headscope::linear_attribution(f, wt, mu, sd, at::scalar_tensor(-0.5, at::kDouble));
  ASSERT_EQ(out.sizes(), (at::IntArrayRef{3, 4}));
  std::vector<double> want;
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      double s = -0.5;
      for (int64_t c = 0; c < F; ++c)
        s += (f[i][j][c].item<double>() - mu[c].item<double>()) / sd[c].item<double>() *
             wt[c].item<double>();
      want.push_back(s);
    }
  expect_close(out, want, 1e-12);
}

TEST(Attribution, SpearmanTiesAndConstant) {
  // x has ties: average ranks (1.5, 1.5, 3, 4); y ranks (4, 3, 2, 1) -> rho computed by hand
  const auto x = at::tensor({1.0, 1.0, 2.0, 3.0}, at::kDouble).view({1, 4});
  const auto y = at::tensor({4.0, 3.0, 2.0, 1.0}, at::kDouble).view({1, 4});
  const double rx[] = {1.5, 1.5, 3, 4}, ry[] = {4, 3, 2, 1};
  double mx = 2.5, my = 2.5, sxy = 0, sxx = 0, syy = 0;
  for (int i = 0; i < 4; ++i) {
    sxy += (rx[i] - mx) * (ry[i] - my);
    sxx += (rx[i] - mx) * (rx[i] - mx);
    syy += (ry[i] - my) * (ry[i] - my);
  }
  EXPECT_NEAR(headscope::spearman(x, y).item<double>(), sxy / std::sqrt(sxx * syy), 1e-15);
  EXPECT_TRUE(std::isnan(headscope::spearman(at::ones({1, 4}, at::kDouble), y).item<double>()));
  EXPECT_NEAR(headscope::pearson(y, y * 2 + 1).item<double>(), 1.0, 1e-15);
}

TEST(Attribution, WardRegionsTwoBlocks) {
  // Two constant halves plus tiny noise: K = 2 splits the grid exactly at the middle column.
  at::manual_seed(3);
  const int64_t h = 6, w = 8;
  auto X = at::randn({h * w, 3}, at::kDouble) * 1e-3;
  for (int64_t p = 0; p < h * w; ++p)
    if (p % w >= w / 2) X[p] += 10.0;
  const auto labels = headscope::ward_regions(X, h, w, 2);
  ASSERT_EQ(labels.scalar_type(), at::kLong);
  for (int64_t p = 0; p < h * w; ++p)
    EXPECT_EQ(labels[p].item<int64_t>(), p % w >= w / 2 ? 1 : 0) << "patch " << p;
  const auto all = headscope::ward_regions(X, h, w, h * w);  // no merge: first appearance
  for (int64_t p = 0; p < h * w; ++p) EXPECT_EQ(all[p].item<int64_t>(), p);
}

TEST(Attribution, WardRegionsOverFramesMergeTheSamePlaceInTime) {
  // Three frames of two constant halves whose colours swap in the last frame: K = 3 keeps
  // each half of the first two frames together (adjacent in time at the same place) and
  // the last frame apart from them.
  at::manual_seed(5);
  const int64_t T = 3, h = 4, w = 6;
  auto X = at::randn({T * h * w, 2}, at::kDouble) * 1e-3;
  const auto right = [&](int64_t p) { return (p % w >= w / 2) != (p / (h * w) == T - 1); };
  for (int64_t p = 0; p < T * h * w; ++p)
    if (right(p)) X[p] += 10.0;
  X.slice(0, (T - 1) * h * w) += 100.0;  // the last frame far from the others
  const auto labels = headscope::ward_regions(X, h, w, 3, T);
  ASSERT_EQ(labels.size(0), T * h * w);
  for (int64_t p = 0; p < T * h * w; ++p) {
    const int64_t want = p / (h * w) == T - 1 ? 2 : (right(p) ? 1 : 0);
    EXPECT_EQ(labels[p].item<int64_t>(), want) << "patch " << p;
  }
  // one frame is the plain grid
  const auto first = X.slice(0, 0, h * w);
  EXPECT_TRUE(at::equal(headscope::ward_regions(first, h, w, 2, 1),
                        headscope::ward_regions(first, h, w, 2)));
}

TEST(Attribution, ErrorsNameTheArgument) {
  const auto attn = at::softmax(at::randn({1, 2, 3, 10}), -1);
  const auto w = at::ones({1, 3});
  auto rid = at::zeros({1, 10}, at::kLong);
  rid[0][4] = 9;
  auto msg = error_of([&] { headscope::region_pool(attn, w, rid, 3); });
  EXPECT_NE(msg.find("headscope::region_pool: argument 'region_ids'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 9 at [0, 4]"), std::string::npos) << msg;
  msg = error_of([&] { headscope::region_pool(attn, at::zeros({1, 3}), rid.clamp_max(2), 3); });
  EXPECT_NE(msg.find("argument 'query_weights'"), std::string::npos) << msg;
  msg = error_of([&] {
    headscope::region_pool_qk(at::randn({1, 3, 1, 8}), at::randn({1, 2, 10, 8}), at::ones({1, 1}),
                              at::zeros({1, 10}, at::kLong), 2, 1.0, false, std::nullopt);
  });
  EXPECT_NE(msg.find("argument 'k' must have a number of heads"), std::string::npos) << msg;
  msg = error_of([&] { headscope::spearman(at::randn({3}), at::randn({4})); });
  EXPECT_NE(msg.find("headscope::spearman: argument 'target'"), std::string::npos) << msg;
  msg = error_of([&] { headscope::ward_regions(at::randn({10, 2}), 3, 4, 2); });
  EXPECT_NE(msg.find("headscope::ward_regions: argument 'features'"), std::string::npos) << msg;
  msg = error_of([&] { headscope::ward_regions(at::randn({12, 2}), 3, 4, 2, 0); });
  EXPECT_NE(msg.find("headscope::ward_regions: argument 'frames'"), std::string::npos) << msg;
}

// The device-generic value checks the CUDA kernels use (one host sync when valid), run
// here on CPU tensors.
#include "attribution/attribution_checks.h"

TEST(Attribution, DeviceGenericValueChecks) {
  using headscope::attribution::check_pool_values;
  const char* op = "headscope::region_pool";
  auto rid = at::zeros({2, 6}, at::kLong);
  rid[1][5] = -1;
  const auto w = at::ones({2, 3});
  EXPECT_NO_THROW(check_pool_values(op, rid, 2, w));
  auto bad = rid.clone();
  bad[1][2] = 2;
  auto msg = error_of([&] { check_pool_values(op, bad, 2, w); });
  EXPECT_NE(msg.find("argument 'region_ids'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 2 at [1, 2]"), std::string::npos) << msg;
  auto wn = w.clone();
  wn[0][1] = -0.5;
  msg = error_of([&] { check_pool_values(op, rid, 2, wn); });
  EXPECT_NE(msg.find("argument 'query_weights' must hold finite values >= 0, got -0.5 at [0, 1]"),
            std::string::npos) << msg;
  auto wz = w.clone();
  wz[1].zero_();
  msg = error_of([&] { check_pool_values(op, rid, 2, wz); });
  EXPECT_NE(msg.find("all zeros in row 1"), std::string::npos) << msg;
}
