#include "attribution/attribution_checks.h"

#include "common/checks.h"

#include <ATen/ops/any.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ge.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/le.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/logical_or.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sum.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace headscope::attribution {

namespace {
const std::initializer_list<at::ScalarType> kFloat = {at::kFloat, at::kDouble, at::kHalf,
                                                      at::kBFloat16};
}

at::ScalarType accum_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

CorrelationRows prepare_correlation(const char* op, const at::Tensor& pred,
                                    const at::Tensor& target, int64_t dim) {
  const int64_t d = check_correlation_args(op, pred, target, dim);
  CorrelationRows p;
  auto out_sizes = pred.sizes().vec();
  out_sizes.erase(out_sizes.begin() + d);
  p.out = at::empty(out_sizes, pred.options());
  p.rows = p.out.numel();
  if (p.rows == 0) return p;
  p.n = pred.size(d);
  p.x = pred.movedim(d, -1).to(at::kDouble).contiguous();
  p.y = target.movedim(d, -1).to(at::kDouble).contiguous();
  return p;
}

bool parse_reduce(const char* op, c10::string_view reduce) {
  HEADSCOPE_CHECK_ARG(reduce == "sum" || reduce == "mean", op, "reduce",
                      "must be \"sum\" or \"mean\", got \"", std::string(reduce), "\"");
  return reduce == "mean";
}

static void check_weights_and_regions(const char* op, const at::Tensor& ref, const char* ref_name,
                                      const at::Tensor& query_weights,
                                      const at::Tensor& region_ids,
                                      const c10::SymInt& num_regions, int64_t tq_dim,
                                      const at::Tensor& keys,
                                      const char* keys_name, int64_t tk_dim) {
  check_dim(op, "query_weights", query_weights, 2);
  check_dtype_in(op, "query_weights", query_weights, kFloat);
  check_same_device(op, ref_name, ref, "query_weights", query_weights);
  check_same_size(op, ref_name, ref, 0, "query_weights", query_weights, 0);
  check_same_size(op, ref_name, ref, tq_dim, "query_weights", query_weights, 1);
  check_dim(op, "region_ids", region_ids, 2);
  check_dtype_in(op, "region_ids", region_ids, {at::kLong});
  check_same_device(op, ref_name, ref, "region_ids", region_ids);
  check_same_size(op, ref_name, ref, 0, "region_ids", region_ids, 0);
  check_same_size(op, keys_name, keys, tk_dim, "region_ids", region_ids, 1);
  HEADSCOPE_CHECK_ARG(num_regions >= 1, op, "num_regions", "must be >= 1, got ", num_regions);
}

// key_weights (B, Hw, Tk): B from ref's dimension 0, Hw dividing ref's H heads (dimension
// 1), Tk from keys' dimension tk_dim.
static void check_key_weights(const char* op, const char* arg, const at::Tensor& key_weights,
                              const at::Tensor& ref, const char* ref_name, const at::Tensor& keys,
                              const char* keys_name, int64_t tk_dim) {
  check_dim(op, arg, key_weights, 3);
  check_dtype_in(op, arg, key_weights, kFloat);
  check_same_device(op, ref_name, ref, arg, key_weights);
  check_same_size(op, ref_name, ref, 0, arg, key_weights, 0);
  const auto H = ref.sym_size(1), Hw = key_weights.sym_size(1);
  HEADSCOPE_CHECK_ARG(Hw >= 1 && H % Hw == 0, op, arg,
                      "must have a number of heads (dimension 1) dividing the ", H, " heads of '",
                      ref_name, "' (one per head, per key-value head, or 1), got ",
                      describe(key_weights));
  check_same_size(op, keys_name, keys, tk_dim, arg, key_weights, 2);
}

