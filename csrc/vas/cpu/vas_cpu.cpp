// CPU kernels of headscope::vas_head_stats and headscope::vas_head_stats_qk.
//
// Per head (b, h) over the window of n positions (see vas_checks.h), with Vn the
// row-normalised head writes, G = Vn Vn^T, S = (G + 1) / 2, A the attention:
//   ||S||^2, ||Sc||^2 and S's row sums come from u = sum_i Vn_i and C = W^T W (Dh x Dh),
//   W = Vn - mean(Vn), so the value Gram is never formed whole; heads whose writes are
//   nearly parallel (||Sc|| < 0.1 ||S||) form their Gram tiles from W instead of Vn
//   (W W^T = H G H keeps the digits that G, close to 1 everywhere, rounds away) and
//   rebuild G_ij = (W W^T)_ij + e_i + e_j from them for the KL (e_i = W_i . m + |m|^2 / 2);
//   phase 1 takes A's row sums, its diagonal tiles' column sums and where its rows are
//   nonzero (an Extent per 8 rows), one tile row at a time (in the fused path just before
//   that row's pairs), and from them row and column shifts (set_shifts); phase 2 visits
//   the tile pairs (I, J), (J, I) of A with the Gram formed a 24-row panel at a time, each
//   8 x 8 Gram block serving both tiles (G is symmetric), and accumulates ||B||^2, <B, G>
//   and the column sums of B = A less the shifts (close to the centred Ac, so that small
//   centred statistics are not differences of large sums), ||A||^2 and the row KL's sums;
//   ||Ac||^2, <Ac, Sc> and the KL's normalisation follow in float64 (A's row sums taken
//   again as hi + lo pairs where ||Ac|| is below 1e-8 ||A||, see finalize_into). Tiles and
//   8 x 8 blocks where A is all zero (causal masks) are skipped (their sums of B are added
//   in closed form).
// The qk op recomputes A: qk_row_tile forms a tile row of it (all the row's keys, for the
//   softmax) in a per-thread buffer; with whole heads per thread its pairs read their A_IJ
//   tiles there, and only A_JI tiles (no causal mask) are recomputed from the rows' max and
//   normaliser; with heads split into chunks every tile is recomputed.
// Extra memory: O(B H T) for row/column sums, O(slots T Dh) for Vn (a slot per thread when
// threads take whole heads, else per head), O(threads (TB^2 + T Dh)) scratch (qk op: also
// a tile row of A, O(threads TB T)).
#include "vas/cpu/vas_cpu_math.h"
#include "vas/vas_checks.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstring>
#include <functional>
#include <vector>

namespace headscope::vas {
namespace {

using cpu::f8;
using cpu::gemm_nn;
using cpu::log2_8_pos;

constexpr int64_t TB = 128;  // tile edge
// Row stride of a tile in scratch: TB + 8 floats (8.5 cache lines). kl_pair reads A_JI 8
// columns at a time down its 128 rows; at a stride of a multiple of 256 floats those rows
// fall into at most 4 of L1's 64 sets, and from 2048 floats into 8 of L2's 1024, and evict
// each other; at this one they spread over all of them (a dense head at T = 2048: 18%
// faster; T = 512: no change measured).
constexpr int64_t kLd = TB + 8;
constexpr int64_t kTileFloats = TB * kLd;
constexpr double kClip = 1e-12;
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

// Loads lanes [0, n) of a row (the rest 0).
inline f8 load_part(const float* p, int64_t n) {
  f8 v = {};
  if (n >= 8) {
    std::memcpy(&v, p, sizeof v);
  } else {
    for (int64_t k = 0; k < n; ++k) v[k] = p[k];
  }
  return v;
}

// f(v, j) for each 8 floats v of x[0, n), j their first column (the last ones zero past n).
template <typename F>
inline void for_each8(const float* x, int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    f8 v;
    std::memcpy(&v, x + j, sizeof v);
    f(v, j);
  }
  if (j < n) f(load_part(x + j, n - j), j);
}

// Whether one of 8 floats is nonzero (or NaN).
inline bool any_nonzero(f8 v) {
  const auto nz = v != 0.0f;
#if defined(__AVX__)
  return _mm256_movemask_ps(reinterpret_cast<__m256>(nz)) != 0;
#else
  for (int k = 0; k < 8; ++k)
    if (nz[k]) return true;
  return false;
#endif
}

// Row sums of A are taken in double lanes: B's row sums r_i - n x_i - sum(y) (finalize) are
// small where B is near Ac, and a float sum's rounding (~1e-7 r_i) would be most of them (c
// was off by 0.5% in a head with ||Ac|| = 2e-5 ||A||).
typedef double d4 __attribute__((vector_size(32)));
inline d4 lo4(f8 v) {
  return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), d4);
}
inline d4 hi4(f8 v) {
  return __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), d4);
}

// s + e = s + v exactly (TwoSum: e collects the addition's rounding error).
template <typename T>
inline void two_sum(T& s, T& e, T v) {
  const T t = s + v, bv = t - s;
  e += (s - (t - bv)) + (v - bv);
  s = t;
}

// The sum of n floats in double lanes. kGroups (n <= 256): also, in `groups`, bit g set when
// columns [8 g, 8 g + 8) hold a nonzero (or NaN).
template <bool kGroups>
inline double sum_f64(const float* x, int64_t n, uint32_t* groups = nullptr) {
  d4 s[2] = {};
  uint32_t mask = 0;
  for_each8(x, n, [&](f8 v, int64_t j) {
    s[0] += lo4(v);
    s[1] += hi4(v);
    if constexpr (kGroups) mask |= static_cast<uint32_t>(any_nonzero(v)) << (j / 8);
  });
  if constexpr (kGroups) *groups = mask;
  const d4 t = s[0] + s[1];
  return (t[0] + t[1]) + (t[2] + t[3]);
}

// The sum of n floats as hi + lo (double lanes, TwoSum): a row that is one key's weight plus
// entries 1e-16 of it and less (an attention sink's one-hot rows) loses those entries in a
// plain double sum, and with them c (10x off at ||Ac|| = 3e-17 ||A||, where the exact c is
// 4e-6). Seven additions for each of sum_f64's one (the op took 4-6% longer with it in
// every first pass): taken only for heads that need it (finalize_into's refine).
inline void sum_f64_exact(const float* x, int64_t n, double& hi, double& lo) {
  d4 s[2] = {}, e[2] = {};
  for_each8(x, n, [&](f8 v, int64_t) {
    two_sum(s[0], e[0], lo4(v));
    two_sum(s[1], e[1], hi4(v));
  });
  hi = lo = 0;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      two_sum(hi, lo, s[h][k]);
      lo += e[h][k];
    }
}

// Whether n floats are all finite: x - x is 0 for a finite x, NaN for an infinity or a NaN.
inline bool all_finite(const float* x, int64_t n) {
  f8 acc = {};
  for_each8(x, n, [&](f8 v, int64_t) { acc += v - v; });
  float t = 0;
  for (int k = 0; k < 8; ++k) t += acc[k];
  return t == 0.0f;
}

// NumPy's pairwise summation of float32 values (what np.linalg.norm uses): the seed's row
// norms, reproduced bit for bit so that Vn (and Gram entries near -1, where S ~ 0 and
// the KL's logarithm is sensitive) match the seed's.
inline float numpy_pairwise_sum(const float* a, int64_t n) {
  if (n < 8) {
    float res = 0.0f;
    for (int64_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    float r[8];
    for (int k = 0; k < 8; ++k) r[k] = a[k];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int k = 0; k < 8; ++k) r[k] += a[i + k];
    float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return numpy_pairwise_sum(a, n2) + numpy_pairwise_sum(a + n2, n - n2);
}

// Dot product in 8 float lanes, summed in double.
inline double dot8(const float* x, const float* y, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) s[k] += x[j + k] * y[j + k];
  double d = 0;
  for (; j < n; ++j) d += static_cast<double>(x[j]) * y[j];
  for (int k = 0; k < 8; ++k) d += s[k];
  return d;
}

struct Acc {
  // sum a' log2(a' / q) and sum a' (the row KL's parts), <B, G>, ||B||^2 (see PairArgs),
  // ||A||^2
  double kl = 0, ap = 0, ag = 0, ax2 = 0, a2 = 0;
};
constexpr int64_t kParts = 5;  // Acc's sums, as stored per chunk

// 8-lane float sums to double, per row: the tiles' rows are short enough (<= TB) that the
// float partial sums keep the 1e-4 target with room to spare.
inline double hsum(f8 v) {
  double d = 0;
  for (int k = 0; k < 8; ++k) d += v[k];
  return d;
}

// The sums over a tile row's rows of its diagonal tile's columns (Problem::dcol), from
// which set_shifts takes the column shifts.
struct DiagColumns {
  float sum[TB] = {};
  void add_row(const float* a, int64_t cols) {  // a: the row's diagonal-tile piece
    for (int64_t c = 0; c < cols; ++c) sum[c] += a[c];
  }
  void store(double* dcol, int64_t cols) const { std::copy(sum, sum + cols, dcol); }
};

