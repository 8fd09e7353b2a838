// libFuzzer harness for the attribution family: region_pool, region_pool_qk, spearman,
// pearson, linear_attribution and ward_regions.
//
// Valid inputs (any float dtype and layout, NaN/Inf allowed, per-key weights or none) are
// checked against float64 evaluations of the documented definitions, layouts against each
// other bitwise, and ward_regions against the properties of its labels; spoilt region ids,
// query weights and key weights must raise a c10::Error naming the op.
#include "attribution/attribution.h"
#include "fuzz_input.h"

#include <cmath>
#include <deque>
#include <optional>

namespace {

using headscope::fuzz::Input;
using headscope::fuzz::expect_close;
using headscope::fuzz::expect_same;
using headscope::fuzz::expect_within;
using headscope::fuzz::fail;
using headscope::fuzz::gamma_n;
using headscope::fuzz::runs;
using headscope::fuzz::smallest_normal;

at::ScalarType float_dtype(Input& in) {
  return in.pick({at::kFloat, at::kFloat, at::kDouble, at::kHalf, at::kBFloat16});
}

// The documented pooling in float64: rows of zero weight are not read; a NaN at a key
// reaches only its own region, a NaN head (`nan_heads`, (B, H)) every region that has keys.
at::Tensor pool_reference(const at::Tensor& attn, const at::Tensor& w, const at::Tensor& rid,
                          int64_t K, bool mean, const at::Tensor& nan_heads) {
  auto A = attn.to(at::kDouble);
  auto wd = w.to(at::kDouble);
  A = at::where((wd > 0).view({wd.size(0), 1, wd.size(1), 1}), A, at::zeros({}, A.options()));
  auto slot = (rid + 1).view({rid.size(0), 1, 1, rid.size(1)}).expand(A.sizes());
  auto per_region = at::zeros({A.size(0), A.size(1), A.size(2), K + 1}, A.options())
                        .scatter_add_(3, slot, A).narrow(3, 1, K);  // (B, H, Tq, K)
  auto out = at::einsum("bq,bhqk->bkh", {wd / wd.sum(1, true), per_region});
  out.masked_fill_(nan_heads.unsqueeze(1), NAN);
  if (mean) {
    auto count = at::one_hot(rid + 1, K + 1).narrow(2, 1, K).sum(1).to(at::kDouble);  // (B, K)
    out = at::where(count.unsqueeze(-1) > 0, out / count.clamp_min(1).unsqueeze(-1), 0.0);
  }
  return out;
}

// softmax(scale q k^T) in float64 with grouped heads, soft-capped, the pattern's mask
// (bottom-right causal, window, chunks, blocks) and key padding; a logit of -inf hides its key as a mask does, a row with no visible key is 0, and a
// row with a visible logit of NaN or +inf is NaN.
at::Tensor attention(const Input::QK& a) {
  const at::Tensor &q = a.q, &k = a.k;
  const auto& kpm = a.key_padding_mask;
  const int64_t Tq = q.size(2), Tk = k.size(2);
  auto logits = a.capped(at::matmul(q.to(at::kDouble), k.to(at::kDouble).repeat_interleave(q.size(1) / k.size(1), 1).mT()) * a.scale);
  auto hidden = a.hidden(Tq, Tk);
  if (kpm) hidden = hidden | kpm->view({kpm->size(0), 1, 1, Tk});
  hidden = hidden | at::isneginf(logits);
  auto bad_row = ((at::isnan(logits) | at::isposinf(logits)) & ~hidden).any(-1, true);
  auto none = hidden.all(-1, true);
  auto A = at::softmax(logits.masked_fill(hidden, -INFINITY), -1);
  return A.masked_fill(none, 0.0).masked_fill(bad_row & ~none, NAN);
}

// The pooling ops' key_weights, drawn or none: (B, Hw, Tk) of either sign, Hw among H, the
// key-value heads Hkv and 1, in a drawn float dtype and layout.
std::optional<at::Tensor> draw_key_weights(Input& in, int64_t B, int64_t H, int64_t Hkv,
                                           int64_t Tk) {
  if (!in.chance(100)) return std::nullopt;
  const int64_t Hw = in.pick({H, Hkv, int64_t{1}});
  return in.layout((in.normal({B, Hw, Tk}) * 2).to(float_dtype(in)));
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// attn (B, H, Tq, Tk) times the key weights of each head (as the ops read them), float64.
at::Tensor weighted(const at::Tensor& attn, const std::optional<at::Tensor>& key_weights) {
  if (!key_weights) return attn;
  const int64_t H = attn.size(1);
  auto kw = key_weights->to(at::kDouble).repeat_interleave(H / key_weights->size(1), 1);
  return attn.to(at::kDouble) * kw.unsqueeze(2);
}

void fuzz_pool(Input& in) {
  const int64_t B = in.size(1, 2), H = in.size(1, 4), Tq = in.size(1, 12);
  const int64_t Tk = in.size(1, in.chance(24) ? 300 : 40), K = in.size(1, 6);
  const bool mean = in.chance(100);
  const char* reduce = mean ? "mean" : "sum";
  auto rid = at::randint(-1, K, {B, Tk}, at::kLong);
  auto w = (at::rand({B, Tq}) * (at::rand({B, Tq}) < in.real(0.1, 1.0))).to(at::kFloat);
  w.select(1, Tq - 1).add_(0.5);  // a positive sum in every row
  const auto dtype = float_dtype(in);
  at::Tensor out, A;
  std::optional<at::Tensor> key_weights;
  at::Tensor probability_error = at::zeros({}, at::kDouble);  // of the qk op's attention
  const bool materialised = in.chance(128);
  if (materialised) {
    auto attn = at::softmax(in.normal({B, H, Tq, Tk}), -1).to(dtype);
    if (in.chance(40)) in.sprinkle(attn);
    attn = in.layout(attn);
    key_weights = draw_key_weights(in, B, H, H, Tk);
    if (!runs("region_pool",
              [&] { out = headscope::region_pool(attn, w, rid, K, reduce, key_weights); }))
      fail("region_pool rejected valid input");
    expect_same("region_pool", out,
                headscope::region_pool(attn.contiguous(), w, rid, K, reduce,
                                       contiguous(key_weights)));
    A = attn;
  } else {
    auto args = in.qk(B, H, Tq, Tk, 40, dtype);
    if (!args) return;
    const at::Tensor &q = args->q, &k = args->k;
    const auto& kpm = args->key_padding_mask;
    const bool causal = args->causal;
    const double scale = args->scale;
    key_weights = draw_key_weights(in, B, H, k.size(1), Tk);
    if (!runs("region_pool_qk", [&] {
          out = headscope::region_pool_qk(q, k, w, rid, K, scale, causal, kpm, reduce,
                                          args->window, args->chunk, args->block_ids,
                                          args->softcap, args->window_bounds_blocks,
                                          key_weights, args->chunk_origin);
        }))
      fail("region_pool_qk rejected valid input");
    expect_same("region_pool_qk", out,
                headscope::region_pool_qk(q.contiguous(), k.contiguous(), w, rid, K, scale, causal,
                                          kpm, reduce, args->window, args->chunk,
                                          args->block_ids, args->softcap,
                                          args->window_bounds_blocks, contiguous(key_weights),
                                          args->chunk_origin));
    A = attention(*args);
    probability_error = args->probability_error(dtype);
  }
  // qk: a weighted row with non-finite logits makes its head's features NaN
  auto nan_heads = materialised ? at::zeros({B, H}, at::kBool)
                                : (at::isnan(A).any(-1) & (w > 0).unsqueeze(1)).any(-1);
  auto terms = weighted(A, key_weights).to(at::kDouble);
  auto want = pool_reference(terms, w, rid, K, mean, nan_heads);
  // An output is a sum of terms w_q / sum(w) * attn * key weight: the weights' normaliser,
  // the products, the region's and the queries' sums and the mean's division take at most
  // 2 Tq + Tk + 4 roundings, and the qk op's probabilities carry their own relative error;
  // key weights of either sign let the result cancel, so the bound is on the terms'
  // magnitudes (the same pooling of |term|), plus each rounding's absolute error below the
  // normal range (probabilities that underflow).
  const int64_t roundings = 2 * Tq + Tk + 4;
  const double largest_factor = key_weights ? 1 + key_weights->abs().max().item<double>() : 1.0;
  auto bound = pool_reference(terms.abs() * (probability_error + gamma_n(roundings, dtype)), w,
                              rid, K, mean, nan_heads) +
               roundings * smallest_normal(dtype) * largest_factor;
  expect_within(materialised ? "region_pool" : "region_pool_qk", out, want, bound);
}

// Ranks with ties averaged, along the last dimension.
at::Tensor average_ranks(const at::Tensor& x) {
  auto a = x.unsqueeze(-1), b = x.unsqueeze(-2);
  return (b < a).sum(-1).to(at::kDouble) + ((b == a).sum(-1).to(at::kDouble) + 1) / 2;
}

at::Tensor pearson_reference(const at::Tensor& x, const at::Tensor& y) {
  auto xc = x - x.mean(-1, true), yc = y - y.mean(-1, true);
  return (xc * yc).sum(-1) / ((xc * xc).sum(-1) * (yc * yc).sum(-1)).sqrt();
}

void fuzz_correlation(Input& in) {
  const int64_t rows = in.size(0, 4), n = in.size(2, 40);
  const auto dtype = float_dtype(in);
  auto pred = in.normal({rows, n}).to(dtype), target = in.normal({rows, n}).to(dtype);
  if (in.chance(64)) target = (pred.to(at::kDouble) * in.real(-2, 2) + target.to(at::kDouble) * 0.1).to(dtype);
  if (in.chance(40)) pred.select(-1, 0).fill_(1.0), pred.narrow(-1, 1, 1).fill_(1.0);  // ties
  if (in.chance(20)) in.sprinkle(pred);
  const bool transpose = in.chance(128);  // correlate along dim 0 of the transposed layout
  if (!transpose) pred = in.layout(pred);
  auto p = transpose ? pred.t().contiguous() : pred;
  auto t = transpose ? target.t().contiguous() : target;
  const int64_t dim = transpose ? 0 : -1;
  at::Tensor s, r;
  if (!runs("spearman", [&] { s = headscope::spearman(p, t, dim); }))
    fail("spearman rejected valid input");
  if (!runs("pearson", [&] { r = headscope::pearson(p, t, dim); }))
    fail("pearson rejected valid input");
  auto pd = pred.to(at::kDouble), td = target.to(at::kDouble);
  auto has_nan = at::isnan(pd).any(-1) | at::isnan(td).any(-1);
  auto constant = (pd.amax(-1) == pd.amin(-1)) | (td.amax(-1) == td.amin(-1));
  auto want_s = at::where(has_nan | constant, at::full({}, NAN, at::kDouble),
                          pearson_reference(average_ranks(pd), average_ranks(td)));
  const double rounding = headscope::fuzz::at_least_rounding(1e-6, dtype);  // results in the input dtype
  expect_close("spearman", s, want_s, rounding, rounding);
  // Pearson judged where float32 centring keeps its digits (spread well above the mean's
  // rounding) and the data are finite.
  auto spread = [](const at::Tensor& x) { return (x - x.mean(-1, true)).abs().amax(-1) > 1e-2 * x.abs().amax(-1); };
  auto judged = spread(pd) & spread(td) & at::isfinite(pd).all(-1);
  auto want_r = pearson_reference(pd, td);
  expect_close("pearson", at::where(judged, r.to(at::kDouble), want_r), want_r,
               dtype == at::kDouble ? 1e-10 : headscope::fuzz::at_least_rounding(1e-4, dtype),
               headscope::fuzz::at_least_rounding(1e-5, dtype));
}

void fuzz_linear(Input& in) {
  const int64_t F = in.size(1, 40), rows = in.size(0, 5);
  const auto dtype = in.pick({at::kFloat, at::kDouble});
  auto f = in.normal({rows, F}).to(dtype);
  if (in.chance(20)) in.sprinkle(f);
  f = in.layout(f);
  auto w = in.normal({F}).to(dtype), mean = in.normal({F}).to(dtype);
  auto std = (in.normal({F}).abs() + 0.1).to(dtype);
  if (in.chance(30)) std[in.size(0, F - 1)] = in.pick({0.0, -1.0, double(NAN), double(INFINITY)});
  const auto bias = at::scalar_tensor(in.real(-3, 3), dtype);
  at::Tensor out;
  if (!runs("linear_attribution",
            [&] { out = headscope::linear_attribution(f, w, mean, std, bias); }))
    fail("linear_attribution rejected valid input");
  auto sd = std.to(at::kDouble);
  auto terms = (f.to(at::kDouble) - mean.to(at::kDouble)) / sd * w.to(at::kDouble);  // (rows, F)
  const double b = bias.item<double>();
  auto want = terms.sum(-1) + b;
  if (!(at::isfinite(sd) & (sd > 0)).all().item<bool>()) want = at::full_like(want, NAN);
  // each term takes 3 roundings (f - mean, w / std, the product) and the sum F - 1 more plus
  // the bias: within gamma_{F+4} (sum |term| + |bias|), however far the sum cancels
  auto bound = (terms.abs().sum(-1) + std::abs(b)) * gamma_n(F + 4, dtype) +
               (F + 4) * smallest_normal(dtype);
  expect_within("linear_attribution", out, want, bound);
}

void fuzz_ward(Input& in) {
  const int64_t h = in.size(1, 8), w = in.size(1, 8), C = in.size(1, 6), K = in.size(1, h * w);
  auto features = in.layout(in.normal({h * w, C}).to(in.pick({at::kFloat, at::kDouble})));
  at::Tensor labels;
  if (!runs("ward_regions", [&] { labels = headscope::ward_regions(features, h, w, K); }))
    fail("ward_regions rejected valid input");
  if (!labels.sizes().equals({h * w}) || labels.scalar_type() != at::kLong)
    fail("ward_regions: labels of shape " + c10::str(labels.sizes()));
  auto l = labels.contiguous();
  const int64_t* lab = l.data_ptr<int64_t>();
  // numbered 0..K-1 in order of first appearance, each region 4-connected
  int64_t next = 0;
  std::vector<int64_t> size(K, 0);
  for (int64_t i = 0; i < h * w; ++i) {
    if (lab[i] < 0 || lab[i] > next || lab[i] >= K) fail("ward_regions: labels out of order or range");
    next += lab[i] == next;
    ++size[lab[i]];
  }
  if (next != K) fail("ward_regions: " + std::to_string(next) + " regions, asked for " + std::to_string(K));
  std::vector<bool> seen(h * w, false);
  for (int64_t k = 0; k < K; ++k) {
    int64_t start = 0;
    while (lab[start] != k) ++start;
    std::deque<int64_t> todo{start};
    seen[start] = true;
    int64_t reached = 0;
    while (!todo.empty()) {
      const int64_t i = todo.front();
      todo.pop_front();
      ++reached;
      const int64_t r = i / w, c = i % w;
      for (auto [nr, nc] : {std::pair{r - 1, c}, {r + 1, c}, {r, c - 1}, {r, c + 1}}) {
        const int64_t j = nr * w + nc;
        if (nr >= 0 && nr < h && nc >= 0 && nc < w && !seen[j] && lab[j] == k) {
          seen[j] = true;
          todo.push_back(j);
        }
      }
    }
    if (reached != size[k]) fail("ward_regions: region " + std::to_string(k) + " is not connected");
  }
}

// Spoilt region ids, weights, key weights or sizes: an error naming the op, never a crash
// or a result.
void fuzz_errors(Input& in) {
  const int64_t B = in.size(1, 2), H = in.size(1, 2), Tq = in.size(1, 4), Tk = in.size(1, 6);
  const int64_t K = in.size(-1, 4);
  auto attn = at::rand({B, H, Tq, Tk});
  auto w = at::rand({B, Tq});
  auto rid = at::randint(-1, std::max<int64_t>(K, 1), {B, Tk}, at::kLong);
  std::optional<at::Tensor> key_weights;
  switch (in.size(0, 4)) {
    case 0: rid[in.size(0, B - 1)][in.size(0, Tk - 1)] = in.pick({int64_t{-2}, K, int64_t{1} << 40}); break;
    case 1: w[in.size(0, B - 1)][in.size(0, Tq - 1)] = in.pick({-1.0, double(NAN), double(INFINITY)}); break;
    case 2: w.zero_(); break;
    case 3: {  // at an image key: the factors of other keys are never read
      const int64_t b = in.size(0, B - 1), t = in.size(0, Tk - 1);
      key_weights = at::rand({B, in.pick({H, int64_t{1}}), Tk});
      (*key_weights)[b][0][t] = in.pick({double(NAN), double(INFINITY), -double(INFINITY)});
      rid[b][t] = 0;
      break;
    }
    default: if (K >= 1) return; break;  // K < 1
  }
  if (runs("region_pool", [&] { headscope::region_pool(attn, w, rid, K, "sum", key_weights); }))
    fail("region_pool accepted spoilt input");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  headscope::fuzz::tally(data, size);
  Input in(data, size);
  in.configure_torch();
  switch (in.size(0, 5)) {
    case 0: fuzz_errors(in); break;
    case 1: fuzz_correlation(in); break;
    case 2: fuzz_linear(in); break;
    case 3: fuzz_ward(in); break;
    default: fuzz_pool(in); break;
  }
  return 0;
}