void check_region_pool_args(const at::Tensor& attn, const at::Tensor& query_weights,
                            const at::Tensor& region_ids, const c10::SymInt& num_regions,
                            c10::string_view reduce,
                            const std::optional<at::Tensor>& key_weights) {
  const char* op = "headscope::region_pool";
  check_dim(op, "attn", attn, 4);
  check_dtype_in(op, "attn", attn, kFloat);
  check_weights_and_regions(op, attn, "attn", query_weights, region_ids, num_regions, 2, attn,
                            "attn", 3);
  if (key_weights.has_value() && key_weights->defined())
    check_key_weights(op, "key_weights", *key_weights, attn, "attn", attn, "attn", 3);
  parse_reduce(op, reduce);
}

// One layer of region_pool_qk / region_pool_qk_layers (its q and k named q_name, k_name).
static void check_qk_layer(const char* op, const at::Tensor& q, const char* q_name,
                           const at::Tensor& k, const char* k_name,
                           const at::Tensor& query_weights, const at::Tensor& region_ids,
                           const c10::SymInt& num_regions,
                           const std::optional<at::Tensor>& key_padding_mask) {
  check_dim(op, q_name, q, 4);
  check_dtype_in(op, q_name, q, kFloat);
  check_dim(op, k_name, k, 4);
  HEADSCOPE_CHECK_ARG(k.scalar_type() == q.scalar_type(), op, k_name, "must have the dtype of '",
                      q_name, "' (", c10::toString(q.scalar_type()), "), got ", describe(k));
  check_same_device(op, q_name, q, k_name, k);
  check_same_size(op, q_name, q, 0, k_name, k, 0);
  check_same_size(op, q_name, q, 3, k_name, k, 3);
  const auto H = q.sym_size(1), Hkv = k.sym_size(1);
  HEADSCOPE_CHECK_ARG(Hkv >= 1 && H % Hkv == 0, op, k_name,
                      "must have a number of heads (dimension 1) >= 1 that divides the ", H,
                      " heads of '", q_name, "', got ", describe(k));
  check_weights_and_regions(op, q, q_name, query_weights, region_ids, num_regions, 2, k, k_name,
                            2);
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const auto& m = *key_padding_mask;
    check_dim(op, "key_padding_mask", m, 2);
    check_dtype_in(op, "key_padding_mask", m, {at::kBool});
    check_same_device(op, q_name, q, "key_padding_mask", m);
    check_same_size(op, q_name, q, 0, "key_padding_mask", m, 0);
    check_same_size(op, k_name, k, 2, "key_padding_mask", m, 1);
  }
}

void check_region_pool_qk_args(const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& query_weights, const at::Tensor& region_ids,
                               const c10::SymInt& num_regions,
                               const std::optional<double>& scale,
                               const std::optional<at::Tensor>& key_padding_mask,
                               c10::string_view reduce, const std::optional<int64_t>& window,
                               const std::optional<int64_t>& chunk,
                               const std::optional<at::Tensor>& block_ids,
                               const std::optional<double>& softcap,
                               const std::optional<at::Tensor>& key_weights,
                               const std::optional<at::Tensor>& chunk_origin) {
  const char* op = "headscope::region_pool_qk";
  check_qk_layer(op, q, "q", k, "k", query_weights, region_ids, num_regions, key_padding_mask);
  if (key_weights.has_value() && key_weights->defined())
    check_key_weights(op, "key_weights", *key_weights, q, "q", k, "k", 2);
  check_scale(op, scale);
  check_pattern(op, q, "q", k, "k", 2, window, chunk, block_ids, softcap);
  check_chunk_origin(op, q, "q", chunk_origin, chunk.value_or(0) > 0);
  parse_reduce(op, reduce);
}

