// The tile pass of a vas CPU call: every pair of tiles (I, J), (J, I) of a head's window
// (I >= J), the live ones through kl_pair and the ones the extents show all zero in closed
// form; the tiles of A read from the attention (attn_tiles_phase) or recomputed from q and
// k and the first pass's softmax statistics (qk_tiles_phase).
#include "vas/cpu/vas_head_stats_cpu.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace headscope::vas::cpu {
namespace {

// A tile of zeros in A (rows x cols, row shifts x, column shifts y): its entries of B,
// -(x_r + y_c), into ||B||^2 (ax2) and B's column sums (colsum), in closed form. Zero tiles
// and blocks are skipped: their KL terms, p log(p / q) with p at the clip, are under 3e-11
// each and left out (docs/vas.md, differences); <B, G> needs G (kl_pair,
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

// Whether tile (I, J) of a head's window may hold a nonzero of A.
bool tile_live(const Extent* ext, int64_t I, int64_t J, int64_t n) {
  const int64_t per = TB / 8, g0 = J * per;
  for (int64_t k = I * per; k < std::min((I + 1) * per, (n + 7) / 8); ++k)
    if (ext[k].hits(g0, g0 + per - 1)) return true;
  return false;
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

// The tile pass's driver: visits the lower-triangle tile pairs (I >= J) of each head, chunk p of
// P taking every P-th pair. row_tile(bh, I) runs before tile row I's pairs (false: the head
// holds a NaN or an infinity, and stops there). tile(bh, i0, ni, j0, nj, buf, lda, down)
// gives a pointer to A's tile and its row stride (buf: kLd), down when kl_pair reads it
// down its columns (A_JI beside a live A_IJ); it is called only for tiles the extents say
// may hold a nonzero.
template <typename RowFn, typename TileFn>
void tiles_phase(Problem& P, RowFn&& row_tile, TileFn&& tile, const Range* only) {
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

// rows_too: the first pass of each tile row just before its pairs, while its rows are in
// cache (the row KL's sums do not need the other rows first).
template <typename A_t>
void attn_tiles_phase_typed(Problem& P, const at::Tensor& attn, const Range* only,
                            bool rows_too) {
  const auto A = in4<A_t>(attn);
  const int64_t s3 = attn.stride(3);
  const bool direct = std::is_same<A_t, float>::value && s3 == 1;
  auto row_tile = [&](int64_t bh, int64_t I) {
    if (!rows_too) return true;
    if (!attn_row_tile(P, attn, bh, I, P.row_scratch())) return false;
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

}  // namespace

void attn_tiles_phase(Problem& P, const at::Tensor& attn, const Range* only, bool rows_too) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "vas_a",
                                  [&] { attn_tiles_phase_typed<scalar_t>(P, attn, only, rows_too); });
}

// rows_too: qk_row_tile holds each tile row of A in this thread's buffer (exp(l - m) per
// key block) just before its pairs, whose A_IJ tiles then cost one multiply per entry (by
// exp(m - M) / Z); other tiles (A_JI, and every tile without rows_too) are recomputed from
// the rows' statistics.
void qk_tiles_phase(Problem& P, const QK& Q, const Range* only, bool rows_too) {
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
      int64_t a, e;  // the row's keys in the tile: [a, e)
      Q.row_keys(P, b, i0 + r, s + j0, nj, a, e);
      if (e > a) {
        Q.mask_row(P, l, b, i0 + r, s + j0, a, e);  // exp(-inf) = 0 (all-padding rows: iz = 0)
        exp_shift_scale(l + a, l + a, e - a, m, iz);
      } else {
        a = e = 0;
      }
      std::fill(l, l + a, 0.0f);
      std::fill(l + e, l + nj, 0.0f);
    }
    return buf;
  }, only);
}

}  // namespace headscope::vas::cpu
