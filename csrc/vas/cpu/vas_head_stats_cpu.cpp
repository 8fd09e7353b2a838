// CPU kernels of headscope::vas_head_stats and headscope::vas_head_stats_qk: each call
// runs the phases of vas_head_stats_cpu.h, over whole heads per thread (fused) or over all
// heads with each head split into chunks.
#include "vas/cpu/vas_head_stats_cpu.h"

#include "common/kernel.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>

namespace headscope::vas::cpu {
namespace {

at::Tensor vas_head_stats_cpu(const at::Tensor& attn, const at::Tensor& head_writes,
                              const at::Tensor& lengths, const std::optional<at::Tensor>& offsets) {
  const char* op = "headscope::vas_head_stats";
  check_head_stats_args(attn, head_writes, lengths, offsets);
  const int64_t B = attn.size(0), H = attn.size(1), T = attn.size(2), Dh = head_writes.size(3);
  if (B == 0 || H == 0) return no_heads(op, B, H, T, lengths, offsets, attn.options());
  Problem P;
  setup(P, B, H, T, Dh, lengths, offsets, op);
  alloc_scratch(P, 0);
  const Refine refine = [&](int64_t bh) { attn_exact_row_sums(P, attn, bh); };
  if (P.fused) {
    // every head in one task: one parallel region, each thread taking whole heads through
    // all phases one head at a time, each tile row of A read once from memory and again
    // from cache for its tile pairs
    at::Tensor out = at::empty({B, H, 3}, attn.options().dtype(at::kFloat));
    for_each_head(P, [&](const Range& r) {
      prepare_values(P, head_writes, &r);
      attn_tiles_phase(P, attn, &r, /*rows_too=*/true);
      finalize_into(P, out.data_ptr<float>(), &r, refine);
    });
    return out;
  }
  prepare_values(P, head_writes);
  attn_row_phase(P, attn);
  merge_bad_chunks(P);
  shifts_phase(P);
  attn_tiles_phase(P, attn);
  return finalize(P, attn.options(), refine);
}

at::Tensor vas_head_stats_qk_cpu(const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& head_writes, const at::Tensor& lengths,
                                 std::optional<double> scale, bool causal,
                                 const std::optional<at::Tensor>& offsets,
                                 const std::optional<at::Tensor>& key_padding_mask,
                                 std::optional<int64_t> window, std::optional<int64_t> chunk,
                                 const std::optional<at::Tensor>& block_ids,
                                 std::optional<double> softcap, bool window_bounds_blocks,
                                 const std::optional<at::Tensor>& chunk_origin) {
  const char* op = "headscope::vas_head_stats_qk";
  check_head_stats_qk_args(q, k, head_writes, lengths, scale, offsets, key_padding_mask, window,
                           chunk, block_ids, softcap, chunk_origin);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dh = head_writes.size(3);
  if (B == 0 || H == 0) return no_heads(op, B, H, T, lengths, offsets, q.options());
  Problem P;
  setup(P, B, H, T, Dh, lengths, offsets, op);
  // a tile row of A (HeldRow) with whole heads per thread, else one key block
  alloc_scratch(P, P.fused ? TB * (P.Tp + max_key_blocks(T)) : TB * TB);
  QK Q;
  Q.Hkv = k.size(1);
  Q.D = q.size(3);
  Q.scale = static_cast<float>(scale_or_default(scale, Q.D));
  Q.pat = pattern_rows(B, T, causal, window.value_or(0), chunk.value_or(0), block_ids,
                       key_padding_mask, softcap, window_bounds_blocks, chunk_origin);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  Q.q = at::empty({P.BH, T, Q.D}, f32);
  Q.kt = at::empty({B * Q.Hkv * Q.D * P.Tp + 16}, f32);  // +16: gemm_nn reads past rows
  Q.mrow = at::empty({P.BH, T}, f32);
  Q.izrow = at::empty({P.BH, T}, f32);
  Q.kbad.assign(B * Q.Hkv, 0);
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const auto m = key_padding_mask->contiguous();
    const bool* mp = m.data_ptr<bool>();
    Q.kbias.resize(B * T);
    for (int64_t i = 0; i < B * T; ++i)
      Q.kbias[i] = mp[i] ? -std::numeric_limits<float>::infinity() : 0.0f;
  }
  qk_extents(P, Q);
  qk_prepare(P, Q, q, k);
  if (P.fused) {
    // as the attention op's fused path; each tile row of A is computed once, just before
    // its pairs (only A_JI tiles that the pattern does not leave empty are recomputed)
    at::Tensor out = at::empty({B, H, 3}, q.options().dtype(at::kFloat));
    for_each_head(P, [&](const Range& r) {
      prepare_values(P, head_writes, &r);
      qk_tiles_phase(P, Q, &r, /*rows_too=*/true);
      finalize_into(P, out.data_ptr<float>(), &r);
    });
    return out;
  }
  prepare_values(P, head_writes);
  qk_row_phase(P, Q);
  shifts_phase(P);
  qk_tiles_phase(P, Q);
  return finalize(P, q.options());
}


}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("vas_head_stats", HEADSCOPE_KERNEL("vas_head_stats", vas_head_stats_cpu));
  m.impl("vas_head_stats_qk", HEADSCOPE_KERNEL("vas_head_stats_qk", vas_head_stats_qk_cpu));
}

}  // namespace headscope::vas::cpu