void check_region_pool_qk_layers_args(at::TensorList q, at::TensorList k,
                                      const at::Tensor& query_weights,
                                      const at::Tensor& region_ids,
                                      const c10::SymInt& num_regions,
                                      const std::optional<at::ArrayRef<double>>& scale,
                                      const std::optional<at::Tensor>& key_padding_mask,
                                      c10::string_view reduce, at::OptionalIntArrayRef window,
                                      at::OptionalIntArrayRef chunk,
                                      const std::optional<at::Tensor>& block_ids,
                                      const std::optional<double>& softcap,
                                      std::optional<at::TensorList> key_weights,
                                      const std::optional<at::Tensor>& chunk_origin) {
  const char* op = "headscope::region_pool_qk_layers";
  const size_t L = q.size();
  HEADSCOPE_CHECK_ARG(L >= 1, op, "q", "must hold at least one layer, got none");
  HEADSCOPE_CHECK_ARG(k.size() == L, op, "k", "must hold one tensor per layer of 'q' (", L,
                      "), got ", k.size());
  HEADSCOPE_CHECK_ARG(!key_weights.has_value() || key_weights->size() == L, op, "key_weights",
                      "must hold one tensor per layer of 'q' (", L, "), got ",
                      key_weights.has_value() ? key_weights->size() : 0);
  for (size_t l = 0; l < L; ++l) {
    const std::string q_name = "q[" + std::to_string(l) + "]";
    const std::string k_name = "k[" + std::to_string(l) + "]";
    check_qk_layer(op, q[l], q_name.c_str(), k[l], k_name.c_str(), query_weights, region_ids,
                   num_regions, key_padding_mask);
    // one kernel and one output column block per layer: every layer of the first one's
    // dtype, device and sizes
    HEADSCOPE_CHECK_ARG(q[l].scalar_type() == q[0].scalar_type(), op, q_name.c_str(),
                        "must have the dtype of 'q[0]' (", c10::toString(q[0].scalar_type()),
                        "), got ", describe(q[l]));
    check_same_device(op, "q[0]", q[0], q_name.c_str(), q[l]);
    HEADSCOPE_CHECK_ARG(q[l].sym_sizes() == q[0].sym_sizes(), op, q_name.c_str(),
                        "must have the sizes of 'q[0]' (", q[0].sym_sizes(), "), got ",
                        describe(q[l]));
    HEADSCOPE_CHECK_ARG(k[l].sym_sizes() == k[0].sym_sizes(), op, k_name.c_str(),
                        "must have the sizes of 'k[0]' (", k[0].sym_sizes(), "), got ",
                        describe(k[l]));
    if (key_weights.has_value()) {
      const std::string w_name = "key_weights[" + std::to_string(l) + "]";
      check_defined(op, w_name.c_str(), (*key_weights)[l]);
      check_key_weights(op, w_name.c_str(), (*key_weights)[l], q[l], q_name.c_str(), k[l],
                        k_name.c_str(), 2);
    }
  }
  if (scale.has_value()) {
    HEADSCOPE_CHECK_ARG(scale->size() == L, op, "scale", "must hold one value per layer (", L,
                        "), got ", scale->size());
    for (double s : *scale) check_scale(op, s);
  }
  const std::pair<const char*, at::OptionalIntArrayRef> lengths[] = {{"window", window},
                                                                     {"chunk", chunk}};
  for (const auto& [name, list] : lengths) {
    if (!list.has_value()) continue;
    HEADSCOPE_CHECK_ARG(list->size() == L, op, name, "must hold one length per layer (", L,
                        "), got ", list->size());
    for (int64_t v : *list) check_pattern_length(op, name, v);
  }
  check_pattern(op, q[0], "q[0]", k[0], "k[0]", 2, std::nullopt, std::nullopt, block_ids,
                softcap);
  const bool chunked = chunk.has_value() &&
                       std::any_of(chunk->begin(), chunk->end(), [](int64_t c) { return c > 0; });
  check_chunk_origin(op, q[0], "q[0]", chunk_origin, chunked);
  parse_reduce(op, reduce);
}

void check_linear_attribution_args(const at::Tensor& features, const at::Tensor& weight,
                                   const at::Tensor& mean, const at::Tensor& std,
                                   const std::optional<at::Tensor>& bias) {
  const char* op = "headscope::linear_attribution";
  check_min_dim(op, "features", features, 1);
  check_dtype_in(op, "features", features, kFloat);
  const std::pair<const char*, const at::Tensor*> params[] = {
      {"weight", &weight}, {"mean", &mean}, {"std", &std}};
  for (const auto& [name, t] : params) {
    check_dim(op, name, *t, 1);
    check_dtype_in(op, name, *t, kFloat);
    check_same_device(op, "features", features, name, *t);
    check_same_size(op, "features", features, -1, name, *t, 0);
  }
  if (bias.has_value() && bias->defined()) {
    check_dim(op, "bias", *bias, 0);
    check_dtype_in(op, "bias", *bias, kFloat);
    check_same_device(op, "features", features, "bias", *bias);
  }
}

