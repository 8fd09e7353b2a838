// The CPU kernels of vas_head_stats and vas_head_stats_qk: the state one call shares
// between its phases, and the phases.
//
// Per head (b, h) over the window of n positions (vas_math.h), with Vn the row-normalised
// head writes, G = Vn Vn^T, S = (G + 1) / 2 and A the attention (given, or recomputed from
// q and k by the qk op), a call runs
//   setup (vas_head_stats_setup_cpu.cpp): the window of each batch row, the scratch, and
//     per head Vn (or W = Vn - mean(Vn) where the writes are nearly parallel, see
//     prepare_values), ||S||^2, ||Sc||^2 and S's largest row sum from C = W^T W (Dh x Dh):
//     the value Gram is never formed whole;
//   first pass (vas_head_stats_first_pass_cpu.cpp): A's row sums, its diagonal tiles'
//     column sums and where its rows are nonzero (an Extent per 8 rows), one tile row at a
//     time, and from them row and column shifts (set_shifts);
//   tile pass (vas_head_stats_tile_pass_cpu.cpp, vas_head_stats_kl_pair_cpu.cpp): the tile
//     pairs (I, J), (J, I) of A with the Gram formed a 24-row panel at a time, each 8 x 8
//     Gram block serving both tiles (G is symmetric): ||B||^2, <B, G> and the column sums
//     of B = A less the shifts, ||A||^2 and the row KL's sums. Tiles and 8 x 8 blocks where
//     A is all zero (causal masks) are skipped (their sums of B are added in closed form);
//   finalisation (vas_head_stats_finalize_cpu.cpp): ||Ac||^2, <Ac, Sc> and the KL's
//     normalisation in float64 (vas_math.h), A's row sums taken again as hi + lo pairs
//     where ||Ac|| is below 1e-8 ||A||.
// Two schedules (setup picks one): each thread takes whole heads through every phase
// (`fused`: a tile row's first pass runs just before its pairs, while its rows are in
// cache), or, with too few heads to keep the threads busy, every phase runs over all heads
// with each head's tile rows and pairs split into P chunks.
// Extra memory: O(B H T) for row/column sums, O(slots T Dh) for Vn (a slot per thread when
// threads take whole heads, else per head), O(threads (TB^2 + T Dh)) scratch (qk op: also
// a tile row of A, O(threads TB T)).
#pragma once

#include "common/attention_pattern_host.h"
#include "common/cpu_gemm.h"
#include "common/cpu_math.h"
#include "common/cpu_simd.h"
#include "vas/vas_checks.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