// Lanes [0, n) set, for the last partial vector of a row.
inline f8 lane_mask(int64_t n) {
  f8 m;
  for (int k = 0; k < 8; ++k) m[k] = k < n ? 1.0f : 0.0f;
  return m;
}

// A tile of zeros in A (rows x cols, row shifts x, column shifts y): its entries of B,
// -(x_r + y_c), into ||B||^2 (ax2) and B's column sums (colsum), in closed form. Zero tiles
// and blocks are skipped: their KL terms, p log(p / q) with p at the clip, are under 3e-11
// each and left out (README.md, "Deliberate differences"); <B, G> needs G (kl_pair,
// zero_tile).
inline void zero_sums(const float* x, int64_t rows, const float* y, int64_t cols, double& ax2,
                      double* colsum) {
  double sx = 0, sx2 = 0, sy = 0, sy2 = 0;
  for (int64_t r = 0; r < rows; ++r) {
    sx += x[r];
    sx2 += static_cast<double>(x[r]) * x[r];
  }
  for (int64_t c = 0; c < cols; ++c) {
    sy += y[c];
    sy2 += static_cast<double>(y[c]) * y[c];
    colsum[c] -= sx + static_cast<double>(rows) * y[c];
  }
  ax2 += static_cast<double>(cols) * sx2 + static_cast<double>(rows) * sy2 + 2.0 * sx * sy;
}

// Where A may be nonzero: for one 8-row block of the window, the 8-column groups from lo to
// hi (none when lo > hi). Blocks outside are skipped (README.md, "Deliberate differences").
struct Extent {
  int32_t lo, hi;
  bool hits(int64_t g) const { return lo <= g && g <= hi; }
  bool hits(int64_t g0, int64_t g1) const { return lo <= g1 && g0 <= hi; }  // groups [g0, g1]
};

// Everything phase 2 needs from A, over one tile pair: the row KL, with the
// value Gram G = Vn_I Vn_J^T formed a panel of rows at a time in L1 and never stored whole
// (each 8 x 8 block serves A_IJ's block and, through an in-register transpose, A_JI's: G
// is symmetric), and the sums of B = A - x 1^T - 1 y^T (x, y: the row and column shifts,
// see set_shifts): sum b^2, <B, G> and B's column sums, b formed as (a - y_col) - x_row;
// and ||A||^2. p and q
// are the seed's clipped, max-row-sum-normalised entries, q = max((g + 1) / 2 / mS, clip);
// the KL is summed without A's normalisation mA (not known before every row is read):
// with a' = max(a, 1e-30), sum_j a' log2(a' / q) and sum_j a', from which
// sum_j p log(p / q) = (ln 2 sum a' log2(a' / q) - ln(mA) sum a') / mA for p = a' / mA. This
// is the seed's p wherever a / mA >= 1e-12; below, where the seed clips p to 1e-12, both
// terms are under 3e-11 (README.md, "Deliberate differences").
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

constexpr int64_t kPanel = 24;  // Gram rows per panel: four 6 x 16 blocks of gemm_nn

// Lane-wise max (vmaxps where available: one instruction instead of compare and blend;
// the operands here are never NaN).
inline f8 max8(f8 a, f8 b) {
#if defined(__AVX__)
  return __builtin_ia32_maxps256(a, b);
#else
  return a < b ? b : a;
#endif
}

// The running sums of kl_pair over one 8-row strip, in float lanes.
struct StripSums {
  f8 hs;  // 1 / (2 mS)
  f8 kl = {}, ap = {}, ag = {}, ax2 = {}, a2 = {};

  // hs (e_i + e_j + 1): q = hs g_ij + this is the seed's S_ij / mS before its clip
  f8 q_offsets(float e_row, f8 e_cols) const { return (e_cols + e_row) * hs + hs; }

  // One row piece of A against its Gram values gv (Vn Vn^T or W W^T; row shift x, column
  // shifts y; qo: q_offsets); returns its b. kMasked (a tile's edge): keep is 1 in the lanes inside the
  // tile (A is 0 and G finite outside), which alone count.
  template <bool kMasked>
  f8 entry(f8 av, f8 gv, f8 qo, float x, f8 y, f8 keep) {
    const f8 a1 = max8(av, f8{} + kTiny);                   // a'
    const f8 q = max8(gv * hs + qo, f8{} + static_cast<float>(kClip));  // the seed's q
    const f8 t = a1 * log2_8_pos(a1 / q);
    f8 d = (av - y) - x;
    if constexpr (kMasked) {
      d *= keep;
      kl += keep > f8{} ? t : f8{};
      ap += a1 * keep;
    } else {
      kl += t;
      ap += a1;
    }
    ag += d * gv;
    ax2 += d * d;
    a2 += av * av;  // ||A||^2 (A is 0 outside a tile's edge)
    return d;
  }

  // A block of zeros in A, nx rows (shifts x in lanes, 0 past nx) by ny columns (shifts y,
  // 0 past ny): its b = -(x_r + y_c) into ||B||^2; returns its column sums (0 past ny).
  f8 zero_sums(f8 x, int64_t nx, f8 y, int64_t ny) {
    const float sx = hsum(x), nr = static_cast<float>(nx);
    ax2 += x * x * static_cast<float>(ny) + y * y * nr + 2.0f * sx * y;
    const f8 col = -(sx + nr * y);
    return ny == 8 ? col : col * lane_mask(ny);
  }

  // <B, g> over a block of zeros (g: its Gram rows r, stride TB, columns c in lanes):
  // -sum_rc (w_r + v_c) g_rc. A_IJ's block: w = its row shifts x, v = its column shifts y.
  // A_JI's, which g serves transposed (entry (jb + c, ib + r) has G_(ib + r)(jb + c)):
  // w = its column shifts, v = its row shifts.
  void zero_gram(f8 w, f8 v, int64_t rows, const float* g) {
    f8 gs = {}, gw = {};  // sum_r G_r, sum_r w_r G_r
    for (int64_t r = 0; r < rows; ++r) {
      f8 gv;
      std::memcpy(&gv, g + r * TB, sizeof gv);
      gs += gv;
      gw += w[r] * gv;
    }
    ag -= gw + gs * v;
  }
};

// One 8 x 8 Gram block (rows ib.., columns jb.. of the pair; g: its rows, stride TB)
// against A_IJ's block and, when `upper`, A_JI's (through the block transposed in
// registers). A block that is not live is zero: its b = -(x + y) go into the sums in
// closed form, <B, g> through the Gram block's row and column sums.
// kFull: a whole 8 x 8 block (no edge): plain loads, no masks.
template <bool kFull>
inline void block8(const PairArgs& a, const float* g, int64_t ib, int64_t jb, int64_t rows,
                   int64_t cols, bool live_ij, bool upper, bool live_ji, StripSums& st,
                   f8& col_i) {
  const f8 yj = load_part(a.yj + jb, kFull ? 8 : cols);
  if (live_ij) {
    const f8 keep_cols = kFull ? f8{} : lane_mask(cols);
    const f8 ej = load_part(a.evj + jb, kFull ? 8 : cols);
    f8 col_j = {};
    for (int64_t r = 0; r < (kFull ? 8 : rows); ++r) {
      const float* ar = a.aij + (ib + r) * a.lij + jb;
      f8 av, gv;
      if constexpr (kFull) {
        std::memcpy(&av, ar, sizeof av);
      } else {
        av = load_part(ar, cols);
      }
      std::memcpy(&gv, g + r * TB, sizeof gv);
      col_j += st.entry<!kFull>(av, gv, st.q_offsets(a.evi[ib + r], ej), a.xi[ib + r], yj,
                                keep_cols);
    }
    for (int64_t k = 0; k < (kFull ? 8 : cols); ++k) a.cj[jb + k] += col_j[k];
  } else {
    const f8 x = load_part(a.xi + ib, kFull ? 8 : rows);
    const f8 col_j = st.zero_sums(x, rows, yj, cols);
    st.zero_gram(x, yj, rows, g);
    for (int64_t k = 0; k < (kFull ? 8 : cols); ++k) a.cj[jb + k] += col_j[k];
  }
  if (!upper) return;
  const f8 y = load_part(a.yi + ib, kFull ? 8 : rows);
  if (!live_ji) {
    const f8 x = load_part(a.xj + jb, kFull ? 8 : cols);
    st.zero_gram(y, x, rows, g);
    // its other sums: here, or (a tile of zeros) in closed form by the caller
    if (a.aji != nullptr) col_i += st.zero_sums(x, cols, y, rows);
    return;
  }
  const f8 keep_rows = kFull ? f8{} : lane_mask(rows);
  const f8 ei = load_part(a.evi + ib, kFull ? 8 : rows);
  f8 gt[8];
  for (int r = 0; r < 8; ++r) std::memcpy(&gt[r], g + r * TB, sizeof(f8));
  cpu::transpose8x8(gt);  // gt[c]: G_JI row jb + c, columns ib..
  for (int64_t c = 0; c < (kFull ? 8 : cols); ++c) {
    const float* ar = a.aji + (jb + c) * a.lji + ib;
    f8 av;
    if constexpr (kFull) {
      std::memcpy(&av, ar, sizeof av);
    } else {
      av = load_part(ar, rows);
    }
    col_i += st.entry<!kFull>(av, gt[c], st.q_offsets(a.evj[jb + c], ei), a.xj[jb + c], y,
                              keep_rows);
  }
}

