// The first pass of a vas CPU call, one tile row of a head at a time: A's row sums, the
// column sums of the row's diagonal tile and where its rows are nonzero (Extent), read from
// the attention (attn_*) or recomputed from q and k with an online softmax (qk_*); and from
// them the row and column shifts of the tile pass (set_shifts).
#include "vas/cpu/vas_head_stats_cpu.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace headscope::vas::cpu {
namespace {

// The sum of n floats in double lanes (A's row sums: B's row sums r_i - n x_i - sum(y) are
// small where B is near Ac, and a float sum's rounding, ~1e-7 r_i, would be most of them).
// kGroups (n <= 256): also, in `groups`, bit g set when
// columns [8 g, 8 g + 8) hold a nonzero (or NaN).
template <bool kGroups>
inline double sum_f64(const float* x, int64_t n, uint32_t* groups = nullptr) {
  d4 s[2] = {};
  uint32_t mask = 0;
  for_each8(x, n, [&](f8 v, int64_t j) {
    s[0] += widen_lo(v);
    s[1] += widen_hi(v);
    if constexpr (kGroups) mask |= static_cast<uint32_t>(any_nonzero(v)) << (j / 8);
  });
  if constexpr (kGroups) *groups = mask;
  const d4 t = s[0] + s[1];
  return (t[0] + t[1]) + (t[2] + t[3]);
}

// The sum of n floats as hi + lo (double lanes, TwoSum): a row that is one key's weight plus
// entries 1e-16 of it and less (an attention sink's one-hot rows) loses those entries in a
// plain double sum, and with them c where ||Ac|| is that small against ||A||. Seven
// additions for each of sum_f64's one: taken only for heads that need it (finalize_into's
// refine).
inline void sum_f64_exact(const float* x, int64_t n, double& hi, double& lo) {
  d4 s[2] = {}, e[2] = {};
  for_each8(x, n, [&](f8 v, int64_t) {
    two_sum(s[0], e[0], widen_lo(v));
    two_sum(s[1], e[1], widen_hi(v));
  });
  hi = lo = 0;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      two_sum(hi, lo, s[h][k]);
      lo += e[h][k];
    }
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

// attn_row_tile over rows [I TB, I TB + TB) of the head's window.
template <typename A_t>
bool attn_row_tile_typed(Problem& P, const In4<A_t>& A, int64_t s3, int64_t bh, int64_t I,
                         float* row) {
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

template <typename A_t>
void attn_exact_row_sums_typed(Problem& P, const at::Tensor& attn, int64_t bh) {
  const auto A = in4<A_t>(attn);
  double* rsum = P.rsum.data_ptr<double>() + bh * P.T;
  double* rlo = P.rlo.data_ptr<double>() + bh * P.T;
  const int64_t n = P.n[bh / P.H];
  for (int64_t i = 0; i < n; ++i)
    sum_f64_exact(window_row(P, A, attn.stride(3), bh, i, P.row_scratch()), n, rsum[i], rlo[i]);
}

template <typename A_t>
void attn_row_phase_typed(Problem& P, const at::Tensor& attn) {
  const auto A = in4<A_t>(attn);
  at::parallel_for(0, P.BH * P.P, 1, [&](int64_t begin, int64_t end) {
    float* row = P.row_scratch();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / P.P, p = task % P.P;
      if (P.bad[bh]) continue;
      for (int64_t I = p; I < P.nb(bh); I += P.P) {
        if (!attn_row_tile_typed(P, A, attn.stride(3), bh, I, row)) {
          P.chunkbad.data_ptr<uint8_t>()[bh * P.P + p] = 1;
          break;
        }
      }
    }
  });
}


}  // namespace

bool attn_row_tile(Problem& P, const at::Tensor& attn, int64_t bh, int64_t I, float* row) {
  bool ok = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "vas_a", [&] {
    ok = attn_row_tile_typed(P, in4<scalar_t>(attn), attn.stride(3), bh, I, row);
  });
  return ok;
}

void attn_row_phase(Problem& P, const at::Tensor& attn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "vas_a",
                                  [&] { attn_row_phase_typed<scalar_t>(P, attn); });
}

void attn_exact_row_sums(Problem& P, const at::Tensor& attn, int64_t bh) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "vas_a",
                                  [&] { attn_exact_row_sums_typed<scalar_t>(P, attn, bh); });
}

// The shifts of tile row I's rows and columns for the tile pass (see PairArgs), once its
// row sums r and diagonal column sums are known: x_i = (r_i - r0) / n, r0 the mean row sum
// of tile row 0 (the same for every row: a row constant is left to the column shifts), and
// y_j the mean over tile row I's rows of a_ij - x_i. Wherever A is close to a row constant
// plus a column constant (one column taking most of every row's weight, an attention
// sink), B is then close to Ac, and b = (a - y) - x is formed from nearby numbers (its
// column part first, as the reference's centring subtracts the column means first). Any shifts
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

void shifts_phase(Problem& P) {
  at::parallel_for(0, P.BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh)
      if (!P.bad[bh])
        for (int64_t I = 0; I < P.nb(bh); ++I) set_shifts(P, bh, I);
  });
}

void merge_bad_chunks(Problem& P) {
  const uint8_t* cb = P.chunkbad.data_ptr<uint8_t>();
  for (int64_t bh = 0; bh < P.BH; ++bh)
    for (int64_t p = 0; p < P.P; ++p) P.bad[bh] |= cb[bh * P.P + p];
}


