// CUDA kernels of headscope::vas_head_stats and vas_head_stats_qk: the host side (the
// per-call state, the window checks, the launches) and the ops' registration. The kernels'
// steps are in the headers beside it: prep (vas_head_stats_prep_cuda.cuh), the qk op's rows
// (vas_head_stats_qk_rows_cuda.cuh), the pass and each head's finalisation
// (vas_head_stats_pass_cuda.cuh), over what they share (vas_head_stats_common_cuda.cuh).
//
// Every head of a layer in each launch; A is read once. Per head over its window of n
// positions, with Vn the row-normalised head writes, G = Vn Vn^T, S = (G + 1) / 2:
//   1. prep (grid: 16-row chunks x heads): Vn, stored split into float16 hi/lo parts for the
//      tensor cores (or as float32 when Dh <= 16, see gram_tile), and the NaN/Inf flag.
//   [qk op: rows (grid: 64-row tiles x heads): the softmax statistics of q k^T per row.]
//   2. pass (grid: tile pairs x heads): one block per pair of 64 x 64 tiles (I >= J). It
//      forms G_IJ once on the tensor cores, reads A_IJ and A_JI (G is symmetric), or
//      recomputes them from q and k, and accumulates per head: the KL terms, <A, G>, the
//      centred sum of squares (||A||^2 follows from it), sum G^2, and the row / column sums
//      of A and the row sums of G. The last block of a head to finish evaluates (d, c, r).
// Everything that needs a whole-head quantity before the pass is rewritten to need it
// only after: ||S||, ||Sc|| and <Ac, Sc> from sum G^2 and G's row sums (adot_i = (G 1)_i/n,
// the max row sum of S is (n + max_i (G 1)_i) / 2); the KL from sums whose head constants
// (log of A's and S's max row sums) multiply out (see `Entry`).
// Cross-block sums are float64 atomics, so results can differ between runs in the last
// bits of float32.
#include "common/attention_pattern_host.h"
#include "common/cuda_launch.h"
#include "common/kernel.h"
#include "vas/cuda/vas_head_stats_common_cuda.cuh"
#include "vas/cuda/vas_head_stats_pass_cuda.cuh"
#include "vas/cuda/vas_head_stats_prep_cuda.cuh"
#include "vas/cuda/vas_head_stats_qk_rows_cuda.cuh"
#include "vas/vas_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace headscope::vas::cuda {
namespace {

// ---- host side ------------------------------------------------------------------------------

// What a Heads points into: contiguous lengths / offsets and the scratch buffers.
struct Scratch {
  at::Tensor len, off, v, f32, f64, i32;
};

Heads make_heads(int64_t B, int64_t H, int64_t T, int64_t Dh, const at::Tensor& lengths,
                 const std::optional<at::Tensor>& offsets, bool qk, Scratch& sc,
                 const at::TensorOptions& opts) {
  Heads P{};
  P.B = B;
  P.H = H;
  P.T = T;
  P.Dh = Dh;
  P.T64 = (T + kTile - 1) / kTile * kTile;
  P.Dh16 = (Dh + 15) / 16 * 16;
  const int64_t BH = B * H;
  sc.len = lengths.contiguous();
  P.len = sc.len.data_ptr<int64_t>();
  if (offsets.has_value() && offsets->defined()) {
    sc.off = offsets->contiguous();
    P.off = sc.off.data_ptr<int64_t>();
  }
  if (Dh <= kExactDh) {
    sc.v = at::empty({BH, P.T64, 16}, opts.dtype(at::kFloat));
    P.vf = sc.v.data_ptr<float>();
  } else {
    sc.v = at::empty({2, BH, P.T64, P.Dh16}, opts.dtype(at::kHalf));
    P.vs = reinterpret_cast<__half*>(sc.v.data_ptr<at::Half>());
  }
  if (qk) {
    sc.f32 = at::empty({2 * BH * T}, opts.dtype(at::kFloat));
    P.mrow = sc.f32.data_ptr<float>();
    P.izrow = P.mrow + BH * T;
  }
  sc.f64 = at::zeros({BH * (3 * T + kSlots * kAccs)}, opts.dtype(at::kDouble));
  P.rows = sc.f64.data_ptr<double>();
  P.cols = P.rows + BH * T;
  P.grow = P.cols + BH * T;
  P.acc = P.grow + BH * T;
  sc.i32 = at::zeros({BH * (kSlots + 2)}, opts.dtype(at::kInt));
  P.bad = sc.i32.data_ptr<int>();
  P.done = P.bad + BH;
  return P;
}

// Validates lengths / offsets (one small device-to-host copy) and returns the window starts
// (for the alignment of A's rows). While the stream is captured into a CUDA graph that copy
// is not allowed: nothing is checked (the kernels clamp each window into [0, T), so bad
// values give wrong numbers, never reads out of bounds) and the starts are unknown.
std::optional<std::vector<int64_t>> check_windows_on_host(const char* op,
                                                          const at::Tensor& lengths,
                                                          const std::optional<at::Tensor>& offsets,
                                                          int64_t T) {
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
    return std::nullopt;
  const auto len_cpu = lengths.cpu();
  at::Tensor off_cpu;
  const bool has_off = offsets.has_value() && offsets->defined();
  if (has_off) off_cpu = offsets->cpu();
  check_window_values(op, len_cpu, has_off ? &off_cpu : nullptr, T);
  std::vector<int64_t> starts(len_cpu.numel(), 0);
  if (has_off) {
    const auto l = len_cpu.contiguous(), o = off_cpu.contiguous();
    for (int64_t b = 0; b < l.numel(); ++b)
      starts[b] = window_start(o.data_ptr<int64_t>()[b], window_len(l.data_ptr<int64_t>()[b], T), T);
  }
  return starts;
}

template <typename K>
void set_smem(K kernel, size_t bytes) {
  TORCH_CHECK(cuda_launch::try_enable_smem(reinterpret_cast<const void*>(kernel), bytes),
              "headscope::vas: a CUDA kernel needs ", bytes,
              " bytes of shared memory per block, more than this GPU allows");
}

void launch_prep(const Heads& P, const at::Tensor& hw, cudaStream_t stream) {
  TORCH_CHECK(P.Dh <= 2048, "headscope::vas: CUDA kernels support head_writes with Dh <= 2048, got ", P.Dh);
  const dim3 grid(static_cast<unsigned>(P.T64 / kPrepRows), static_cast<unsigned>(P.B * P.H));
  const size_t smem = sizeof(float) * kPrepRows * P.Dh;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hw.scalar_type(), "vas_prep", [&] {
    auto run = [&](auto kernel) {
      set_smem(kernel, smem);
      kernel<<<grid, kThreads, smem, stream>>>(P, hw.const_data_ptr<scalar_t>(), strides4(hw));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (P.Dh <= kExactDh) run(prep_kernel<scalar_t, true>);
    else run(prep_kernel<scalar_t, false>);
  });
}

dim3 pass_grid(const Heads& P) {
  const int64_t nt = P.T64 / kTile;
  TORCH_CHECK(P.B * P.H <= 65535, "headscope::vas: CUDA kernels support B * H <= 65535, got ", P.B * P.H);
  return dim3(static_cast<unsigned>(nt * (nt + 1) / 2), static_cast<unsigned>(P.B * P.H));
}

at::Tensor vas_head_stats_cuda(const at::Tensor& attn, const at::Tensor& head_writes,
                               const at::Tensor& lengths, const std::optional<at::Tensor>& offsets) {
  const char* op = "headscope::vas_head_stats";
  check_head_stats_args(attn, head_writes, lengths, offsets);
  const c10::cuda::CUDAGuard guard(attn.device());
  const int64_t B = attn.size(0), H = attn.size(1), T = attn.size(2), Dh = head_writes.size(3);
  at::Tensor out = at::empty({B, H, 3}, attn.options().dtype(at::kFloat));
  const auto starts = check_windows_on_host(op, lengths, offsets, T);
  if (B == 0 || H == 0) return out;
  Scratch sc;
  const Heads P = make_heads(B, H, T, Dh, lengths, offsets, false, sc, attn.options());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  launch_prep(P, head_writes, stream);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "vas_pass", [&] {
    using Tiles = ATiles<scalar_t>;
    const int64_t es = sizeof(scalar_t);
    bool vec = attn.stride(3) == 1 && reinterpret_cast<uintptr_t>(attn.const_data_ptr()) % 16 == 0 &&
               (attn.stride(0) * es) % 16 == 0 && (attn.stride(1) * es) % 16 == 0 &&
               (attn.stride(2) * es) % 16 == 0;
    // unknown starts (graph capture): aligned only without offsets (every start is 0)
    if (starts) {
      for (const int64_t s : *starts) vec = vec && (s * es) % 16 == 0;
    } else {
      vec = vec && !(offsets.has_value() && offsets->defined());
    }
    const size_t smem = kVBytes + Tiles::bytes;
    auto run = [&](auto kernel) {
      set_smem(kernel, smem);
      kernel<<<pass_grid(P), kThreads, smem, stream>>>(P, attn.const_data_ptr<scalar_t>(),
                                                       strides4(attn), vec, out.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (Dh <= kExactDh) run(attn_pass_kernel<scalar_t, true>);
    else run(attn_pass_kernel<scalar_t, false>);
  });
  return out;
}

at::Tensor vas_head_stats_qk_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                  const at::Tensor& head_writes, const at::Tensor& lengths,
                                  std::optional<double> scale, bool causal,
                                  const std::optional<at::Tensor>& offsets,
                                  const std::optional<at::Tensor>& key_padding_mask,
                                  std::optional<int64_t> window, std::optional<int64_t> chunk,
                                  const std::optional<at::Tensor>& block_ids,
                                  std::optional<double> softcap, bool window_bounds_blocks,
                                  const std::optional<at::Tensor>& chunk_origin) {
  const char* op = "headscope::vas_head_stats_qk";
  check_head_stats_qk_args(q_in, k_in, head_writes, lengths, scale, offsets, key_padding_mask,
                           window, chunk, block_ids, softcap, chunk_origin);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t B = q_in.size(0), H = q_in.size(1), T = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Dh = head_writes.size(3);
  at::Tensor out = at::empty({B, H, 3}, q_in.options().dtype(at::kFloat));
  check_windows_on_host(op, lengths, offsets, T);
  if (B == 0 || H == 0) return out;
  // q and k in one dtype, one that holds both exactly (a copy only for mixed-dtype calls)
  const auto common = c10::promoteTypes(q_in.scalar_type(), k_in.scalar_type());
  const at::Tensor q = q_in.scalar_type() == common ? q_in : q_in.to(common);
  const at::Tensor k = k_in.scalar_type() == common ? k_in : k_in.to(common);
  const at::Tensor kpm = key_padding_mask.has_value() && key_padding_mask->defined()
                             ? key_padding_mask->contiguous()
                             : at::Tensor();
  const bool* kpm_ptr = kpm.defined() ? kpm.const_data_ptr<bool>() : nullptr;
  BatchPattern pat;
  pat.row0 = AttentionPattern{causal, window.value_or(0), chunk.value_or(0), 0, nullptr, 1,
                              window_bounds_blocks};
  if (block_ids.has_value() && block_ids->defined()) {
    pat.row0.blocks = block_ids->const_data_ptr<int64_t>();
    pat.row0.bstride = block_ids->stride(1);
    pat.bstride0 = block_ids->stride(0);
  }
  pat.softcap = softcap.value_or(0.0);
  const at::Tensor origin = pat.row0.chunk > 0 ? chunk_origins(chunk_origin, kpm) : at::Tensor();
  if (origin.defined()) pat.origin = origin.const_data_ptr<int64_t>();
  Scratch sc;
  const Heads P = make_heads(B, H, T, Dh, lengths, offsets, true, sc, q.options());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float fscale = static_cast<float>(scale_or_default(scale, D));
  launch_prep(P, head_writes, stream);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "vas_qk", [&] {
    const scalar_t* qp = q.const_data_ptr<scalar_t>();
    const scalar_t* kp = k.const_data_ptr<scalar_t>();
    const size_t panels = 2 * kTile * kXld * sizeof(float);
    const size_t rows_smem = panels + 2 * kTile * 2 * sizeof(float);
    set_smem(qk_rows_kernel<scalar_t>, rows_smem);
    qk_rows_kernel<scalar_t><<<dim3(static_cast<unsigned>(P.T64 / kTile), static_cast<unsigned>(B * H)),
                               kThreads, rows_smem, stream>>>(P, qp, strides4(q), kp, strides4(k),
                                                              Hkv, D, fscale, pat, kpm_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const size_t smem = kVBytes + panels;
    auto run = [&](auto kernel) {
      set_smem(kernel, smem);
      kernel<<<pass_grid(P), kThreads, smem, stream>>>(P, qp, strides4(q), kp, strides4(k), Hkv, D,
                                                       fscale, pat, kpm_ptr,
                                                       out.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (Dh <= kExactDh) run(qk_pass_kernel<scalar_t, true>);
    else run(qk_pass_kernel<scalar_t, false>);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CUDA, m) {
  m.impl("vas_head_stats", HEADSCOPE_KERNEL("vas_head_stats", vas_head_stats_cuda));
  m.impl("vas_head_stats_qk", HEADSCOPE_KERNEL("vas_head_stats_qk", vas_head_stats_qk_cuda));
}

}  // namespace headscope::vas::cuda