// gp: kPanel x TB floats of scratch for the Gram panel.
void kl_pair(const PairArgs& a, float* gp, Acc& acc) {
  StripSums st;
  st.hs = f8{} + a.hs;
  for (int64_t ib0 = 0; ib0 < a.ni; ib0 += kPanel) {
    // the Gram rows of this panel (rounded up to 8: Vn's padding rows give zeros) over the
    // columns it needs (rounded up to 8 the same way)
    const int64_t prow = std::min(kPanel, (a.ni - ib0 + 7) / 8 * 8);
    const int64_t ncol = (std::min(a.nj, a.diag ? ib0 + kPanel : a.nj) + 7) / 8 * 8;
    gemm_nn(prow, ncol, a.dh, 1.0f, a.vi + ib0 * a.dh, a.dh, a.vtj, a.ldv, gp, TB);
    for (int64_t ib = ib0; ib < std::min(a.ni, ib0 + kPanel); ib += 8) {
      const int64_t rows = std::min<int64_t>(8, a.ni - ib);
      const int64_t jend = a.diag ? ib + 8 : a.nj;
      const float* g8 = gp + (ib - ib0) * TB;  // this row block's Gram rows
      // A comes from L3 or memory, in 32-byte pieces of many rows: fetch the next row
      // block's lines now (its A_IJ rows, and its A_JI column strip: a new line per two)
      for (int64_t r = ib + 8; r < std::min(ib + 16, a.ni); ++r)
        for (int64_t c = 0; c < jend; c += 16) __builtin_prefetch(a.aij + r * a.lij + c, 0, 2);
      if (a.aji != nullptr && ib + 8 < a.ni)
        for (int64_t c = 0; c < std::min(jend, a.nj); ++c)
          __builtin_prefetch(a.aji + c * a.lji + ib + 8, 0, 2);
      f8 col_i = {};  // B's column sums over the A_JI pieces, columns ib..
      const Extent& ext_i = a.ei[ib / 8];
      for (int64_t jb = 0; jb < jend; jb += 8) {
        const int64_t cols = std::min<int64_t>(8, a.nj - jb);
        const bool live_ij = ext_i.hits(a.gj0 + jb / 8);
        // A_JI's block, unless it is the diagonal block (A_IJ's, just seen)
        const bool upper = !(a.diag && jb == ib);
        const bool live_ji = upper && a.aji != nullptr && a.ej[jb / 8].hits(a.gi0 + ib / 8);
        if (rows == 8 && cols == 8) {
          block8<true>(a, g8 + jb, ib, jb, rows, cols, live_ij, upper, live_ji, st, col_i);
        } else {
          block8<false>(a, g8 + jb, ib, jb, rows, cols, live_ij, upper, live_ji, st, col_i);
        }
      }
      for (int64_t k = 0; k < rows; ++k) a.ci[ib + k] += col_i[k];
      acc.kl += hsum(st.kl);
      acc.ap += hsum(st.ap);
      acc.ag += hsum(st.ag);
      acc.ax2 += hsum(st.ax2);
      acc.a2 += hsum(st.a2);
      st.kl = st.ap = st.ag = st.ax2 = st.a2 = f8{};
    }
  }
}

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

void setup(Problem& P, int64_t B, int64_t H, int64_t T, int64_t Dh, const at::Tensor& lengths,
           const std::optional<at::Tensor>& offsets, const char* op) {
  const bool has_off = offsets.has_value() && offsets->defined();
  const at::Tensor* off_ptr = has_off ? &*offsets : nullptr;
  check_window_values(op, lengths, off_ptr, T);
  P.B = B;
  P.H = H;
  P.T = T;
  P.T8 = (T + 7) / 8 * 8;  // kl_pair reads Vn in blocks of 8 rows
  // T rounded up to 16, to an odd number of cache lines: the Gram kernels read 8- or
  // 16-column panels of Vn^T down Dh rows, which a power-of-two stride maps to few L1 sets
  P.Tp = (T + 15) / 16 * 16;
  if ((P.Tp / 16) % 2 == 0) P.Tp += 16;
  P.Dh = Dh;
  P.BH = B * H;
  P.nthreads = at::get_num_threads();
  P.n.resize(B);
  P.s.resize(B);
  const auto len = lengths.contiguous();
  at::Tensor off = has_off ? offsets->contiguous() : at::Tensor();
  for (int64_t b = 0; b < B; ++b) {
    P.n[b] = window_len(len.data_ptr<int64_t>()[b], T);
    P.s[b] = has_off ? window_start(off.data_ptr<int64_t>()[b], P.n[b], T) : 0;
  }
  const int64_t nb_max = (T + TB - 1) / TB;
  const int64_t pairs_max = nb_max * (nb_max + 1) / 2;
  // Whole heads per thread, unless too few threads would have one: heads split into chunks
  // cost about 1.5 times the work (a separate first pass, and the qk op forms each tile
  // twice; measured on 2 threads at T = 512), so whole heads win while their
  // ceil(BH / threads) rounds take at most 1.5 BH / threads (3 heads on 2 threads: 12-20%
  // faster whole; 1 head: 25-40% faster in chunks).
  const int64_t rounds = (P.BH + P.nthreads - 1) / P.nthreads;
  const int64_t chunks = (2 * P.nthreads + P.BH - 1) / P.BH;
  P.P = 2 * P.nthreads * rounds <= 3 * P.BH ? 1 : std::max<int64_t>(1, std::min(pairs_max, chunks));
  P.msq.assign(P.BH, 0);
  P.centred.assign(P.BH, 0);
  P.Scc.assign(P.BH, 0);
  P.Snorm2.assign(P.BH, 0);
  P.mS.assign(P.BH, 0);
  P.bad.assign(P.BH, 0);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  // fused: each thread takes whole heads one at a time, so Vn and Vn^T live in one slot per
  // thread (and stay in its cache) instead of one per head
  P.fused = P.P == 1;
  const int64_t slots = P.fused ? P.nthreads : P.BH;
  P.vn = at::empty({slots, P.T8, Dh}, f32);
  P.vnt = at::empty({slots, Dh, P.Tp}, f32);
  P.adot = at::empty({P.BH, T}, f64);
  P.e = at::empty({P.BH, T}, f32);
  P.xrow = at::empty({P.BH, T}, f32);
  P.ycol = at::empty({P.BH, T}, f32);
  P.dcol = at::empty({P.BH, T}, f64);
  P.part = at::zeros({P.BH, P.P, kParts}, f64);
  P.rsum = at::zeros({P.BH, T}, f64);
  P.rlo = at::zeros({P.BH, T}, f64);
  P.colp = at::zeros({P.BH, P.P, T}, f64);
  P.chunkbad = at::zeros({P.BH, P.P}, at::TensorOptions().dtype(at::kByte));
  P.ext = at::empty({P.BH, P.T8 / 8, 2}, at::TensorOptions().dtype(at::kInt));
}

// The shifts of tile row I's rows and columns for the tile pass (see PairArgs), once its
// row sums r and diagonal column sums are known: x_i = (r_i - r0) / n, r0 the mean row sum
// of tile row 0 (the same for every row: a row constant is left to the column shifts), and
// y_j the mean over tile row I's rows of a_ij - x_i. Wherever A is close to a row constant
// plus a column constant (one column taking most of every row's weight, an attention
// sink), B is then close to Ac, and b = (a - y) - x is formed from nearby numbers (its
// column part first, as the seed's centring subtracts the column means first). Any shifts
// would keep the sums exact; these keep them small.
void set_shifts(Problem& P, int64_t bh, int64_t I) {
  const int64_t n = P.n[bh / P.H], i0 = I * TB, ni = std::min(TB, n - i0), n0 = std::min(TB, n);
  const double* r = P.rsum.data_ptr<double>() + bh * P.T;
  const double* dcol = P.dcol.data_ptr<double>() + bh * P.T;
  float* x = P.xrow.data_ptr<float>() + bh * P.T;
  float* y = P.ycol.data_ptr<float>() + bh * P.T;
  double r0 = 0, sx = 0;
  for (int64_t i = 0; i < n0; ++i) r0 += r[i];
  r0 /= static_cast<double>(n0);
  for (int64_t i = i0; i < i0 + ni; ++i) {
    x[i] = static_cast<float>((r[i] - r0) / static_cast<double>(n));
    sx += x[i];
  }
  for (int64_t j = i0; j < i0 + ni; ++j)
    y[j] = static_cast<float>((dcol[j] - sx) / static_cast<double>(ni));
}