// softmax: the statistics that recompute any tile of the row (row max M, 1 / denominator
// Z), its sums over the window's columns and the column sums of its diagonal tile (for
// set_shifts; that tile's key block comes last, so its exp(l - m) has the final m); with
// `held`, the row itself too, else each block reuses `scratch` (TB x TB).
void qk_row_tile(Problem& P, const QK& Q, int64_t bh, int64_t I, const HeldRow* held,
                 float* scratch) {
  const int64_t b = bh / P.H, n = P.n[b], s = P.s[b];
  const int64_t i0 = I * TB, ni = std::min(TB, n - i0);
  // the tile row's keys: from the first any row sees to the last (at least its own
  // position: every row sees itself)
  int64_t kbegin = P.T, kend = s + i0 + ni;
  for (int64_t r = 0; r < ni; ++r) {
    const int64_t lo = Q.klo[b * P.T + i0 + r], hi = Q.khi[b * P.T + i0 + r];
    if (lo > hi) continue;
    kbegin = std::min(kbegin, lo);
    kend = std::max(kend, hi + 1);
  }
  const KeyBlocks kb(s, kend);
  const int64_t ld = held ? held->ld : TB;
  const float* qb = Q.q.data_ptr<float>() + bh * P.T * Q.D;
  double Z[TB], R[TB];
  float Mx[TB];
  for (int64_t r = 0; r < ni; ++r) Z[r] = R[r] = 0, Mx[r] = -std::numeric_limits<float>::infinity();
  const int64_t nblk = kb.count(), diag = kb.npre + I;
  for (int64_t t = 0; t < nblk; ++t) {
    const int64_t blk = t == nblk - 1 ? diag : t + (t >= diag);
    const int64_t k0 = kb.begin(blk), nk = kb.end(blk) - k0;
    // keys no row sees (before a window or chunk): their entries are never read (extents)
    if (blk != diag && k0 + nk <= kbegin) continue;
    float* L = held ? held->e + k0 : scratch;
    gemm_nn(ni, nk, Q.D, Q.scale, qb + i0 * Q.D, Q.D, key_rows(P, Q, bh) + k0, P.Tp, L, ld);
    for (int64_t r = 0; r < ni; ++r) {
      float* l = L + r * ld;
      int64_t a, e;  // the row's keys in this block: [a, e)
      Q.row_keys(P, b, i0 + r, k0, nk, a, e);
      const bool any = e > a;
      float mx = Mx[r];
      if (any) {
        Q.mask_row(P, l, b, i0 + r, k0, a, e);
        mx = std::max(mx, max_of(l + a, e - a));
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
      if (any) Z[r] += exp_shift_scale(l + a, l + a, e - a, mx, 1.0f);
      if (held || blk == diag) {
        if (!any) a = e = 0;
        std::fill(l, l + a, 0.0f);
        std::fill(l + e, l + nk, 0.0f);
      }
      // the window's columns [s, s + n) within this block
      const int64_t c0 = std::max<int64_t>(a, s - k0), c1 = std::min(e, s + n - k0);
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

void qk_row_phase(Problem& P, const QK& Q) {
  at::parallel_for(0, P.BH * P.P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / P.P, p = task % P.P;
      if (P.bad[bh]) continue;
      for (int64_t I = p; I < P.nb(bh); I += P.P) qk_row_tile(P, Q, bh, I, nullptr, P.thread_extra());
    }
  });
}

void qk_extents(Problem& P, QK& Q) {
  Q.klo.assign(P.B * P.T, 0);
  Q.khi.assign(P.B * P.T, -1);
  Q.kqb.assign(P.B * P.T, -1);
  if (Q.pat.row[0].has_blocks()) Q.block_seen.assign(P.B, {});
  std::vector<Extent> ext_b;  // the same for every head of a batch row
  for (int64_t b = 0; b < P.B; ++b) {
    const int64_t n = P.n[b], s = P.s[b], groups = (n + 7) / 8;
    ext_b.assign(groups, Extent{std::numeric_limits<int32_t>::max(), -1});
    for (int64_t i = 0; i < n; ++i) {
      int64_t lo, hi, qb;
      Q.pat.keys(Q.pat.row[b], b, s + i, lo, hi, qb);
      lo = std::max<int64_t>(lo, 0);
      Q.klo[b * P.T + i] = lo;
      Q.khi[b * P.T + i] = hi;
      Q.kqb[b * P.T + i] = qb;
      if (qb >= 0) {
        auto [it, fresh] = Q.block_seen[b].try_emplace(qb, lo, hi);
        it->second.first = std::min(it->second.first, lo);
        it->second.second = std::max(it->second.second, hi);
      }
      // the window's columns [s, s + n) among the keys
      const int64_t c0 = std::max<int64_t>(lo - s, 0), c1 = std::min<int64_t>(hi - s, n - 1);
      if (c0 > c1) continue;
      Extent& x = ext_b[i / 8];
      x.lo = std::min(x.lo, static_cast<int32_t>(c0 / 8));
      x.hi = std::max(x.hi, static_cast<int32_t>(c1 / 8));
    }
    for (int64_t h = 0; h < P.H; ++h) std::copy(ext_b.begin(), ext_b.end(), P.ext_of(b * P.H + h));
  }
}

}  // namespace headscope::vas::cpu
