// The tile pass's kernel: one pair of tiles (A_IJ, A_JI) of a head against the value Gram
// G_IJ (PairArgs), in 8 x 8 blocks of float lanes. Sums run in float within an 8-row strip
// (short enough to keep the 1e-4 target with room to spare) and in double across strips.
#include "vas/cpu/vas_head_stats_cpu.h"

#include <algorithm>
#include <cstring>

namespace headscope::vas::cpu {
namespace {

constexpr int64_t kPanel = 24;  // Gram rows per panel: four 6 x 16 blocks of gemm_nn

// The running sums of kl_pair over one 8-row strip, in float lanes.
struct StripSums {
  f8 hs;  // 1 / (2 mS)
  f8 kl = {}, ap = {}, ag = {}, ax2 = {}, a2 = {};

  // hs (e_i + e_j + 1): q = hs g_ij + this is the reference's S_ij / mS before its clip
  f8 q_offsets(float e_row, f8 e_cols) const { return (e_cols + e_row) * hs + hs; }

  // One row piece of A against its Gram values gv (Vn Vn^T or W W^T; row shift x, column
  // shifts y; qo: q_offsets); returns its b. kMasked (a tile's edge): keep is 1 in the lanes inside the
  // tile (A is 0 and G finite outside), which alone count.
  template <bool kMasked>
  f8 entry(f8 av, f8 gv, f8 qo, float x, f8 y, f8 keep) {
    const f8 a1 = vmax(av, f8{} + kTiny);                   // a'
    const f8 q = vmax(gv * hs + qo, f8{} + static_cast<float>(kClip));  // the reference's q
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
    const float sx = hsum_f64(x), nr = static_cast<float>(nx);
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
  const f8 yj = vload_part(a.yj + jb, kFull ? 8 : cols);
  if (live_ij) {
    const f8 keep_cols = kFull ? f8{} : lane_mask(cols);
    const f8 ej = vload_part(a.evj + jb, kFull ? 8 : cols);
    f8 col_j = {};
    for (int64_t r = 0; r < (kFull ? 8 : rows); ++r) {
      const float* ar = a.aij + (ib + r) * a.lij + jb;
      f8 av, gv;
      if constexpr (kFull) {
        std::memcpy(&av, ar, sizeof av);
      } else {
        av = vload_part(ar, cols);
      }
      std::memcpy(&gv, g + r * TB, sizeof gv);
      col_j += st.entry<!kFull>(av, gv, st.q_offsets(a.evi[ib + r], ej), a.xi[ib + r], yj,
                                keep_cols);
    }
    for (int64_t k = 0; k < (kFull ? 8 : cols); ++k) a.cj[jb + k] += col_j[k];
  } else {
    const f8 x = vload_part(a.xi + ib, kFull ? 8 : rows);
    const f8 col_j = st.zero_sums(x, rows, yj, cols);
    st.zero_gram(x, yj, rows, g);
    for (int64_t k = 0; k < (kFull ? 8 : cols); ++k) a.cj[jb + k] += col_j[k];
  }
  if (!upper) return;
  const f8 y = vload_part(a.yi + ib, kFull ? 8 : rows);
  if (!live_ji) {
    const f8 x = vload_part(a.xj + jb, kFull ? 8 : cols);
    st.zero_gram(y, x, rows, g);
    // its other sums: here, or (a tile of zeros) in closed form by the caller
    if (a.aji != nullptr) col_i += st.zero_sums(x, cols, y, rows);
    return;
  }
  const f8 keep_rows = kFull ? f8{} : lane_mask(rows);
  const f8 ei = vload_part(a.evi + ib, kFull ? 8 : rows);
  f8 gt[8];
  for (int r = 0; r < 8; ++r) std::memcpy(&gt[r], g + r * TB, sizeof(f8));
  transpose8x8(gt);  // gt[c]: G_JI row jb + c, columns ib..
  for (int64_t c = 0; c < (kFull ? 8 : cols); ++c) {
    const float* ar = a.aji + (jb + c) * a.lji + ib;
    f8 av;
    if constexpr (kFull) {
      std::memcpy(&av, ar, sizeof av);
    } else {
      av = vload_part(ar, rows);
    }
    col_i += st.entry<!kFull>(av, gt[c], st.q_offsets(a.evj[jb + c], ei), a.xj[jb + c], y,
                              keep_rows);
  }
}

}  // namespace

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
      acc.kl += hsum_f64(st.kl);
      acc.ap += hsum_f64(st.ap);
      acc.ag += hsum_f64(st.ag);
      acc.ax2 += hsum_f64(st.ax2);
      acc.a2 += hsum_f64(st.a2);
      st.kl = st.ap = st.ag = st.ax2 = st.a2 = f8{};
    }
  }
}

}  // namespace headscope::vas::cpu