// set_shifts for every tile row of every head, after phase 1 in chunks.
void shifts_phase(Problem& P) {
  at::parallel_for(0, P.BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh)
      if (!P.bad[bh])
        for (int64_t I = 0; I < P.nb(bh); ++I) set_shifts(P, bh, I);
  });
}

// Whether tile (I, J) of a head's window may hold a nonzero of A.
bool tile_live(const Extent* ext, int64_t I, int64_t J, int64_t n) {
  const int64_t per = TB / 8, g0 = J * per;
  for (int64_t k = I * per; k < std::min((I + 1) * per, (n + 7) / 8); ++k)
    if (ext[k].hits(g0, g0 + per - 1)) return true;
  return false;
}

void alloc_scratch(Problem& P, int64_t extra) {
  // tiles A_IJ, A_JI, the Gram panel | a row | W (+16 floats read past the end by gemm_nn) |
  // W^T | C
  P.scratch_per_thread = 3 * kTileFloats + std::max(P.T, P.Dh) + 16 + P.T * P.Dh + 16 +
                         P.Dh * P.Tp + P.Dh * P.Dh + extra;
  P.scratch_extra = extra;
  P.scratch = at::empty({P.nthreads, P.scratch_per_thread}, at::TensorOptions().dtype(at::kFloat));
}

// Below this ||Sc||^2 / ||S||^2 a head's Gram tiles are formed from W (see prepare_values).
constexpr double kCentredGram = 1e-2;

// Phase V: Vn (or W), m . Vn_i, S's row-sum maximum, ||S||^2 and ||Sc||^2 per head.
template <typename V_t>
void prepare_values(Problem& P, const at::Tensor& head_writes, const Range* only = nullptr) {
  const auto hw = in4<V_t>(head_writes);
  const int64_t sd = head_writes.stride(3);
  run_range(only, P.BH, 1, [&](int64_t begin, int64_t end) {
    float* row = P.row_scratch();
    float* W = row + std::max(P.T, P.Dh) + 16;
    float* WT = W + P.T * P.Dh + 16;
    float* C = WT + P.Dh * P.Tp;
    std::vector<double> u(P.Dh), m(P.Dh), Cd(P.Dh * P.Dh);
    std::vector<float> mf(P.Dh), sqv(P.Dh);
    float* sq = sqv.data();
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / P.H, h = bh % P.H, n = P.n[b], s = P.s[b], Dh = P.Dh;
      const int64_t n8 = (n + 7) / 8 * 8;  // kl_pair reads rows / columns up to here: zeros
      const double nn = static_cast<double>(n);
      float* vn = P.vn_of(bh);
      float* vnt = P.vnt_of(bh);
      double* adot = P.adot.data_ptr<double>() + bh * P.T;
      float* e = P.e.data_ptr<float>() + bh * P.T;
      std::fill(u.begin(), u.end(), 0.0);
      bool bad = false;
      for (int64_t i = 0; i < n; ++i) {
        load(row, hw.at(b, h, s + i), Dh, sd);
        const double nrm2 = dot8(row, row, Dh);
        if (!std::isfinite(nrm2)) {
          bad = true;
          break;
        }
        for (int64_t c = 0; c < Dh; ++c) sq[c] = row[c] * row[c];  // rounded, as NumPy's x * x
        const float nrm = std::sqrt(numpy_pairwise_sum(sq, Dh));
        const float den = nrm > 1e-9f ? nrm : 1e-9f;
        float* vi = vn + i * Dh;
        for (int64_t c = 0; c < Dh; ++c) vi[c] = row[c] / den;  // a division, as the seed
        for (int64_t c = 0; c < Dh; ++c) u[c] += vi[c];
      }
      if (bad) {
        P.bad[bh] = 1;
        continue;
      }
      double msq = 0, usq = 0, mS = 0, amin = std::numeric_limits<double>::infinity();
      for (int64_t c = 0; c < Dh; ++c) {
        mf[c] = static_cast<float>(u[c] / nn);
        m[c] = mf[c];  // the mean as used for W = Vn - m (float), exactly
        msq += m[c] * m[c];
        usq += u[c] * u[c];
      }
      for (int64_t i = 0; i < n; ++i) {
        const float* vi = vn + i * Dh;
        float* wi = W + i * Dh;
        for (int64_t c = 0; c < Dh; ++c) wi[c] = vi[c] - mf[c];
        const double a = dot8(mf.data(), vi, Dh);  // m . Vn_i; u . Vn_i = n a
        adot[i] = a;
        amin = std::min(amin, a);
        mS = std::max(mS, 0.5 * (nn * a + nn));
      }
      // Vn^T for the Gram tiles, W^T for C = W^T W
      std::fill(vn + n * Dh, vn + n8 * Dh, 0.0f);
      cpu::transpose(vn, Dh, n, Dh, vnt, P.Tp);
      for (int64_t c = 0; c < Dh; ++c) std::fill(vnt + c * P.Tp + n, vnt + c * P.Tp + n8, 0.0f);
      for (int64_t c = 0; c < Dh; ++c)
        for (int64_t i = 0; i < n; ++i) WT[c * P.Tp + i] = vnt[c * P.Tp + i] - mf[c];
      // ||S||^2 and ||Sc||^2 from C = W^T W (summed in double over row chunks). C is
      // symmetric: only its upper triangle is formed, in 16-column panels (rows up to the
      // panel's last column), and the off-diagonal entries count twice below
      auto value_norms = [&] {
        std::fill(Cd.begin(), Cd.end(), 0.0);
        constexpr int64_t kChunk = 256;
        for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
          const int64_t rows = std::min(kChunk, n - i0);
          for (int64_t q0 = 0; q0 < Dh; q0 += 16) {
            const int64_t nq = std::min<int64_t>(16, Dh - q0), np = q0 + nq;
            gemm_nn(np, nq, rows, 1.0f, WT + i0, P.Tp, W + i0 * Dh + q0, Dh, C + q0, Dh);
            for (int64_t p = 0; p < np; ++p)
              for (int64_t q = q0; q < q0 + nq; ++q) Cd[p * Dh + q] += C[p * Dh + q];
          }
        }
        double c2 = 0, mcm = 0;
        for (int64_t p = 0; p < Dh; ++p) {
          for (int64_t q = p; q < Dh; ++q) {
            const double cpq = Cd[p * Dh + q], w = q == p ? 1.0 : 2.0;
            c2 += w * cpq * cpq;
            mcm += w * m[p] * cpq * m[q];
          }
        }
        P.Scc[bh] = c2 / 4.0;
        const double vtv2 = c2 + 2.0 * nn * mcm + nn * nn * msq * msq;
        P.Snorm2[bh] = (vtv2 + 2.0 * usq + nn * nn) / 4.0;
      };
      value_norms();
      P.mS[bh] = std::max(mS, kClip);
      // Nearly parallel writes: G is close to 1 everywhere and its float rounding would be
      // most of Gc = H G H, so the Gram tiles come from W (finalize_into then takes <B, W W^T>
      // as it is) and the KL rebuilds G from them through e. Only where every row is within
      // about 40 degrees of m (so every G_ij > 0, far from the KL's clip at G = -1, where the
      // rebuilt G's rounding would matter); elsewhere Vn keeps the Gram tiles the seed's
      // float32 products, which the KL's q near its clip follows.
      const bool centred = P.Scc[bh] < kCentredGram * P.Snorm2[bh] &&
                           amin > 0.75 * std::sqrt(msq);
      P.centred[bh] = centred;
      if (centred) {
        // W's digits are below Vn's float rounding there: m, W, m . Vn_i and the norms
        // again from the rows normalised in double, W rounded once
        std::fill(u.begin(), u.end(), 0.0);
        for (int64_t i = 0; i < n; ++i) {
          load(row, hw.at(b, h, s + i), Dh, sd);
          const double inv = 1.0 / std::max(std::sqrt(dot8(row, row, Dh)), 1e-9);
          for (int64_t c = 0; c < Dh; ++c) u[c] += row[c] * inv;
        }
        msq = usq = 0;
        for (int64_t c = 0; c < Dh; ++c) {
          m[c] = u[c] / nn;
          msq += m[c] * m[c];
          usq += u[c] * u[c];
        }
        for (int64_t i = 0; i < n; ++i) {
          load(row, hw.at(b, h, s + i), Dh, sd);
          const double inv = 1.0 / std::max(std::sqrt(dot8(row, row, Dh)), 1e-9);
          float* wi = vn + i * Dh;
          double a = 0;
          for (int64_t c = 0; c < Dh; ++c) {
            const double v = row[c] * inv;
            a += m[c] * v;
            wi[c] = static_cast<float>(v - m[c]);
          }
          adot[i] = a;
          e[i] = static_cast<float>(a - 0.5 * msq);  // G_ij = W_i . W_j + e_i + e_j
        }
        std::copy(vn, vn + n * Dh, W);
        cpu::transpose(vn, Dh, n, Dh, vnt, P.Tp);
        for (int64_t c = 0; c < Dh; ++c) std::copy(vnt + c * P.Tp, vnt + c * P.Tp + n, WT + c * P.Tp);
        value_norms();
      } else {
        std::fill(e, e + n, 0.0f);
      }
      P.msq[bh] = msq;
    }
  });
}