int64_t check_correlation_args(const char* op, const at::Tensor& pred, const at::Tensor& target,
                               int64_t dim) {
  check_min_dim(op, "pred", pred, 1);
  check_dtype_in(op, "pred", pred, kFloat);
  check_defined(op, "target", target);
  HEADSCOPE_CHECK_ARG(target.scalar_type() == pred.scalar_type(), op, "target",
                      "must have the dtype of 'pred' (", c10::toString(pred.scalar_type()),
                      "), got ", describe(target));
  check_same_device(op, "pred", pred, "target", target);
  HEADSCOPE_CHECK_ARG(target.sym_sizes().equals(pred.sym_sizes()), op, "target",
                      "must have the shape of 'pred' ", pred.sym_sizes(), ", got ",
                      describe(target));
  const int64_t nd = pred.dim();
  HEADSCOPE_CHECK_ARG(dim >= -nd && dim < nd, op, "dim", "must be in [", -nd, ", ", nd,
                      ") for 'pred' with ", nd, " dimensions, got ", dim);
  const int64_t d = dim < 0 ? dim + nd : dim;
  HEADSCOPE_CHECK_ARG(pred.sym_size(d) >= 2, op, "pred",
                      "must have at least 2 elements along dim ", d, ", got ", describe(pred));
  return d;
}

void check_ward_args(const at::Tensor& features, const c10::SymInt& height,
                     const c10::SymInt& width, const c10::SymInt& num_regions,
                     const c10::SymInt& frames) {
  const char* op = "headscope::ward_regions";
  check_dim(op, "features", features, 2);
  check_dtype_in(op, "features", features, kFloat);
  HEADSCOPE_CHECK_ARG(height >= 1, op, "height", "must be >= 1, got ", height);
  HEADSCOPE_CHECK_ARG(width >= 1, op, "width", "must be >= 1, got ", width);
  HEADSCOPE_CHECK_ARG(frames >= 1, op, "frames", "must be >= 1, got ", frames);
  const c10::SymInt patches = frames * height * width;
  if (frames == 1) {
    HEADSCOPE_CHECK_ARG(features.sym_size(0) == patches, op, "features",
                        "must have height * width = ", patches,
                        " rows (one per patch), got ", describe(features));
  } else {
    HEADSCOPE_CHECK_ARG(features.sym_size(0) == patches, op, "features",
                        "must have frames * height * width = ", patches,
                        " rows (one per patch), got ", describe(features));
  }
  HEADSCOPE_CHECK_ARG(features.sym_size(1) >= 1, op, "features",
                      "must have at least one feature column, got ", describe(features));
  HEADSCOPE_CHECK_ARG(num_regions >= 1 && num_regions <= patches, op, "num_regions",
                      "must be in [1, ", frames == 1 ? "height * width" : "frames * height * width",
                      " = ", patches, "], got ", num_regions);
}

[[noreturn]] void fail_region_id(const char* op, int64_t value, int64_t b, int64_t t,
                                 int64_t num_regions) {
  HEADSCOPE_CHECK_ARG(false, op, "region_ids", "must hold values in [-1, num_regions = ",
                      num_regions, "), got ", value, " at [", b, ", ", t, "]");
  std::abort();
}

[[noreturn]] void fail_query_weight(const char* op, double value, int64_t b, int64_t q) {
  HEADSCOPE_CHECK_ARG(false, op, "query_weights",
                      "must hold finite values >= 0, got ", value, " at [", b, ", ", q, "]");
  std::abort();
}