namespace headscope::vas::cpu {

constexpr int64_t TB = 128;  // tile edge
// Row stride of a tile in scratch: TB + 8 floats (8.5 cache lines). kl_pair reads A_JI 8
// columns at a time down its 128 rows; at a stride of a multiple of 256 floats those rows
// fall into at most 4 of L1's 64 sets, and from 2048 floats into 8 of L2's 1024, and evict
// each other; at this one they spread over all of them.
constexpr int64_t kLd = TB + 8;
constexpr int64_t kTileFloats = TB * kLd;
constexpr float kTiny = 1e-30f;  // a floor for A's entries in the KL: ratios stay normal

// A strided 4-d tensor of any supported dtype, read as float.
template <typename T>
struct In4 {
  const T* p;
  int64_t s0, s1, s2, s3;
  const T* at(int64_t a, int64_t b, int64_t c) const { return p + a * s0 + b * s1 + c * s2; }
};
template <typename T>
In4<T> in4(const at::Tensor& t) {
  return {t.const_data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

template <typename T>
inline void load(float* dst, const T* src, int64_t n, int64_t stride) {
  if (stride == 1) {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j * stride]);
  }
}

struct Acc {
  // sum a' log2(a' / q) and sum a' (the row KL's parts), <B, G>, ||B||^2 (see PairArgs),
  // ||A||^2
  double kl = 0, ap = 0, ag = 0, ax2 = 0, a2 = 0;
};
constexpr int64_t kParts = 5;  // Acc's sums, as stored per chunk

// Where A may be nonzero: for one 8-row block of the window, the 8-column groups from lo to
// hi (none when lo > hi). Blocks outside are skipped (docs/vas.md, differences).
struct Extent {
  int32_t lo, hi;
  bool hits(int64_t g) const { return lo <= g && g <= hi; }
  bool hits(int64_t g0, int64_t g1) const { return lo <= g1 && g0 <= hi; }  // groups [g0, g1]
};

// Everything the tile pass needs from A, over one tile pair: the row KL, with the value Gram G = Vn_I Vn_J^T formed a panel of rows at a time in L1 and never stored whole
// (each 8 x 8 block serves A_IJ's block and, through an in-register transpose, A_JI's: G
// is symmetric), and the sums of B = A - x 1^T - 1 y^T (x, y: the row and column shifts,
// see set_shifts): sum b^2, <B, G> and B's column sums, b formed as (a - y_col) - x_row;
// and ||A||^2. p and q
// are the reference's clipped, max-row-sum-normalised entries, q = max((g + 1) / 2 / mS, clip);
// the KL is summed without A's normalisation mA (not known before every row is read):
// with a' = max(a, 1e-30), sum_j a' log2(a' / q) and sum_j a', from which
// sum_j p log(p / q) = (ln 2 sum a' log2(a' / q) - ln(mA) sum a') / mA for p = a' / mA. This
// is the reference's p wherever a / mA >= 1e-12; below, where the reference clips p to 1e-12, both
// terms are under 3e-11 (docs/vas.md, differences).
struct PairArgs {
  const float* vi;   // Vn (or W) rows of I (row stride dh), readable zeros up to a multiple
                     // of 8
  const float* vtj;  // Vn^T (or W^T) columns of J (row stride ldv), the same
  int64_t dh, ldv;
  const float* aij;  // A_IJ (row stride lij)
  int64_t lij;
  const float* aji;  // A_JI (row stride lji), nullptr when all zero; == aij when diag
  int64_t lji;
  int64_t ni, nj;
  bool diag;  // I == J: blocks on or below the diagonal, the diagonal block once
  const Extent* ei;  // the nonzero column groups of I's and J's 8-row blocks
  const Extent* ej;
  int64_t gi0, gj0;  // the first column group of I and of J
  float hs;  // 1 / (2 mS)
  const float *evi, *evj;  // e of I's and J's rows: G_ij = g_ij + e_i + e_j (0 with Vn)
  const float *xi, *xj;  // row shifts of I's and J's rows
  const float *yi, *yj;  // column shifts of I's and J's columns
  double *ci, *cj;       // B's column sums over I's and J's columns
};

// A range of tasks to run on the calling thread instead of through at::parallel_for (the
// fused path: one parallel region per call, each thread taking whole heads through every
// phase; thread wake-ups are expensive on small shared machines).
struct Range {
  int64_t begin, end;
};
template <typename F>
void run_range(const Range* only, int64_t n, int64_t grain, const F& f) {
  if (only != nullptr) {
    f(only->begin, only->end);
  } else {
    at::parallel_for(0, n, grain, f);
  }
}

// Everything one call needs, laid out once (scratch from ATen).
struct Problem {
  int64_t B, H, T, T8, Tp, Dh, BH, P, nthreads;  // T8: T rounded up to 8,
                                                  // Tp: Vn^T row stride (see setup)
  std::vector<int64_t> n, s;  // per batch row: window length and start
  // per head
  std::vector<double> msq, Scc, Snorm2;
  std::vector<uint8_t> centred;  // the head's Gram tiles are W W^T (see prepare_values)
  std::vector<double> mS;  // the largest row sum of S (at least 1e-12)
  std::vector<uint8_t> bad;
  at::Tensor vn;      // float [slots, T8, Dh]: Vn of the window rows (zeros after them), or
                      // W = Vn - m for a head with centred Gram tiles
  at::Tensor vnt;     // float [slots, Dh, Tp]: the same, transposed
  at::Tensor adot;    // double [BH, T]: m . Vn_i
  at::Tensor e;       // float [BH, T]: 0, or (centred) e_i = W_i . m + |m|^2 / 2, so that
                      // G_ij = (W W^T)_ij + e_i + e_j
  at::Tensor xrow;    // float [BH, T]: row shifts of the tile pass (see set_shifts)
  at::Tensor ycol;    // float [BH, T]: column shifts of the tile pass
  at::Tensor dcol;    // double [BH, T]: column sums of the diagonal tiles (DiagColumns)
  at::Tensor part;    // double [BH, P, 5]: the sums of Acc
  at::Tensor rsum;    // double [BH, T]: A's row sums (each row has one owner)
  at::Tensor rlo;     // double [BH, T]: their rounding errors where refined (finalize_into)
  at::Tensor colp;    // double [BH, P, T]
  at::Tensor chunkbad;  // uint8 [BH, P]
  at::Tensor ext;       // int32 [BH, T8 / 8, 2]: Extent of each 8-row block of the window
  at::Tensor scratch;   // float [threads, per-thread]
  int64_t scratch_per_thread = 0, scratch_extra = 0;