// After phase 1 in chunks: a head is bad when one of its chunks met a NaN or an infinity.
void merge_bad_chunks(Problem& P) {
  const uint8_t* cb = P.chunkbad.data_ptr<uint8_t>();
  for (int64_t bh = 0; bh < P.BH; ++bh)
    for (int64_t p = 0; p < P.P; ++p) P.bad[bh] |= cb[bh * P.P + p];
}

// Sums over one tile's W rows for zero_tile: sum x_i W_i, sum W_i and sum y_i W_i (x, y:
// the row and column shifts), in double, formed once per tile on first use, so that a pair
// of tiles of zeros costs O(Dh) (sliding-window attention at long T has many).
struct TileVnSums {
  const float *vn, *x, *y;  // one head's
  int64_t dh, n;
  // allocated on first use (most heads have no such pair)
  std::vector<double> sums;  // [tile][3][dh]
  std::vector<uint8_t> ready;
  TileVnSums(const float* vn_, const float* x_, const float* y_, int64_t dh_, int64_t n_)
      : vn(vn_), x(x_), y(y_), dh(dh_), n(n_) {}
  const double* of(int64_t t) {
    if (ready.empty()) {
      ready.assign((n + TB - 1) / TB, 0);
      sums.assign(ready.size() * 3 * dh, 0.0);
    }
    double* s = sums.data() + t * 3 * dh;
    if (!ready[t]) {
      for (int64_t i = t * TB; i < std::min(n, t * TB + TB); ++i)
        for (int64_t c = 0; c < dh; ++c) {
          const double v = vn[i * dh + c];
          s[c] += x[i] * v;
          s[dh + c] += v;
          s[2 * dh + c] += y[i] * v;
        }
      ready[t] = 1;
    }
    return s;
  }
};

// A tile of A all zero (rows [i0, i0 + ni), columns [j0, j0 + nj)) in a pair with no live
// tile, where no Gram tile is formed: zero_sums, and its part of <B, W W^T>,
// -sum (x_i + y_j) W_i . W_j = -(sum_i x_i W_i) . (sum_j W_j) - (sum_i W_i) . (sum_j y_j W_j)
// (si, sj: TileVnSums of the row and column tiles).
void zero_tile(const double* si, const double* sj, int64_t dh, const float* x, const float* y,
               int64_t i0, int64_t ni, int64_t j0, int64_t nj, Acc& acc, double* cols) {
  zero_sums(x + i0, ni, y + j0, nj, acc.ax2, cols + j0);
  for (int64_t c = 0; c < dh; ++c) acc.ag -= si[c] * sj[dh + c] + si[dh + c] * sj[2 * dh + c];
}

// Phase 2 driver: visits the lower-triangle tile pairs (I >= J) of each head, chunk p of
// P taking every P-th pair. row_tile(bh, I) runs before tile row I's pairs (false: the head
// holds a NaN or an infinity, and stops there). tile(bh, i0, ni, j0, nj, buf, lda, down)
// gives a pointer to A's tile and its row stride (buf: kLd), down when kl_pair reads it
// down its columns (A_JI beside a live A_IJ); it is called only for tiles the extents say
// may hold a nonzero.
template <typename RowFn, typename TileFn>
void tiles_phase(Problem& P, RowFn&& row_tile, TileFn&& tile, const Range* only = nullptr) {
  run_range(only, P.BH * P.P, 1, [&](int64_t begin, int64_t end) {
    float* buf_ij = P.thread_scratch();
    float* buf_ji = buf_ij + kTileFloats;
    float* gp = buf_ji + kTileFloats;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / P.P, p = task % P.P;
      if (P.bad[bh]) continue;
      const int64_t n = P.n[bh / P.H], nb = P.nb(bh);
      const float* vn = P.vn_of(bh);
      const float* vnt = P.vnt_of(bh);
      const float* x = P.xrow.data_ptr<float>() + bh * P.T;
      const float* y = P.ycol.data_ptr<float>() + bh * P.T;
      const float* e = P.e.data_ptr<float>() + bh * P.T;
      double* cols = P.colp.data_ptr<double>() + (bh * P.P + p) * P.T;
      const Extent* ext = P.ext_of(bh);
      const float hs = static_cast<float>(0.5 / P.mS[bh]);
      Acc acc;
      TileVnSums tile_sums(vn, x, y, P.Dh, n);
      int64_t idx = -1;
      for (int64_t I = 0; I < nb; ++I) {
        if (!row_tile(bh, I)) {
          P.bad[bh] = 1;
          break;
        }
        for (int64_t J = 0; J <= I; ++J) {
          if (++idx % P.P != p) continue;
          const int64_t i0 = I * TB, ni = std::min(TB, n - i0);
          const int64_t j0 = J * TB, nj = std::min(TB, n - j0);
          int64_t lij = 0, lji = 0;
          const float* aij = nullptr;
          if (tile_live(ext, I, J, n)) aij = tile(bh, i0, ni, j0, nj, buf_ij, lij, false);
          const float* aji = aij;
          lji = lij;
          if (I != J) {
            aji = nullptr;
            if (tile_live(ext, J, I, n))
              aji = tile(bh, j0, nj, i0, ni, buf_ji, lji, /*down=*/aij != nullptr);
          }
          // a tile of zeros beside a live one: its <B, W W^T> in kl_pair (block by block, from
          // the Gram tile formed for the live one), its other sums here
          if (I != J && (aij == nullptr) != (aji == nullptr)) {
            if (aij == nullptr) zero_sums(x + i0, ni, y + j0, nj, acc.ax2, cols + j0);
            if (aji == nullptr) zero_sums(x + j0, nj, y + i0, ni, acc.ax2, cols + i0);
          }
          if (aij != nullptr) {
            kl_pair({vn + i0 * P.Dh, vnt + j0, P.Dh, P.Tp, aij, lij, aji, lji, ni, nj, I == J,
                     ext + i0 / 8, ext + j0 / 8, i0 / 8, j0 / 8, hs, e + i0, e + j0, x + i0, x + j0,
                     y + i0, y + j0, cols + i0, cols + j0}, gp, acc);
          } else if (aji != nullptr) {  // only A_JI: the pair seen from J
            kl_pair({vn + j0 * P.Dh, vnt + i0, P.Dh, P.Tp, aji, lji, nullptr, 0, nj, ni, false,
                     ext + j0 / 8, ext + i0 / 8, j0 / 8, i0 / 8, hs, e + j0, e + i0, x + j0, x + i0,
                     y + j0, y + i0, cols + j0, cols + i0}, gp, acc);
          } else {
            const double* si = tile_sums.of(I);
            const double* sj = tile_sums.of(J);
            zero_tile(si, sj, P.Dh, x, y, i0, ni, j0, nj, acc, cols);
            if (I != J) zero_tile(sj, si, P.Dh, x, y, j0, nj, i0, ni, acc, cols);
          }
        }
      }
      double* pt = P.part.data_ptr<double>() + (bh * P.P + p) * kParts;
      pt[0] = acc.kl;
      pt[1] = acc.ap;
      pt[2] = acc.ag;
      pt[3] = acc.ax2;
      pt[4] = acc.a2;
    }
  });
}

// Recomputes head bh's row sums of A as hi + lo pairs (rsum, rlo; see sum_f64_exact).
using Refine = std::function<void(int64_t bh)>;