[[noreturn]] void fail_empty_span(const char* op, int64_t b) {
  HEADSCOPE_CHECK_ARG(false, op, "query_weights",
                      "must have a positive sum in every batch row (an empty span has no "
                      "attribution), got all zeros in row ", b);
  std::abort();
}

[[noreturn]] void fail_key_weight(const char* op, const char* arg, double value, int64_t b,
                                  int64_t h, int64_t t) {
  HEADSCOPE_CHECK_ARG(false, op, arg, "must hold finite values, got ", value, " at [", b, ", ",
                      h, ", ", t, "]");
  std::abort();
}

void check_key_weights_values(const char* op, const char* arg, const at::Tensor& key_weights,
                              const at::Tensor& region_ids) {
  if (key_weights.numel() == 0) return;
  const auto bad = at::logical_and(at::logical_not(at::isfinite(key_weights)),
                                   at::ge(region_ids, 0).unsqueeze(1));
  if (!at::any(bad).item<bool>()) return;
  const int64_t flat = at::argmax(bad.flatten().to(at::kInt)).item<int64_t>();
  const int64_t Hw = key_weights.size(1), Tk = key_weights.size(2);
  const int64_t b = flat / (Hw * Tk), h = flat / Tk % Hw, t = flat % Tk;
  fail_key_weight(op, arg, key_weights.select(0, b).select(0, h).select(0, t).item<double>(), b,
                  h, t);
}

void check_region_ids_values(const char* op, const at::Tensor& region_ids, int64_t num_regions) {
  if (region_ids.numel() == 0) return;
  const auto bad = at::logical_or(at::lt(region_ids, -1), at::ge(region_ids, num_regions));
  if (at::any(bad).item<bool>()) {
    const auto flat = at::argmax(bad.flatten().to(at::kInt)).item<int64_t>();
    const int64_t Tk = region_ids.size(1);
    const auto b = flat / Tk, t = flat % Tk;
    fail_region_id(op, region_ids.select(0, b).select(0, t).item<int64_t>(), b, t, num_regions);
  }
}

void check_pool_values(const char* op, const at::Tensor& region_ids, int64_t num_regions,
                       const at::Tensor& query_weights) {
  // One host synchronisation when everything is valid: the three flags travel together;
  // the detailed checks (more syncs) run only to word an error.
  std::vector<at::Tensor> flags;
  if (region_ids.numel() > 0)
    flags.push_back(at::any(at::logical_or(at::lt(region_ids, -1), at::ge(region_ids, num_regions))));
  if (query_weights.size(0) > 0) {
    if (query_weights.size(1) == 0) fail_empty_span(op, 0);
    flags.push_back(at::any(at::logical_or(at::logical_not(at::isfinite(query_weights)),
                                           at::lt(query_weights, 0))));
    flags.push_back(at::any(at::le(at::sum(query_weights, {1}, false, at::kDouble), 0)));
  }
  if (flags.empty()) return;
  if (!at::any(at::stack(flags)).item<bool>()) return;
  check_region_ids_values(op, region_ids, num_regions);
  check_query_weights_values(op, query_weights);
}

void check_query_weights_values(const char* op, const at::Tensor& query_weights) {
  const int64_t B = query_weights.size(0);
  if (B == 0) return;
  const int64_t Tq = query_weights.size(1);
  if (Tq == 0) fail_empty_span(op, 0);
  const auto bad = at::logical_or(at::logical_not(at::isfinite(query_weights)),
                                  at::lt(query_weights, 0));
  if (at::any(bad).item<bool>()) {
    const auto flat = at::argmax(bad.flatten().to(at::kInt)).item<int64_t>();
    const auto b = flat / Tq, q = flat % Tq;
    fail_query_weight(op, query_weights.select(0, b).select(0, q).item<double>(), b, q);
  }
  const auto empty = at::le(at::sum(query_weights, {1}, false, at::kDouble), 0);
  if (at::any(empty).item<bool>())
    fail_empty_span(op, at::argmax(empty.to(at::kInt)).item<int64_t>());
}

}  // namespace headscope::attribution
