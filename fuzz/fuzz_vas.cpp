// libFuzzer harness for the vas family: vas_head_stats, vas_head_stats_qk, vas_aggregate.
//
// Valid inputs (any float dtype and layout, NaN/Inf allowed) are checked against a float64
// evaluation of the definitions (d and c where the heads' centred matrices are resolved, r
// where S is not near 0), layouts against each other bitwise, and heads with a non-finite
// input against NaN; spoilt inputs must raise a c10::Error naming the op.
#include "fuzz_input.h"
#include "vas/vas.h"

#include <algorithm>
#include <cmath>
#include <optional>

namespace {

using headscope::fuzz::Input;
using headscope::fuzz::expect_within;
using headscope::fuzz::expect_same;
using headscope::fuzz::fail;
using headscope::fuzz::runs;

at::Tensor center(const at::Tensor& K) {
  return K - K.mean(-2, true) - K.mean(-1, true) + K.mean({-2, -1}, true);
}

// (H, 3) float64 (d, c, r) of one window; NaN for heads whose inputs are not all finite
// (`finite`, (H,)). `bound` gets, per statistic, how far the op's float32 arithmetic may
// take it from there: 0 where float64 does not resolve it well enough to judge float32
// arithmetic.
at::Tensor window_stats(const at::Tensor& A, const at::Tensor& V, at::Tensor finite,
                        at::Tensor& bound) {
  const int64_t n = A.size(-1);
  auto Vn = V / at::linalg_vector_norm(V, 2, {-1}, true).clamp_min(1e-9);
  auto S = (at::matmul(Vn, Vn.mT()) + 1) / 2;
  auto W = Vn - Vn.mean(-2, true);
  auto Ac = center(A), Sc = at::matmul(W, W.mT()) / 2;
  auto fro = [](const at::Tensor& x) { return x.square().sum({-2, -1}).sqrt(); };
  auto den = (fro(A) * fro(S)).clamp_min(1e-9);
  auto numerator = fro(Ac - Sc);
  auto d = numerator / den;
  auto c = (Ac * Sc).sum({-2, -1}) / (fro(Ac) * fro(Sc)).clamp_min(1e-12);
  auto p = (A / A.sum(-1).amax(-1, true).unsqueeze(-1).clamp_min(1e-12)).clamp_min(1e-12);
  auto q = (S / S.sum(-1).amax(-1, true).unsqueeze(-1).clamp_min(1e-12)).clamp_min(1e-12);
  auto log_ratio = (p / q).log();
  auto r = (p * log_ratio).sum(-1).mean(-1);
  auto out = at::stack({d, c, r}, -1);
  // d's numerator is sqrt(||Ac||^2 - 2 <Ac, Sc> + ||Sc||^2), three float32-then-float64
  // sums (float32 within an 8-row strip of a 128-wide tile: relative error gamma_{8*128+64}
  // of their magnitudes, at most P^2 with P = ||Ac|| + ||Sc||); where they cancel (Ac close
  // to Sc) the root turns that into min(eps P^2 / numerator, sqrt(eps) P), not a share of d
  const double eps = headscope::fuzz::gamma_n(8 * std::min<int64_t>(n, 128) + 64, at::kFloat);
  auto P = fro(Ac) + fro(Sc);
  auto cancelled = at::minimum(eps * P.square() / numerator.clamp_min(1e-300), std::sqrt(eps) * P) / den;
  // c is a cosine: by Cauchy-Schwarz its terms' magnitude is 1, so an absolute bound fits it;
  // r sums p ln(p / q) of either sign (rows of a window need not sum alike), so its bound
  // scales with the terms' magnitudes sum p (1 + |ln(p / q)|), not with r
  auto r_terms = (p * (1 + log_ratio.abs())).sum(-1).mean(-1);
  bound = at::stack({2e-4 + 2e-3 * d + cancelled, 2e-4 + 2e-3 * c.abs(), 2e-4 + 2e-3 * r_terms}, -1);
  finite = finite & at::isfinite(V).all(-1).all(-1);
  // judged where the centred matrices keep float32's digits (c) and S's float32 rounding
  // does not move log q (r)
  auto resolved = at::stack({at::ones_like(finite),
                             fro(Ac) > 1e-3 * fro(A) & fro(Sc) > 1e-3 * fro(S),
                             S.amin({-2, -1}) > 1e-3}, -1) & finite.unsqueeze(-1);
  bound = at::where(resolved, bound, INFINITY);
  return at::where(finite.unsqueeze(-1), out, at::full({}, NAN, out.options()));
}

// The window rule: n = max(min(length, T), 4) bounded by T, moved left to fit the offset.
std::pair<int64_t, int64_t> window(int64_t length, int64_t T, std::optional<int64_t> offset) {
  int64_t n = std::min(std::max(std::min(length, T), int64_t{4}), T);
  int64_t start = offset ? std::max<int64_t>(0, std::min(*offset, T - n)) : 0;
  return {start, n};
}

// `inputs_finite(b, s, n)`: (H,) whether the attention inputs of batch row b's window
// [s, s + n) are finite (the NaN policy: the window's attention block, or for the qk op its
// query rows and the keys they use).
template <typename FiniteFn>
void check_stats(const char* op, const at::Tensor& out, const at::Tensor& A, const at::Tensor& V,
                 const at::Tensor& lengths, const std::optional<at::Tensor>& offsets,
                 FiniteFn inputs_finite) {
  const int64_t B = A.size(0), H = A.size(1), T = A.size(2);
  if (!out.sizes().equals({B, H, 3}) || out.scalar_type() != at::kFloat)
    fail(std::string(op) + ": result of shape " + c10::str(out.sizes()) + " and dtype " +
         c10::toString(out.scalar_type()));
  auto Ad = A.to(at::kDouble), Vd = V.to(at::kDouble);
  for (int64_t b = 0; b < B; ++b) {
    auto [s, n] = window(lengths[b].item<int64_t>(), T,
                         offsets ? std::optional<int64_t>((*offsets)[b].item<int64_t>()) : std::nullopt);
    at::Tensor bound;
    auto want = window_stats(Ad[b].slice(1, s, s + n).slice(2, s, s + n), Vd[b].slice(1, s, s + n),
                             inputs_finite(b, s, n), bound);
    expect_within(op, out[b], want, bound);
  }
}

// softmax(scale q k^T) in float64 with grouped heads, soft-capped, the pattern's mask
// (causal, window, chunks, blocks) and key padding; a row with no visible key is 0.
at::Tensor attention(const Input::QK& a) {
  const auto& kpm = a.key_padding_mask;
  auto kk = a.k.to(at::kDouble).repeat_interleave(a.q.size(1) / a.k.size(1), 1);
  auto logits = a.capped(at::matmul(a.q.to(at::kDouble), kk.mT()) * a.scale);
  const int64_t T = a.q.size(2);
  logits.masked_fill_(a.hidden(T, T), -INFINITY);
  if (kpm) logits.masked_fill_(kpm->view({kpm->size(0), 1, 1, T}), -INFINITY);
  auto none = at::isneginf(logits).all(-1, true);
  return at::softmax(logits, -1).masked_fill(none, 0.0);
}

void fuzz_head_stats(Input& in) {
  const int64_t B = in.size(1, 3), H = in.size(1, 4), T = in.size(1, in.chance(32) ? 160 : 24);
  const int64_t Dh = in.size(1, 70);
  const bool qk = in.chance(100);
  auto lengths = at::empty({B}, at::kLong);
  for (int64_t b = 0; b < B; ++b) lengths[b] = in.size(0, T);
  std::optional<at::Tensor> offsets;
  if (in.chance(100)) {
    offsets = at::empty({B}, at::kLong);
    for (int64_t b = 0; b < B; ++b) (*offsets)[b] = in.size(0, T - std::min(lengths[b].item<int64_t>(), T));
  }
  auto V = in.normal({B, H, T, Dh});
  if (in.chance(64)) V = V.narrow(2, 0, 1) + in.pick({1e-4, 1e-3, 1e-2}) * V;  // near-parallel
  const auto dtype = in.pick({at::kFloat, at::kFloat, at::kHalf, at::kBFloat16});
  V = V.to(dtype);
  if (in.chance(32)) in.sprinkle(V);
  V = in.layout(V);

  at::Tensor A, out;
  const char* op;
  if (!qk) {
    op = "vas_head_stats";
    auto logits = in.normal({B, H, T, T});
    if (in.chance(64)) logits.select(-1, 0).add_(in.pick({4.0, 8.0, 12.0}));  // a sink
    if (in.chance(128)) logits.masked_fill_(at::ones({T, T}, at::kBool).triu(1), -INFINITY);
    A = at::softmax(logits, -1);
    if (in.chance(32)) A = A * in.pick({0.5, 3.0});  // rows not summing to 1
    A = A.to(dtype);
    if (in.chance(32)) in.sprinkle(A);
    A = in.layout(A);
    if (!runs(op, [&] { out = headscope::vas_head_stats(A, V, lengths, offsets); }))
      fail("vas_head_stats rejected valid input");
    expect_same(op, out, headscope::vas_head_stats(A.contiguous(), V.contiguous(), lengths, offsets));
  } else {
    op = "vas_head_stats_qk";
    auto args = in.qk(B, H, T, T, 70, dtype);
    if (!args) return;
    const at::Tensor &q = args->q, &k = args->k;
    const auto& kpm = args->key_padding_mask;
    const bool causal = args->causal;
    const double scale = args->scale;
    const int64_t Hkv = k.size(1);
    if (!runs(op, [&] {
          out = headscope::vas_head_stats_qk(q, k, V, lengths, scale, causal, offsets, kpm,
                                             args->window, args->chunk, args->block_ids,
                                             args->softcap, args->window_bounds_blocks,
                                             args->chunk_origin);
        }))
      fail("vas_head_stats_qk rejected valid input");
    expect_same(op, out, headscope::vas_head_stats_qk(q.contiguous(), k.contiguous(), V.contiguous(),
                                                      lengths, scale, causal, offsets, kpm,
                                                      args->window, args->chunk, args->block_ids,
                                                      args->softcap, args->window_bounds_blocks,
                                                      args->chunk_origin));
    A = attention(*args);
    const auto seen = ~args->hidden(T, T).squeeze(1);  // (B, T, T): keys each row may see
    check_stats(op, out, A, V, lengths, offsets, [&](int64_t b, int64_t s, int64_t n) {
      // the keys some window row sees, padding aside (docs/vas.md, NaN and Inf)
      auto used = seen[b].narrow(0, s, n).any(0);
      if (kpm) used &= (*kpm)[b].logical_not();
      auto keys = k[b].repeat_interleave(H / Hkv, 0);
      auto key_finite = at::isfinite(keys).all(-1) | used.logical_not();  // (H, T)
      return at::isfinite(q[b].narrow(1, s, n)).all(-1).all(-1) & key_finite.all(-1);
    });
    return;
  }
  check_stats(op, out, A, V, lengths, offsets, [&](int64_t b, int64_t s, int64_t n) {
    return at::isfinite(A[b].narrow(1, s, n).narrow(2, s, n)).all(-1).all(-1);
  });
}

// Spoilt arguments: each must raise an error naming the op, never crash or compute.
void fuzz_errors(Input& in) {
  const int64_t B = in.size(0, 2), H = in.size(0, 2), T = in.size(0, 6), D = in.size(0, 4);
  auto dtype = in.pick({at::kFloat, at::kInt, at::kBool, at::kComplexFloat, at::kLong});
  std::vector<int64_t> a_shape{B, H, T, T}, v_shape{B, H, T, D};
  switch (in.size(0, 3)) {
    case 0: a_shape.pop_back(); break;
    case 1: v_shape[2] += 1; break;
    case 2: a_shape[1] += 1; break;
    default: break;
  }
  auto A = at::rand(a_shape).to(dtype);
  auto V = at::rand(v_shape).to(in.chance(128) ? at::kFloat : dtype);
  auto lengths = at::full({in.chance(200) ? B : B + 1}, in.size(-3, T + 3), at::kLong);
  auto ok = runs("vas_head_stats", [&] { headscope::vas_head_stats(A, V, lengths); });
  const bool valid = dtype == at::kFloat && V.scalar_type() == at::kFloat && a_shape.size() == 4 &&
                     a_shape[1] == H && v_shape[2] == T && T >= 1 && D >= 1 && lengths.size(0) == B &&
                     (B == 0 || (lengths.min().item<int64_t>() >= 0 && lengths.max().item<int64_t>() <= T));
  if (ok && !valid) fail("vas_head_stats accepted spoilt input");
  auto stats = at::rand({B, in.size(0, 3), H, in.size(2, 4)}).to(dtype);
  runs("vas_aggregate", [&] { headscope::vas_aggregate(stats); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  headscope::fuzz::tally(data, size);
  Input in(data, size);
  in.configure_torch();
  if (in.chance(40)) fuzz_errors(in);
  else fuzz_head_stats(in);
  return 0;
}