// Combines the chunks' partial sums into (d, c, r) per head. refine, where given, runs for
// heads whose ||Ac|| is below 1e-8 ||A||: B's row sums come from A's, and below about 1e-12
// ||A|| a double's rounding of those is most of them.
void finalize_into(Problem& P, float* o, const Range* only = nullptr,
                   const Refine& refine = nullptr) {
  run_range(only, P.BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      float* ob = o + bh * 3;
      if (P.bad[bh]) {
        ob[0] = ob[1] = ob[2] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const int64_t n = P.n[bh / P.H];
      const double nn = static_cast<double>(n);
      const double* part = P.part.data_ptr<double>() + bh * P.P * kParts;
      const double* rsum = P.rsum.data_ptr<double>() + bh * P.T;
      const double* rlo = P.rlo.data_ptr<double>() + bh * P.T;
      const double* colp = P.colp.data_ptr<double>() + bh * P.P * P.T;
      const double* adot = P.adot.data_ptr<double>() + bh * P.T;
      const float* x = P.xrow.data_ptr<float>() + bh * P.T;
      double kl = 0, ap = 0, ag = 0, ax2 = 0, a2 = 0;
      for (const double* pt = part; pt < part + P.P * kParts; pt += kParts) {
        kl += pt[0];
        ap += pt[1];
        ag += pt[2];
        ax2 += pt[3];
        a2 += pt[4];
      }
      // B = A - x 1^T - 1 y^T (the shifts of the tile pass): ax2 = ||B||^2, ag = <B, G> (or
      // <B, W W^T>, centred), colp holds B's column sums; its row sums are r_i - n x_i -
      // sum(y). For any shifts
      // ||Ac||^2 = ||H B H||^2 and <Ac, Sc> = <B, H G H> / 2 (H B H = H A H); with shifts
      // near the row and column means B is near Ac, so neither is a difference of large
      // sums (attention sinks: A near 1 y^T, Ac tiny)
      const float* y = P.ycol.data_ptr<float>() + bh * P.T;
      // (sum(y)'s rounding shifts every row sum of B alike: no centred sum changes)
      double sy = 0;
      for (int64_t i = 0; i < n; ++i) sy += y[i];
      double rb2, cb2, rba, cba, b1, mA, Acc;
      auto centred = [&] {
        rb2 = cb2 = rba = cba = b1 = mA = 0;
        for (int64_t i = 0; i < n; ++i) {
          double c = 0;
          for (int64_t p = 0; p < P.P; ++p) c += colp[p * P.T + i];
          mA = std::max(mA, rsum[i] + rlo[i]);
          // row i of B's sum (where refined, r_i's large part cancels exactly); c: column i's
          const double br = ((rsum[i] - nn * x[i]) - sy) + rlo[i];
          b1 += br;
          rb2 += br * br;
          cb2 += c * c;
          rba += br * adot[i];
          cba += c * adot[i];
        }
        Acc = std::max(0.0, ax2 - rb2 / nn - cb2 / nn + b1 * b1 / (nn * nn));
      };
      centred();
      if (refine && Acc < 1e-16 * a2) {
        refine(bh);
        centred();
      }
      const double Scc = P.Scc[bh];
      // <Ac, Sc> = <B, W W^T> / 2 (W W^T = H G H = G - a 1^T - 1 a^T + |m|^2, a = adot),
      // bounded by Cauchy-Schwarz (so that it is exactly 0 when either centred matrix is,
      // e.g. n = 1, as in the seed)
      const double bound = std::sqrt(Acc * Scc);
      const double BWW = P.centred[bh] ? ag : ag - rba - cba + b1 * P.msq[bh];
      const double Asc = std::min(bound, std::max(-bound, 0.5 * BWW));
      const double c = Asc / std::max(std::sqrt(Acc * Scc), 1e-12);
      const double num = std::sqrt(std::max(0.0, Acc - 2.0 * Asc + Scc));
      const double den = std::max(std::sqrt(a2) * std::sqrt(P.Snorm2[bh]), 1e-9);
      ob[0] = static_cast<float>(num / den);
      ob[1] = static_cast<float>(c);
      mA = std::max(mA, kClip);  // the seed's max(max row sum, 1e-12)
      ob[2] = static_cast<float>((std::log(2.0) * kl - std::log(mA) * ap) / mA / nn);
    }
  });
}

at::Tensor finalize(Problem& P, const at::TensorOptions& out_opts, const Refine& refine = nullptr) {
  at::Tensor out = at::empty({P.B, P.H, 3}, out_opts.dtype(at::kFloat));
  finalize_into(P, out.data_ptr<float>(), nullptr, refine);
  return out;
}

// ---- vas_head_stats ------------------------------------------------------------------

// Row i of head bh's window of A as floats: in place (float, unit column stride) or
// converted into `buf`.
template <typename A_t>
const float* window_row(const Problem& P, const In4<A_t>& A, int64_t s3, int64_t bh, int64_t i,
                        float* buf) {
  const int64_t b = bh / P.H, h = bh % P.H, s = P.s[b];
  if (std::is_same<A_t, float>::value && s3 == 1)
    return reinterpret_cast<const float*>(A.at(b, h, s + i)) + s;
  load(buf, A.at(b, h, s + i) + s * s3, P.n[b], s3);
  return buf;
}

// Phase 1 of the attention op over tile row I of a head (rows [I TB, I TB + TB) of its
// window): the rows' sums, the column sums of its diagonal tile (for set_shifts) and the
// Extent of each 8-row block. False when a row holds a NaN or an infinity. row: scratch
// for one converted row.
template <typename A_t>
bool attn_row_tile(Problem& P, const In4<A_t>& A, int64_t s3, int64_t bh, int64_t I, float* row) {
  const int64_t n = P.n[bh / P.H], nb = P.nb(bh);
  Extent* ext = P.ext_of(bh);
  double* rsum = P.rsum.data_ptr<double>() + bh * P.T;  // each row has one owner
  const int64_t i0 = I * TB, ni = std::min(TB, n - i0);
  DiagColumns diag;
  for (int64_t i = i0; i < i0 + ni; ++i) {
    const float* a = window_row(P, A, s3, bh, i, row);
    double sum = 0;
    int64_t first = -1, last = -1;  // the first and last 8-column group holding a nonzero
    for (int64_t J = 0; J < nb; ++J) {
      const int64_t j0 = J * TB;
      uint32_t groups;
      sum += sum_f64<true>(a + j0, std::min(TB, n - j0), &groups);
      if (groups != 0) {
        if (first < 0) first = j0 / 8 + __builtin_ctz(groups);
        last = j0 / 8 + 31 - __builtin_clz(groups);
      }
    }
    if (!std::isfinite(sum)) return false;  // a NaN or an infinity (|a| < 1e19 never overflows)
    rsum[i] = sum;
    diag.add_row(a + i0, ni);
    Extent& e = ext[i / 8];
    if (i % 8 == 0) e = {std::numeric_limits<int32_t>::max(), -1};
    if (first >= 0) {
      e.lo = std::min(e.lo, static_cast<int32_t>(first));
      e.hi = std::max(e.hi, static_cast<int32_t>(last));
    }
  }
  diag.store(P.dcol.data_ptr<double>() + bh * P.T + i0, ni);
  return true;
}

// finalize_into's refine for the attention op: head bh's row sums of A as hi + lo.
template <typename A_t>
void attn_exact_row_sums(Problem& P, const at::Tensor& attn, int64_t bh) {
  const auto A = in4<A_t>(attn);
  double* rsum = P.rsum.data_ptr<double>() + bh * P.T;
  double* rlo = P.rlo.data_ptr<double>() + bh * P.T;
  const int64_t n = P.n[bh / P.H];
  for (int64_t i = 0; i < n; ++i)
    sum_f64_exact(window_row(P, A, attn.stride(3), bh, i, P.row_scratch()), n, rsum[i], rlo[i]);
}

// Phase 1 of the attention op for every head, chunk p taking every P-th tile row.
template <typename A_t>
void attn_row_phase(Problem& P, const at::Tensor& attn) {
  const auto A = in4<A_t>(attn);
  at::parallel_for(0, P.BH * P.P, 1, [&](int64_t begin, int64_t end) {
    float* row = P.row_scratch();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / P.P, p = task % P.P;
      if (P.bad[bh]) continue;
      for (int64_t I = p; I < P.nb(bh); I += P.P) {
        if (!attn_row_tile(P, A, attn.stride(3), bh, I, row)) {
          P.chunkbad.data_ptr<uint8_t>()[bh * P.P + p] = 1;
          break;
        }
      }
    }
  });
}

// rows_too (one head, `only`): phase 1 of each tile row just before its pairs, while its
// rows are in cache (the row KL's sums do not need the other rows first).
template <typename A_t>
void attn_tiles_phase(Problem& P, const at::Tensor& attn, const Range* only = nullptr,
                      bool rows_too = false) {
  const auto A = in4<A_t>(attn);
  const int64_t s3 = attn.stride(3);
  const bool direct = std::is_same<A_t, float>::value && s3 == 1;
  auto row_tile = [&](int64_t bh, int64_t I) {
    if (!rows_too) return true;
    if (!attn_row_tile(P, A, s3, bh, I, P.row_scratch())) return false;
    set_shifts(P, bh, I);
    return true;
  };
  tiles_phase(P, row_tile, [&](int64_t bh, int64_t i0, int64_t ni, int64_t j0, int64_t nj,
                               float* buf, int64_t& lda, bool down) -> const float* {
    const int64_t b = bh / P.H, h = bh % P.H, s = P.s[b];
    // read in place, unless down its columns at a stride that makes them evict each other
    if (direct && !(down && A.s2 % 256 == 0)) {
      lda = A.s2;
      return reinterpret_cast<const float*>(A.at(b, h, s + i0)) + (s + j0);
    }
    for (int64_t r = 0; r < ni; ++r)
      load(buf + r * kLd, A.at(b, h, s + i0 + r) + (s + j0) * s3, nj, s3);
    lda = kLd;
    return buf;
  }, only);
}

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