  bool fused = false;
  int64_t nb(int64_t bh) const { return (n[bh / H] + TB - 1) / TB; }
  // This thread's slot. Modulo: at::parallel_for runs inline (one thread) when called from
  // inside another parallel region, where the thread id may exceed this call's count.
  int64_t thread_slot() const { return at::get_thread_num() % nthreads; }
  float* vn_of(int64_t bh) {
    return vn.data_ptr<float>() + (fused ? thread_slot() : bh) * T8 * Dh;
  }
  float* vnt_of(int64_t bh) {
    return vnt.data_ptr<float>() + (fused ? thread_slot() : bh) * Dh * Tp;
  }
  Extent* ext_of(int64_t bh) {
    return reinterpret_cast<Extent*>(ext.data_ptr<int32_t>()) + bh * (T8 / 8);
  }
  float* thread_scratch() {
    return scratch.data_ptr<float>() + thread_slot() * scratch_per_thread;
  }
  // one converted row of an input, after alloc_scratch's three tiles
  float* row_scratch() { return thread_scratch() + 3 * kTileFloats; }
  float* thread_extra() {  // the op's own part of the scratch (alloc_scratch's `extra`)
    return thread_scratch() + scratch_per_thread - scratch_extra;
  }
};

// The fused path's driver: one parallel region, each thread taking whole heads through
// every phase (head(range), a range of one head), handed out one at a time as threads
// become free (windows differ in length, and a shared machine slows one core now and then).
template <typename F>
void for_each_head(const Problem& P, const F& head) {
  std::atomic<int64_t> next_head{0};
  at::parallel_for(0, P.nthreads, 1, [&](int64_t, int64_t) {
    for (int64_t bh; (bh = next_head.fetch_add(1)) < P.BH;) {
      const Range r{bh, bh + 1};
      head(r);
    }
  });
}

// The qk op's inputs and softmax statistics, from which any tile of A is recomputed.
struct QK {
  at::Tensor q;     // float [BH, T, D]: the window rows of q
  at::Tensor kt;    // float [B * Hkv, D, Tp]: the keys in use ([key_begin, key_end), zeros
                    // before), transposed
  at::Tensor mrow;  // float [BH, T]: softmax row maximum
  at::Tensor izrow; // float [BH, T]: 1 / softmax denominator
  std::vector<uint8_t> kbad;
  // [B, T] with a key padding mask: 0 for a key in use, -inf for padding, added to the
  // logits (padding keys are stored as zeros, so the sum stays -inf); empty without one
  std::vector<float> kbias;
  int64_t Hkv = 1, D = 1;
  float scale = 1;
  PatternRows pat;  // causal, window, chunks, blocks, softcap
  // [B, T]: the keys [klo, khi] window row i of batch row b may see (absolute positions,
  // klo >= 0; none when klo > khi) and its block (qk_extents)
  std::vector<int64_t> klo, khi, kqb;
  // The keys some window row sees: every key of [key_begin, key_end) (window starts never
  // decrease, and the rows' ranges overlap), and with blocks, the keys of a window row's
  // block within that row's range (block_seen).
  int64_t key_begin(const Problem& P, int64_t b) const {
    return std::max<int64_t>(0, pat.row[b].window_start(P.s[b]));
  }
  int64_t key_end(const Problem& P, int64_t b) const {
    return pat.row[b].last_key(P.s[b] + P.n[b] - 1, P.T, -1, -1) + 1;
  }
  // per batch row with blocks: block id -> the lowest first and highest last key of the
  // window rows of that block
  std::vector<std::unordered_map<int64_t, std::pair<int64_t, int64_t>>> block_seen;
  bool seen(const Problem& P, int64_t b, int64_t j) const {
    if (j >= key_begin(P, b) && j < key_end(P, b)) return true;
    if (block_seen.empty()) return false;
    const int64_t id = pat.row[b].block(j);
    const auto it = block_seen[b].find(id);
    return id >= 0 && it != block_seen[b].end() && j >= it->second.first &&
           j <= it->second.second;
  }
  // Window row i's keys among [k0, k0 + nk), as [a, e) from k0 (none when a >= e).
  void row_keys(const Problem& P, int64_t b, int64_t i, int64_t k0, int64_t nk, int64_t& a,
                int64_t& e) const {
    a = std::clamp<int64_t>(klo[b * P.T + i] - k0, 0, nk);
    e = std::clamp<int64_t>(khi[b * P.T + i] + 1 - k0, 0, nk);
  }
  // Logits l[a, e) of window row i against keys k0 + a...: soft-capped, and -inf where the
  // pattern or the padding hides the key.
  void mask_row(const Problem& P, float* l, int64_t b, int64_t i, int64_t k0, int64_t a,
                int64_t e) const {
    pat.apply(pat.row[b], l + a, P.s[b] + i, kqb[b * P.T + i], k0 + a, e - a);
    mask_keys(l + a, b, k0 + a, e - a, P.T);
  }
  bool padded(int64_t b, int64_t j, int64_t T) const {
    return !kbias.empty() && kbias[b * T + j] != 0.0f;
  }
  // Adds the padding bias of keys [j0, j0 + n) to a row of logits.
  void mask_keys(float* l, int64_t b, int64_t j0, int64_t n, int64_t T) const {
    if (kbias.empty()) return;
    const float* kb = kbias.data() + b * T + j0;
    for (int64_t c = 0; c < n; ++c) l[c] += kb[c];
  }
};

inline const float* key_rows(const Problem& P, const QK& Q, int64_t bh) {
  const int64_t b = bh / P.H, h = bh % P.H;
  return Q.kt.data_ptr<float>() + (b * Q.Hkv + h / (P.H / Q.Hkv)) * Q.D * P.Tp;
}

// The key blocks of a window's softmax rows: [0, s) in pieces of TB, then TB at a time from
// the window's start s, so that window tile J is block npre + J.
struct KeyBlocks {
  int64_t s, kend, npre;
  KeyBlocks(int64_t s_, int64_t kend_) : s(s_), kend(kend_), npre((s_ + TB - 1) / TB) {}
  int64_t count() const { return npre + (kend - s + TB - 1) / TB; }
  int64_t begin(int64_t blk) const { return blk < npre ? blk * TB : s + (blk - npre) * TB; }
  int64_t end(int64_t blk) const {
    return blk < npre ? std::min(begin(blk) + TB, s) : std::min(begin(blk) + TB, kend);
  }
};

// The most key blocks a window's rows can have (alloc_scratch's share for qk_row_tile).
inline int64_t max_key_blocks(int64_t T) { return (T + TB - 1) / TB + 1; }

// A tile row of recomputed attention kept for its pairs: e (row stride ld, keys in order)
// holds exp(l - m) per key block, m the row's running max when the block was done (in m,
// row stride mld, one per key block), and 0 on padding keys and past the row's causal keys;
// an entry of A is e * exp(m - M) / Z.
struct HeldRow {
  float* e;
  int64_t ld;
  float* m;
  int64_t mld;
};

// ---- setup (vas_head_stats_setup_cpu.cpp) -------------------------------------------------

// The (B, H, 3) result of a call with no heads (B or H is 0): nothing to compute, but
// lengths / offsets are checked all the same.
at::Tensor no_heads(const char* op, int64_t B, int64_t H, int64_t T, const at::Tensor& lengths,
                    const std::optional<at::Tensor>& offsets, const at::TensorOptions& options);
// The windows, the schedule (P, fused) and the per-call buffers; checks lengths / offsets.
void setup(Problem& P, int64_t B, int64_t H, int64_t T, int64_t Dh, const at::Tensor& lengths,
           const std::optional<at::Tensor>& offsets, const char* op);
// Per-thread scratch: three tiles, a row, W, W^T, C, and `extra` floats for the op.
void alloc_scratch(Problem& P, int64_t extra);
// Vn (or W), m . Vn_i, S's largest row sum, ||S||^2 and ||Sc||^2 of every head (or of
// `only`'s).
void prepare_values(Problem& P, const at::Tensor& head_writes, const Range* only = nullptr);
// The qk op's inputs as float: q's window rows and the keys in use, transposed.
void qk_prepare(Problem& P, QK& Q, const at::Tensor& q, const at::Tensor& k);

// ---- first pass (vas_head_stats_first_pass_cpu.cpp) ---------------------------------------

// The shifts of tile row I (see PairArgs) from its row sums and diagonal column sums.
void set_shifts(Problem& P, int64_t bh, int64_t I);
// set_shifts for every tile row of every head, after the first pass in chunks.
void shifts_phase(Problem& P);
// After the first pass in chunks: a head is bad when one of its chunks met a NaN or an
// infinity.
void merge_bad_chunks(Problem& P);
// The attention op's first pass over tile row I of head bh; false when a row holds a NaN or
// an infinity. row: scratch for one converted row.
bool attn_row_tile(Problem& P, const at::Tensor& attn, int64_t bh, int64_t I, float* row);
// attn_row_tile for every head, chunk p taking every P-th tile row.
void attn_row_phase(Problem& P, const at::Tensor& attn);
// Head bh's row sums of A as hi + lo pairs (finalize_into's refine).
void attn_exact_row_sums(Problem& P, const at::Tensor& attn, int64_t bh);
// The qk op's first pass over tile row I of head bh, one key block at a time with an online
// softmax: the statistics that recompute any tile of the row (row max M, 1 / denominator
// Z), its sums over the window's columns and the column sums of its diagonal tile; with
// `held`, the row itself too, else each block reuses `scratch` (TB x TB).
void qk_row_tile(Problem& P, const QK& Q, int64_t bh, int64_t I, const HeldRow* held,
                 float* scratch);
// qk_row_tile for every head, chunk p taking every P-th tile row.
void qk_row_phase(Problem& P, const QK& Q);
// Each window row's keys (QK::klo, khi, kqb) and from them where the recomputed A may be
// nonzero (the Extent of each 8-row block).
void qk_extents(Problem& P, QK& Q);

// ---- tile pass (vas_head_stats_tile_pass_cpu.cpp, vas_head_stats_kl_pair_cpu.cpp) ---------

// One tile pair's sums into acc (gp: kPanel x TB floats of scratch for the Gram panel).
void kl_pair(const PairArgs& a, float* gp, Acc& acc);
// The tile pass of the attention op (rows_too, with `only` one head: each tile row's first
// pass just before its pairs).
void attn_tiles_phase(Problem& P, const at::Tensor& attn, const Range* only = nullptr,
                      bool rows_too = false);
// The tile pass of the qk op (rows_too: as above, and the tile row of A is held for its
// pairs).
void qk_tiles_phase(Problem& P, const QK& Q, const Range* only = nullptr, bool rows_too = false);

// ---- finalisation (vas_head_stats_finalize_cpu.cpp) ---------------------------------------

// Recomputes head bh's row sums of A as hi + lo pairs (rsum, rlo).
using Refine = std::function<void(int64_t bh)>;
// (d, c, r) of every head (or of `only`'s) into o (B * H * 3 floats).
void finalize_into(Problem& P, float* o, const Range* only = nullptr,
                   const Refine& refine = nullptr);
at::Tensor finalize(Problem& P, const at::TensorOptions& out_opts, const Refine& refine = nullptr);

}  // namespace headscope::vas::cpu
