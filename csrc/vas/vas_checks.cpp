#include "vas/vas_checks.h"

#include "common/checks.h"

#include <c10/core/ScalarType.h>

#include <cmath>

namespace headscope::vas {
namespace {

constexpr auto kF32 = at::kFloat;
constexpr auto kF16 = at::kHalf;
constexpr auto kBF16 = at::kBFloat16;

void check_lengths_offsets(const char* op, const at::Tensor& ref, const char* ref_name,
                           const at::Tensor& lengths, const std::optional<at::Tensor>& offsets) {
  check_dtype_in(op, "lengths", lengths, {at::kLong});
  check_dim(op, "lengths", lengths, 1);
  check_same_size(op, ref_name, ref, 0, "lengths", lengths, 0);
  check_same_device(op, ref_name, ref, "lengths", lengths);
  if (offsets.has_value() && offsets->defined()) {
    check_dtype_in(op, "offsets", *offsets, {at::kLong});
    check_dim(op, "offsets", *offsets, 1);
    check_same_size(op, ref_name, ref, 0, "offsets", *offsets, 0);
    check_same_device(op, ref_name, ref, "offsets", *offsets);
  }
}

void check_head_writes(const char* op, const at::Tensor& ref, const char* ref_name,
                       const at::Tensor& head_writes) {
  check_dtype_in(op, "head_writes", head_writes, {kF32, kF16, kBF16});
  check_dim(op, "head_writes", head_writes, 4);
  check_same_device(op, ref_name, ref, "head_writes", head_writes);
  check_same_size(op, ref_name, ref, 0, "head_writes", head_writes, 0);
  check_same_size(op, ref_name, ref, 1, "head_writes", head_writes, 1);
  check_same_size(op, ref_name, ref, 2, "head_writes", head_writes, 2);
  HEADSCOPE_CHECK_ARG(head_writes.sym_size(3) >= 1, op, "head_writes",
                      "must have a head dimension Dh >= 1, got ", describe(head_writes));
}

}  // namespace

void check_head_stats_args(const at::Tensor& attn, const at::Tensor& head_writes,
                           const at::Tensor& lengths, const std::optional<at::Tensor>& offsets) {
  const char* op = "headscope::vas_head_stats";
  check_dtype_in(op, "attn", attn, {kF32, kF16, kBF16});
  check_dim(op, "attn", attn, 4);
  HEADSCOPE_CHECK_ARG(attn.sym_size(2) == attn.sym_size(3), op, "attn",
                      "must be square in its last two dimensions (B, H, T, T), got ",
                      describe(attn));
  HEADSCOPE_CHECK_ARG(attn.sym_size(3) >= 1, op, "attn",
                      "must have at least one position (T >= 1), got ", describe(attn));
  check_head_writes(op, attn, "attn", head_writes);
  check_lengths_offsets(op, attn, "attn", lengths, offsets);
}

void check_head_stats_qk_args(const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& head_writes, const at::Tensor& lengths,
                              const std::optional<double>& scale,
                              const std::optional<at::Tensor>& offsets,
                              const std::optional<at::Tensor>& key_padding_mask,
                              const std::optional<int64_t>& window,
                              const std::optional<int64_t>& chunk,
                              const std::optional<at::Tensor>& block_ids,
                              const std::optional<double>& softcap,
                              const std::optional<at::Tensor>& chunk_origin) {
  const char* op = "headscope::vas_head_stats_qk";
  check_dtype_in(op, "q", q, {kF32, kF16, kBF16});
  check_dim(op, "q", q, 4);
  HEADSCOPE_CHECK_ARG(q.sym_size(2) >= 1, op, "q",
                      "must have at least one position (T >= 1), got ", describe(q));
  HEADSCOPE_CHECK_ARG(q.sym_size(3) >= 1, op, "q", "must have a head dimension D >= 1, got ",
                      describe(q));
  check_dtype_in(op, "k", k, {kF32, kF16, kBF16});
  check_dim(op, "k", k, 4);
  check_same_device(op, "q", q, "k", k);
  check_same_size(op, "q", q, 0, "k", k, 0);
  check_same_size(op, "q", q, 2, "k", k, 2);
  check_same_size(op, "q", q, 3, "k", k, 3);
  const auto H = q.sym_size(1);
  const auto Hkv = k.sym_size(1);
  HEADSCOPE_CHECK_ARG(Hkv >= 1 && (H % Hkv) == 0, op, "k",
                      "must have a number of key/value heads that divides the ", H,
                      " query heads of 'q' (grouped-query attention), got ", describe(k));
  check_scale(op, scale);
  check_head_writes(op, q, "q", head_writes);
  check_lengths_offsets(op, q, "q", lengths, offsets);
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const auto& m = *key_padding_mask;
    check_dtype_in(op, "key_padding_mask", m, {at::kBool});
    check_dim(op, "key_padding_mask", m, 2);
    check_same_device(op, "q", q, "key_padding_mask", m);
    check_same_size(op, "q", q, 0, "key_padding_mask", m, 0);
    check_same_size(op, "k", k, 2, "key_padding_mask", m, 1);
  }
  check_pattern(op, q, "q", k, "k", 2, window, chunk, block_ids, softcap);
  check_chunk_origin(op, q, "q", chunk_origin, chunk.value_or(0) > 0);
}

void check_aggregate_args(const at::Tensor& head_stats) {
  const char* op = "headscope::vas_aggregate";
  check_dtype_in(op, "head_stats", head_stats, {kF32, at::kDouble});
  check_dim(op, "head_stats", head_stats, 4);
  HEADSCOPE_CHECK_ARG(head_stats.sym_size(3) == 3, op, "head_stats",
                      "must have shape (B, L, H, 3) with the three stats (d, c, r) last, got ",
                      describe(head_stats));
  HEADSCOPE_CHECK_ARG(head_stats.sym_size(1) >= 1 && head_stats.sym_size(2) >= 1, op,
                      "head_stats", "must have at least one layer and one head, got ",
                      describe(head_stats));
}

void check_window_values(const char* op, const at::Tensor& lengths_cpu,
                         const at::Tensor* offsets_cpu, int64_t T) {
  const auto len = lengths_cpu.contiguous();
  const int64_t* l = len.data_ptr<int64_t>();
  at::Tensor off;
  const int64_t* o = nullptr;
  if (offsets_cpu != nullptr) {
    off = offsets_cpu->contiguous();
    o = off.data_ptr<int64_t>();
  }
  for (int64_t b = 0; b < len.numel(); ++b) {
    HEADSCOPE_CHECK_ARG(l[b] >= 0 && l[b] <= T, op, "lengths",
                        "must hold numbers of valid tokens in [0, T=", T, "], got lengths[", b,
                        "] = ", l[b]);
    if (o != nullptr) {
      HEADSCOPE_CHECK_ARG(o[b] >= 0 && o[b] + l[b] <= T, op, "offsets",
                          "must hold first valid positions with 0 <= offsets[b] and "
                          "offsets[b] + lengths[b] <= T=", T, ", got offsets[", b, "] = ", o[b],
                          " with lengths[", b, "] = ", l[b]);
    }
  }
}

}  // namespace headscope::vas