at::Tensor vas_head_stats_cpu(const at::Tensor& attn, const at::Tensor& head_writes,
                              const at::Tensor& lengths, const std::optional<at::Tensor>& offsets) {
  const char* op = "headscope::vas_head_stats";
  check_head_stats_args(attn, head_writes, lengths, offsets);
  const int64_t B = attn.size(0), H = attn.size(1), T = attn.size(2), Dh = head_writes.size(3);
  if (B == 0 || H == 0) return at::empty({B, H, 3}, attn.options().dtype(at::kFloat));
  Problem P;
  setup(P, B, H, T, Dh, lengths, offsets, op);
  alloc_scratch(P, 0);
  if (P.fused) {
    // every head in one task: one parallel region, each thread taking whole heads through
    // all phases one head at a time, each tile row of A read once from memory and again
    // from cache for its tile pairs
    at::Tensor out = at::empty({B, H, 3}, attn.options().dtype(at::kFloat));
    for_each_head(P, [&](const Range& r) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, head_writes.scalar_type(),
                                      "vas_v", [&] { prepare_values<scalar_t>(P, head_writes, &r); });
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "vas_a", [&] {
        attn_tiles_phase<scalar_t>(P, attn, &r, /*rows_too=*/true);
        finalize_into(P, out.data_ptr<float>(), &r,
                      [&](int64_t bh) { attn_exact_row_sums<scalar_t>(P, attn, bh); });
      });
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, head_writes.scalar_type(), "vas_v",
                                  [&] { prepare_values<scalar_t>(P, head_writes); });
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "vas_a", [&] {
    attn_row_phase<scalar_t>(P, attn);
    merge_bad_chunks(P);
    shifts_phase(P);
    attn_tiles_phase<scalar_t>(P, attn);
    out = finalize(P, attn.options(),
                   [&](int64_t bh) { attn_exact_row_sums<scalar_t>(P, attn, bh); });
  });
  return out;
}

// ---- vas_head_stats_qk ---------------------------------------------------------------

struct QK {
  at::Tensor q;     // float [BH, T, D]: the window rows of q
  at::Tensor kt;    // float [B * Hkv, D, Tp]: the keys in use (all T, or up to s + n if
                    // causal), transposed
  at::Tensor mrow;  // float [BH, T]: softmax row maximum
  at::Tensor izrow; // float [BH, T]: 1 / softmax denominator
  std::vector<uint8_t> kbad;
  // [B, T] with a key padding mask: 0 for a key in use, -inf for padding, added to the
  // logits (padding keys are stored as zeros, so the sum stays -inf); empty without one
  std::vector<float> kbias;
  int64_t Hkv = 1, D = 1;
  float scale = 1;
  bool causal = false;
  int64_t key_end(const Problem& P, int64_t b) const { return causal ? P.s[b] + P.n[b] : P.T; }
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

template <typename Q_t, typename K_t>
void qk_prepare(Problem& P, QK& Q, const at::Tensor& q, const at::Tensor& k) {
  const auto qa = in4<Q_t>(q);
  const auto ka = in4<K_t>(k);
  const int64_t qs = q.stride(3), ks = k.stride(3), D = Q.D;
  const int64_t nk = P.B * Q.Hkv;
  at::parallel_for(0, P.BH + nk, 1, [&](int64_t begin, int64_t end) {
    float* row = P.row_scratch();
    for (int64_t t = begin; t < end; ++t) {
      if (t < P.BH) {
        const int64_t b = t / P.H, h = t % P.H, n = P.n[b], s = P.s[b];
        float* dst = Q.q.data_ptr<float>() + t * P.T * D;
        for (int64_t i = 0; i < n; ++i) load(dst + i * D, qa.at(b, h, s + i), D, qs);
        if (!all_finite(dst, n * D)) P.bad[t] = 1;
      } else {
        const int64_t bk = t - P.BH, b = bk / Q.Hkv, hk = bk % Q.Hkv;
        float* dst = Q.kt.data_ptr<float>() + bk * D * P.Tp;
        bool finite = true;
        for (int64_t j = 0; j < Q.key_end(P, b); ++j) {
          if (Q.padded(b, j, P.T)) {  // never used: its values (maybe not finite) are not read
            for (int64_t c = 0; c < D; ++c) dst[c * P.Tp + j] = 0.0f;
            continue;
          }
          load(row, ka.at(b, hk, j), D, ks);
          finite = finite && all_finite(row, D);
          for (int64_t c = 0; c < D; ++c) dst[c * P.Tp + j] = row[c];
        }
        if (!finite) Q.kbad[bk] = 1;
      }
    }
  });
  for (int64_t bh = 0; bh < P.BH; ++bh) {
    const int64_t b = bh / P.H, h = bh % P.H;
    P.bad[bh] |= Q.kbad[b * Q.Hkv + h / (P.H / Q.Hkv)];
  }
}

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

// Tile row I of a head's recomputed attention, one key block at a time with an online
// softmax: the statistics that recompute any tile of the row (row max M, 1 / denominator
// Z), its sums over the window's columns and the column sums of its diagonal tile (for
// set_shifts; that tile's key block comes last, so its exp(l - m) has the final m); with
// `held`, the row itself too, else each block reuses `scratch` (TB x TB).
void qk_row_tile(Problem& P, const QK& Q, int64_t bh, int64_t I, const HeldRow* held,
                 float* scratch) {
  const int64_t b = bh / P.H, n = P.n[b], s = P.s[b];
  const int64_t i0 = I * TB, ni = std::min(TB, n - i0);
  const KeyBlocks kb(s, Q.causal ? s + i0 + ni : P.T);
  const int64_t ld = held ? held->ld : TB;
  const float* qb = Q.q.data_ptr<float>() + bh * P.T * Q.D;
  double Z[TB], R[TB];
  float Mx[TB];
  for (int64_t r = 0; r < ni; ++r) Z[r] = R[r] = 0, Mx[r] = -std::numeric_limits<float>::infinity();
  const int64_t nblk = kb.count(), diag = kb.npre + I;
  for (int64_t t = 0; t < nblk; ++t) {
    const int64_t blk = t == nblk - 1 ? diag : t + (t >= diag);
    const int64_t k0 = kb.begin(blk), nk = kb.end(blk) - k0;
    float* L = held ? held->e + k0 : scratch;
    gemm_nn(ni, nk, Q.D, Q.scale, qb + i0 * Q.D, Q.D, key_rows(P, Q, bh) + k0, P.Tp, L, ld);
    for (int64_t r = 0; r < ni; ++r) {
      float* l = L + r * ld;
      const int64_t lim = Q.causal ? std::min(nk, s + i0 + r - k0 + 1) : nk;  // keys <= row
      float mx = Mx[r];
      if (lim > 0) {
        Q.mask_keys(l, b, k0, lim, P.T);
        mx = std::max(mx, cpu::max_of(l, lim));
      }
      if (held) held->m[r * held->mld + blk] = mx;
      if (mx == -std::numeric_limits<float>::infinity()) {  // no key in use so far
        if (held) std::fill(l, l + nk, 0.0f);
        continue;
      }
      if (mx > Mx[r]) {
        const double f = std::exp(static_cast<double>(Mx[r]) - mx);
        Z[r] *= f;
        R[r] *= f;
        Mx[r] = mx;
      }
      if (lim > 0) Z[r] += cpu::exp_shift_scale(l, l, lim, mx, 1.0f);
      if (held || blk == diag) std::fill(l + std::max<int64_t>(lim, 0), l + nk, 0.0f);
      // the window's columns [s, s + n) within this block
      const int64_t c0 = std::max<int64_t>(0, s - k0), c1 = std::min(lim, s + n - k0);
      if (c1 > c0) R[r] += sum_f64<false>(l + c0, c1 - c0);
    }
  }
  float* M = Q.mrow.data_ptr<float>() + bh * P.T;
  float* IZ = Q.izrow.data_ptr<float>() + bh * P.T;
  double* rsum = P.rsum.data_ptr<double>() + bh * P.T;  // (rlo stays 0)
  for (int64_t r = 0; r < ni; ++r) {
    const int64_t i = i0 + r;
    if (Z[r] == 0.0) {  // no key in use (all padding): a row of zeros
      M[i] = IZ[i] = 0.0f;
      rsum[i] = 0.0;
      continue;
    }
    M[i] = Mx[r];
    IZ[i] = static_cast<float>(1.0 / Z[r]);
    rsum[i] = R[r] / Z[r];
  }
  // the diagonal block, done last: A = e IZ (rows without a key are zeros)
  DiagColumns cols;
  float a[TB];
  const float* e = held ? held->e + s + i0 : scratch;
  for (int64_t r = 0; r < ni; ++r) {
    if (Z[r] == 0.0) continue;
    for (int64_t c = 0; c < ni; ++c) a[c] = e[r * ld + c] * IZ[i0 + r];
    cols.add_row(a, ni);
  }
  cols.store(P.dcol.data_ptr<double>() + bh * P.T + i0, ni);
}

// Phase 1 of the qk op (heads split into chunks): the statistics of qk_row_tile, chunk p
// taking every P-th tile row.
void qk_row_phase(Problem& P, const QK& Q) {
  at::parallel_for(0, P.BH * P.P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / P.P, p = task % P.P;
      if (P.bad[bh]) continue;
      for (int64_t I = p; I < P.nb(bh); I += P.P) qk_row_tile(P, Q, bh, I, nullptr, P.thread_extra());
    }
  });
}

// Where the recomputed A may be nonzero: everywhere, or on and below the diagonal if causal.
void qk_extents(Problem& P, const QK& Q) {
  for (int64_t bh = 0; bh < P.BH; ++bh) {
    const int64_t groups = (P.n[bh / P.H] + 7) / 8;
    Extent* ext = P.ext_of(bh);
    for (int64_t k = 0; k < groups; ++k)
      ext[k] = {0, static_cast<int32_t>(Q.causal ? k : groups - 1)};
  }
}

// rows_too (one head, `only`): qk_row_tile holds each tile row of A in this thread's
// buffer (exp(l - m) per key block) just before its pairs, whose A_IJ tiles then cost one
// multiply per entry (by exp(m - M) / Z); other tiles (A_JI, and every tile without
// rows_too) are recomputed from the rows' statistics.
void qk_tiles_phase(Problem& P, const QK& Q, const Range* only = nullptr, bool rows_too = false) {
  // (the scratch holds a HeldRow only with rows_too, see vas_head_stats_qk_cpu)
  const HeldRow row = rows_too ? HeldRow{P.thread_extra(), P.Tp, P.thread_extra() + TB * P.Tp,
                                         max_key_blocks(P.T)}
                               : HeldRow{};
  int64_t held = -1;  // the tile row in `row` (rows_too: this thread's only head)
  auto row_tile = [&](int64_t bh, int64_t I) {
    if (rows_too) {
      qk_row_tile(P, Q, bh, I, &row, nullptr);
      set_shifts(P, bh, I);
      held = I;
    }
    return true;
  };
  tiles_phase(P, row_tile, [&](int64_t bh, int64_t i0, int64_t ni, int64_t j0, int64_t nj,
                               float* buf, int64_t& lda, bool) -> const float* {
    const int64_t b = bh / P.H, s = P.s[b];
    const float* M = Q.mrow.data_ptr<float>() + bh * P.T;
    const float* IZ = Q.izrow.data_ptr<float>() + bh * P.T;
    lda = kLd;
    if (i0 == held * TB) {
      const int64_t blk = KeyBlocks(s, P.T).npre + j0 / TB;
      for (int64_t r = 0; r < ni; ++r) {
        const float f = std::exp(row.m[r * row.mld + blk] - M[i0 + r]) * IZ[i0 + r];
        const float* e = row.e + r * row.ld + s + j0;
        for (int64_t c = 0; c < nj; ++c) buf[r * kLd + c] = e[c] * f;
      }
      return buf;
    }
    const float* qb = Q.q.data_ptr<float>() + bh * P.T * Q.D;
    const float* kb = key_rows(P, Q, bh);
    gemm_nn(ni, nj, Q.D, Q.scale, qb + i0 * Q.D, Q.D, kb + (s + j0), P.Tp, buf, kLd);
    for (int64_t r = 0; r < ni; ++r) {
      float* l = buf + r * kLd;
      const float m = M[i0 + r], iz = IZ[i0 + r];
      const int64_t lim = Q.causal ? std::max<int64_t>(0, std::min(nj, i0 + r - j0 + 1)) : nj;
      Q.mask_keys(l, b, s + j0, lim, P.T);  // padding: exp(-inf) = 0 (all-padding rows: iz = 0)
      cpu::exp_shift_scale(l, l, lim, m, iz);
      for (int64_t c = lim; c < nj; ++c) l[c] = 0.0f;
    }
    return buf;
  }, only);
}

at::Tensor vas_head_stats_qk_cpu(const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& head_writes, const at::Tensor& lengths,
                                 std::optional<double> scale, bool causal,
                                 const std::optional<at::Tensor>& offsets,
                                 const std::optional<at::Tensor>& key_padding_mask) {
  const char* op = "headscope::vas_head_stats_qk";
  check_head_stats_qk_args(q, k, head_writes, lengths, scale, offsets, key_padding_mask);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dh = head_writes.size(3);
  if (B == 0 || H == 0) return at::empty({B, H, 3}, q.options().dtype(at::kFloat));
  Problem P;
  setup(P, B, H, T, Dh, lengths, offsets, op);
  // a tile row of A (HeldRow) with whole heads per thread, else one key block
  alloc_scratch(P, P.fused ? TB * (P.Tp + max_key_blocks(T)) : TB * TB);
  QK Q;
  Q.Hkv = k.size(1);
  Q.D = q.size(3);
  Q.scale = static_cast<float>(scale_or_default(scale, Q.D));
  Q.causal = causal;
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "vas_q", [&] {
    using Q_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "vas_k",
                                    [&] { qk_prepare<Q_t, scalar_t>(P, Q, q, k); });
  });
  qk_extents(P, Q);
  if (P.fused) {
    // as the attention op's fused path; each tile row of A is computed once, just before
    // its pairs (only A_JI tiles, without a causal mask, are recomputed)
    at::Tensor out = at::empty({B, H, 3}, q.options().dtype(at::kFloat));
    for_each_head(P, [&](const Range& r) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, head_writes.scalar_type(),
                                      "vas_v", [&] { prepare_values<scalar_t>(P, head_writes, &r); });
      qk_tiles_phase(P, Q, &r, /*rows_too=*/true);
      finalize_into(P, out.data_ptr<float>(), &r);
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, head_writes.scalar_type(), "vas_v",
                                  [&] { prepare_values<scalar_t>(P, head_writes); });
  qk_row_phase(P, Q);
  shifts_phase(P);
  qk_tiles_phase(P, Q);
  return finalize(P, q.options());
}

// ---- vas_aggregate -------------------------------------------------------------------

at::Tensor vas_aggregate_cpu(const at::Tensor& head_stats) {
  check_aggregate_args(head_stats);
  const auto st = head_stats.to(at::kDouble).contiguous();
  const int64_t B = st.size(0), L = st.size(1), H = st.size(2);
  at::Tensor out = at::empty({B, 36}, head_stats.options().dtype(at::kFloat));
  const double* x = st.data_ptr<double>();
  float* o = out.data_ptr<float>();
  // NaN-propagating max / min (NumPy's max and min return NaN when any entry is NaN)
  auto mx = [](double a, double v) { return std::isnan(a) ? a : (std::isnan(v) || v > a ? v : a); };
  auto mn = [](double a, double v) { return std::isnan(a) ? a : (std::isnan(v) || v < a ? v : a); };
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> lay(L * 4);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t qi = 0; qi < 3; ++qi) {
        for (int64_t l = 0; l < L; ++l) {
          const double* v = x + ((b * L + l) * H) * 3 + qi;
          double sum = 0, hi = v[0], lo = v[0];
          for (int64_t h = 0; h < H; ++h) {
            sum += v[h * 3];
            hi = mx(hi, v[h * 3]);
            lo = mn(lo, v[h * 3]);
          }
          const double mean = sum / static_cast<double>(H);
          double var = 0;
          for (int64_t h = 0; h < H; ++h) var += (v[h * 3] - mean) * (v[h * 3] - mean);
          // the seed stores the per-layer stats as float32
          lay[l * 4 + 0] = static_cast<float>(mean);
          lay[l * 4 + 1] = static_cast<float>(std::sqrt(var / static_cast<double>(H)));
          lay[l * 4 + 2] = static_cast<float>(hi);
          lay[l * 4 + 3] = static_cast<float>(lo);
        }
        for (int64_t a = 0; a < 4; ++a) {
          double sum = 0, hi = lay[a];
          for (int64_t l = 0; l < L; ++l) {
            sum += lay[l * 4 + a];
            hi = mx(hi, lay[l * 4 + a]);
          }
          const double mean = sum / static_cast<double>(L);
          double var = 0;
          for (int64_t l = 0; l < L; ++l) var += (lay[l * 4 + a] - mean) * (lay[l * 4 + a] - mean);
          float* ob = o + b * 36 + qi * 12 + a * 3;
          ob[0] = static_cast<float>(mean);
          ob[1] = static_cast<float>(std::sqrt(var / static_cast<double>(L)));
          ob[2] = static_cast<float>(hi);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("vas_head_stats", &vas_head_stats_cpu);
  m.impl("vas_head_stats_qk", &vas_head_stats_qk_cpu);
  m.impl("vas_aggregate", &vas_aggregate_cpu);
}

}  // namespace headscope::vas
