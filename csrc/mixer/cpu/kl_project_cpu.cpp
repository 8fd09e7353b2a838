// CPU kernel of headscope::kl_project: the Newton solver of the reference implementation
// (kl_projection_reference.py, docs/mixer.md), one problem per task of at::parallel_for,
// everything in double whatever the input dtype.
#include "common/cpu_math.h"
#include "common/kernel.h"
#include "mixer/kl_newton.h"
#include "mixer/kl_project_setup.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace headscope::mixer::cpu {
namespace {

// The product form below is exact to rounding while every factor stays above e^-kFastRange.
constexpr double kFastRange = 200.0;

double max_abs_diff(const double* a, const double* b, int r) {  // NaN-propagating
  double m = 0;
  for (int j = 0; j < r; ++j) {
    const double v = std::fabs(a[j] - b[j]);
    if (!(v <= m)) m = v;
  }
  return m;
}

constexpr int W = kWideLanes;
// The Gram kernel's register tile: kTileJ x kTileK accumulators and kTileJ loaded vectors,
// within AVX-512's 32 vector registers (4 x 4) or AVX's 16 (2 x 4).
constexpr int kTileK = 4;
constexpr int kTileJ = W == 8 ? 4 : 2;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// An n x r matrix in panels: the rows in blocks of W (one vector per column, a row per
// lane), block b's column j at (b * cols + j) * W. cols = r rounded up to whole Gram tiles;
// the last block's lanes past n are padding. Every loop over rows is then a loop of whole
// vectors with no horizontal work per row, and the Gram kernel reads contiguous blocks.
// Per-row values (row maxima, 1 / row sums) are arrays of blocks * W doubles, row i at i.
struct Panels {
  int64_t n, blocks;
  int r, cols;
  iw last_rows;  // the lanes of the last block that hold rows
  Panels(int64_t n_, int r_)
      : n(n_),
        blocks((n_ + W - 1) / W),
        r(r_),
        cols(static_cast<int>(round_up(r_, kTileK))),
        last_rows(wiota() < static_cast<double>(n_ - (blocks - 1) * W)) {}
  int64_t size() const { return blocks * cols * W; }
  int64_t at(int64_t b, int j) const { return (b * cols + j) * W; }
  // the lanes of block b that hold rows (all but the last block's padding), all ones
  iw valid(int64_t b) const { return b + 1 < blocks ? iw{} - 1 : last_rows; }
  // Blocks per chunk: a chunk's panels (16 KiB) stay in L1 from one pass over it to the
  // next; an even count, so that a chunk holds whole groups of 8 rows.
  int64_t chunk() const { return std::max<int64_t>(2, 16 * 1024 / (cols * W * sizeof(double)) / 2 * 2); }
};

// 8 consecutive entries of src as doubles, and back.
template <typename scalar_t>
d8 load8(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, float>)
    return __builtin_convertvector(vload(src), d8);
  else
    return load_d8(src);
}

template <typename scalar_t>
void store8(scalar_t* dst, const d8& v) {
  if constexpr (std::is_same_v<scalar_t, float>)
    vstore(dst, __builtin_convertvector(v, f8));
  else
    store_d8(dst, v);
}

// Column j of rows i0 .. i0 + 7 (i0 a multiple of 8) to and from panels: one vector, or
// W = 4 halves in consecutive blocks.
void put8(double* dst, Panels p, int64_t i0, int j, const d8& v) {
  double* at = dst + p.at(i0 / W, j);
  if constexpr (W == 8) {
    store_d8(at, v);
  } else {  // halves by memcpy: GCC lowers the shuffles of a portable build's d8 poorly
    std::memcpy(at, &v, sizeof(double) * W);
    std::memcpy(at + p.cols * W, reinterpret_cast<const double*>(&v) + W, sizeof(double) * W);
  }
}

d8 get8(const double* src, Panels p, int64_t i0, int j) {
  const double* at = src + p.at(i0 / W, j);
  if constexpr (W == 8) return load_d8(at);
  d8 v;
  std::memcpy(&v, at, sizeof(double) * W);
  std::memcpy(reinterpret_cast<double*>(&v) + W, at + p.cols * W, sizeof(double) * W);
  return v;
}

// Rows i .. i + 7 of an n x r row-major matrix into the cache ahead of their use (for_write:
// 1 before stores), where they exist. A chunk's input or output streams from memory, and
// this many rows ahead (8 KiB at r = 16 in float) it arrives in time.
constexpr int64_t kPrefetchRows = 128;

template <typename scalar_t>
void prefetch_rows(const scalar_t* x, Panels p, int64_t i, int for_write) {
  if (i + 8 > p.n) return;
  const char* begin = reinterpret_cast<const char*>(x + i * p.r);
  for (int64_t offset = 0; offset < int64_t{8} * p.r * int64_t{sizeof(scalar_t)}; offset += 64)
    for_write ? __builtin_prefetch(begin + offset, 1) : __builtin_prefetch(begin + offset, 0);
}

// Rows [i_begin, i_end) of src (n x r, row-major; i_begin a multiple of 8) into panels as
// doubles; padding lanes up to i_end get `pad`, columns past r 0 (the Gram tiles read them). 8 x 8 blocks are transposed in registers
// (entry by entry, a transpose costs as much as the exponentials); the edges (rows past the
// last whole 8 of n, columns past a multiple of 8) go entry by entry.
template <typename scalar_t>
void to_panels(const scalar_t* src, Panels p, int64_t i_begin, int64_t i_end, double pad,
               double* dst) {
  const int64_t n = p.n, n8 = std::min(i_end, n / 8 * 8);
  const int r = p.r, r8 = r / 8 * 8;
  for (int64_t i0 = i_begin; i0 < n8; i0 += 8) {
    prefetch_rows(src, p, i0 + kPrefetchRows, 0);
    for (int j0 = 0; j0 < r8; j0 += 8) {
      d8 t[8];
      for (int k = 0; k < 8; ++k) t[k] = load8(src + (i0 + k) * r + j0);
      transpose8x8(t);  // t[c]: column j0 + c of rows i0 .. i0 + 7
      for (int c = 0; c < 8; ++c) put8(dst, p, i0, j0 + c, t[c]);
    }
  }
  for (int64_t i = i_begin; i < i_end; ++i) {
    for (int j = i < n8 ? r8 : 0; j < r; ++j)
      dst[p.at(i / W, j) + i % W] = i < n ? static_cast<double>(src[i * r + j]) : pad;
    for (int j = r; j < p.cols; ++j) dst[p.at(i / W, j) + i % W] = 0;
  }
}

// dst (n x r, row-major, scalar_t) = the panels src times column_scale[j] times row_scale[i]
// (as to_panels, transposed in registers).
template <typename scalar_t>
void from_panels(const double* src, const double* column_scale, const double* row_scale, Panels p,
                 scalar_t* dst) {
  const int64_t n = p.n, n8 = n / 8 * 8;
  const int r = p.r, r8 = r / 8 * 8;
  for (int64_t i0 = 0; i0 < n8; i0 += 8) {
    prefetch_rows(dst, p, i0 + kPrefetchRows, 1);
    const d8 rs = load_d8(row_scale + i0);
    for (int j0 = 0; j0 < r8; j0 += 8) {
      d8 t[8];
      for (int c = 0; c < 8; ++c) {
        t[c] = get8(src, p, i0, j0 + c) * column_scale[j0 + c] * rs;
      }
      transpose8x8(t);  // t[k]: row i0 + k, columns j0 .. j0 + 7
      for (int k = 0; k < 8; ++k) store8(dst + (i0 + k) * r + j0, t[k]);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int j = i < n8 ? r8 : 0; j < r; ++j)
      dst[i * r + j] =
          static_cast<scalar_t>(src[p.at(i / W, j) + i % W] * column_scale[j] * row_scale[i]);
}

// acc += the products of columns j and k of panels P, rows weighted by inv[i]^2, summed over
// rows lane by lane, for j, k < m (a multiple of kTileK, at most P's columns) and k from j's
// tile on (the upper triangle by tiles). acc: m x m vectors, (j * m + k) * W.
void gram_accumulate(const double* P, const double* inv, Panels p, int m, double* acc) {
  // chunks of 24 KiB: the tiles pass over a chunk in L1
  const int64_t chunk = std::max<int64_t>(1, 24 * 1024 / (p.cols * W * sizeof(double)));
  for (int64_t b0 = 0; b0 < p.blocks; b0 += chunk) {
    const int64_t b1 = std::min(p.blocks, b0 + chunk);
    for (int jt = 0; jt < m; jt += kTileJ)
      for (int kt = jt / kTileK * kTileK; kt < m; kt += kTileK) {
        dw a[kTileJ][kTileK];
        for (int x = 0; x < kTileJ; ++x)
          for (int y = 0; y < kTileK; ++y) a[x][y] = wload(acc + ((jt + x) * m + kt + y) * W);
        for (int64_t b = b0; b < b1; ++b) {
          const double* pb = P + p.at(b, 0);
          const dw ib = wload(inv + b * W), wb = ib * ib;
          dw u[kTileJ];
          for (int x = 0; x < kTileJ; ++x) u[x] = wload(pb + (jt + x) * W) * wb;
          for (int y = 0; y < kTileK; ++y) {
            const dw v = wload(pb + (kt + y) * W);
            for (int x = 0; x < kTileJ; ++x) a[x][y] += u[x] * v;
          }
        }
        for (int x = 0; x < kTileJ; ++x)
          for (int y = 0; y < kTileK; ++y) wstore(acc + ((jt + x) * m + kt + y) * W, a[x][y]);
      }
  }
}

// One log-reference matrix L (n x r) and P = softmax_rows(L + sign * z) at the last z
// evaluated, kept as P_ij = T_ij * s_j * inv_i: a panel T, column factors s and the rows'
// 1 / sums, so that no evaluation writes an n x r matrix (the panels of both factors then
// stay in L2 through the solve).
//
// softmax(L + sign z)_ij = exp(L_ij - rowmax_i - c_j) exp(c_j + sign z_j - M) / row sum, with
// c_j the column max of the row-centred L. The first factor, E, does not depend on z: computed
// once (n r exponentials, the solver's only ones at scale), it turns each Newton evaluation into
// 2 n r multiply-adds, n divisions and n logarithms, on whole vectors of rows; a step's
// exponentials are r, for s. When a factor could underflow (extreme inputs or z),
// evaluation falls back to the reference implementation's direct form: T = exp(L_ij +
// sign z_j - max_j(...)) in a panel of its own, s = 1.
template <typename scalar_t>
class SoftmaxRows {
 public:
  // Doubles of scratch one factor takes.
  static int64_t scratch_size(Panels p) { return 2 * p.size() + 2 * p.blocks * W; }

  SoftmaxRows(const scalar_t* L, Panels p, int sign, double* scratch)
      : L_(L),
        p_(p),
        sign_(sign),
        E_(scratch),
        direct_(E_ + p.size()),
        rowmax_(direct_ + p.size()),
        inv_(rowmax_ + p.blocks * W),
        c_(p.r),
        s_(p.r),
        colsum_(p.r) {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    const int r = p.r;
    double* E = E_;
    double* rowmax = rowmax_;
    // Chunk by chunk, E takes L (padding lanes -inf: no part in the column maxima); the row
    // maxima (padding 0) and the column maxima of the row-centred L follow while the chunk
    // is in L1, one accumulator per column.
    std::vector<dw> colmax(r, dw{} - kInf);
    const int64_t chunk = p.chunk();
    for (int64_t b0 = 0; b0 < p.blocks; b0 += chunk) {
      const int64_t b1 = std::min(p.blocks, b0 + chunk);
      to_panels(L, p, b0 * W, b1 * W, -kInf, E);
      for (int64_t b = b0; b < b1; ++b) {
        dw m = dw{} - kInf;
        for (int j = 0; j < r; ++j) m = vmax(m, wload(E + p.at(b, j)));
        wstore(rowmax + b * W, keep_lanes(p.valid(b), m));
      }
      for (int j = 0; j < r; ++j) {
        dw acc = dw{} - kInf;
        for (int64_t b = b0; b < b1; ++b)
          acc = vmax(acc, wload(E + p.at(b, j)) - wload(rowmax + b * W));
        colmax[j] = vmax(colmax[j], acc);
      }
    }
    for (int j = 0; j < r; ++j) {
      c_[j] = -kInf;
      for (int l = 0; l < W; ++l) c_[j] = std::max(c_[j], colmax[j][l]);
    }
    // The exponentials, and the lowest argument (the fast form's range check) alongside:
    // full blocks unmasked, the last one with its padding set to exp(...) = 0.
    dw lowest = {};
    const double* c = c_.data();
    auto exp_block = [&](int64_t b, auto masked) {
      const iw valid = p.valid(b);
      const dw m = wload(rowmax + b * W);
      for (int j = 0; j < r; ++j) {
        dw x = (wload(E + p.at(b, j)) - m) - c[j];
        if constexpr (decltype(masked)::value) x = keep_lanes(valid, x);
        lowest = vmin(lowest, x);
        dw e = exp_nonpositive(x);
        if constexpr (decltype(masked)::value) e = keep_lanes(valid, e);
        wstore(E + p.at(b, j), e);
      }
    };
    const int64_t full = p.n / W;
    for (int64_t b = 0; b < full; ++b) exp_block(b, std::false_type{});
    if (full < p.blocks) exp_block(full, std::true_type{});
    double low = 0;
    for (int l = 0; l < W; ++l) low = std::min(low, lowest[l]);
    fast_ok_ = p.n > 0 && low >= -kFastRange;  // NaN inputs reach the residual either way
  }

  // P at z: adds its column sums to colsum; returns {sum_i LSE_i, sum_i |LSE_i|} of the rows
  // of L + sign z (the dual objective's terms).
  std::pair<double, double> evaluate(const double* z, double* colsum) {
    // Locals throughout: stores could alias the members as far as the compiler knows.
    const Panels p = p_;
    const int r = p.r;
    const double* rowmax = rowmax_;
    double* inv = inv_;
    double* s = s_.data();
    double hi = -std::numeric_limits<double>::infinity(), lo = -hi;
    for (int j = 0; j < r; ++j) {
      s[j] = c_[j] + sign_ * z[j];
      hi = std::max(hi, s[j]);
      lo = std::min(lo, s[j]);
    }
    fast_ = fast_ok_ && hi - lo <= kFastRange;
    for (int j = 0; j < r; ++j) s[j] = fast_ ? exp_nonpositive(s[j] - hi) : 1.0;
    const double* T = fast_ ? E_ : direct_;
    dw* colsums = colsum_.data();
    std::fill(colsums, colsums + r, dw{});
    // Chunk by chunk: the row sums (each row's LSE and 1 / sum), then column by column
    // sum_i T_ij inv_i while the chunk is in L1 (one accumulator per column).
    const int64_t chunk = p.chunk();
    dw dual = {}, scale = {};
    for (int64_t b0 = 0; b0 < p.blocks; b0 += chunk) {
      const int64_t b1 = std::min(p.blocks, b0 + chunk);
      for (int64_t b = b0; b < b1; ++b) {
        dw shift;  // LSE = shift + log(total), row by row
        if (fast_)
          shift = wload(rowmax + b * W) + hi;
        else
          direct_block(b, z, shift);
        const double* tb = T + p.at(b, 0);
        dw total = {};
        for (int j = 0; j < r; ++j) total += wload(tb + j * W) * s[j];
        const iw valid = p.valid(b);
        total += keep_lanes(~valid, dw{} + 1.0);  // padding: T = 0, a sum of 1 and log 1, no NaN
        wstore(inv + b * W, 1.0 / total);
        const dw lse = keep_lanes(valid, shift + log_positive_normal(total));
        dual += lse;
        scale += vabs(lse);
      }
      for (int j = 0; j < r; ++j) {
        dw sum = {};
        for (int64_t b = b0; b < b1; ++b) sum += wload(T + p.at(b, j)) * wload(inv + b * W);
        colsums[j] += sum;
      }
    }
    for (int j = 0; j < r; ++j) colsum[j] += s[j] * hsum(colsums[j]);
    return {hsum(dual), hsum(scale)};
  }

  // G[j * r + k] += (P^T P)_jk for j, k < r - 1 at the last z evaluated; acc: scratch of
  // m x m vectors, m = r - 1 rounded up to whole tiles.
  void add_gram(double* G, int m, double* acc) const {
    const Panels p = p_;
    const int k_end = p.r - 1;
    std::fill(acc, acc + int64_t{m} * m * W, 0.0);
    // P_ij P_ik = T_ij T_ik inv_i^2 s_j s_k
    gram_accumulate(fast_ ? E_ : direct_, inv_, p, m, acc);
    for (int j = 0; j < k_end; ++j)
      for (int k = 0; k < k_end; ++k)
        G[j * p.r + k] +=
            s_[j] * s_[k] * hsum(wload(acc + (std::min(j, k) * m + std::max(j, k)) * W));
  }

  // P at the last z evaluated into out (n x r, row-major).
  void write(scalar_t* out) const { from_panels(fast_ ? E_ : direct_, s_.data(), inv_, p_, out); }

 private:
  // The direct form for block b: T = exp(L + sign z - m) per row, m its row max, in shift.
  // Padding lanes and columns past r: 0, and a shift of 0.
  void direct_block(int64_t b, const double* z, dw& shift) const {
    const int r = p_.r;
    double* tb = direct_ + p_.at(b, 0);
    for (int j = r; j < p_.cols; ++j) wstore(tb + j * W, dw{});
    for (int l = 0; l < W; ++l) {
      const int64_t i = b * W + l;
      if (i >= p_.n) {
        for (int j = 0; j < r; ++j) tb[j * W + l] = 0;
        shift[l] = 0;
        continue;
      }
      const scalar_t* li = L_ + i * r;
      double m = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < r; ++j) m = std::max(m, li[j] + sign_ * z[j]);
      shift[l] = m;
      for (int j = 0; j < r; ++j) tb[j * W + l] = std::exp(li[j] + sign_ * z[j] - m);
    }
  }

  const scalar_t* L_;
  Panels p_;
  int sign_;
  double* E_;       // panels: exp(L - rowmax - c)
  double* direct_;  // panels: T of the direct form (touched only when it is used)
  double* rowmax_;  // per row
  double* inv_;     // per row: 1 / sum_j T_ij s_j at the last z
  std::vector<double> c_, s_;
  std::vector<dw> colsum_;  // per column, lane-wise partial sums
  bool fast_ok_ = false;    // whether E is usable (its range is within kFastRange)
  bool fast_ = false;       // whether the last evaluation used E
};

// Column sums of U and V at one z.
struct State {
  std::vector<double> cu, cv;
  double grad_sq = 0;
  double dual = 0, dual_scale = 0;  // the dual objective and its rounding scale
  explicit State(int r) : cu(r), cv(r) {}
};

struct Solution {
  int64_t iters;
  double residual;
};

// The reduced Newton system reads only H's leading r - 1 rows and columns: the Gram
// products cover those, in whole tiles.
int gram_columns(int r) { return static_cast<int>(round_up(r - 1, kTileK)); }

// Doubles of scratch solve_one needs: both factors' and the Gram accumulators.
template <typename scalar_t>
int64_t scratch_size(Panels p) {
  const int64_t m = gram_columns(p.r);
  return 2 * SoftmaxRows<scalar_t>::scratch_size(p) + m * m * W;
}

// Only the current state's Hessian needs P, and it is formed right after the evaluation
// that accepted the state, so the factors' last evaluation serves the state and the trials.
template <typename scalar_t>
Solution solve_one(const scalar_t* a, const scalar_t* b, int64_t n, int r, double tol,
                   int64_t max_iter, double* scratch, scalar_t* U, scalar_t* V, scalar_t* z_out) {
  const Panels p(n, r);
  const int64_t factor_scratch = SoftmaxRows<scalar_t>::scratch_size(p);
  SoftmaxRows<scalar_t> pu(a, p, +1, scratch);
  SoftmaxRows<scalar_t> pv(b, p, -1, scratch + factor_scratch);
  double* acc = scratch + 2 * factor_scratch;

  auto evaluate = [&](const std::vector<double>& z, State& s) {
    std::fill(s.cu.begin(), s.cu.end(), 0.0);
    std::fill(s.cv.begin(), s.cv.end(), 0.0);
    const auto [du, su] = pu.evaluate(z.data(), s.cu.data());
    const auto [dv, sv] = pv.evaluate(z.data(), s.cv.data());
    s.dual = du + dv;
    s.dual_scale = su + sv;
    s.grad_sq = 0;
    for (int j = 0; j < r; ++j) s.grad_sq += (s.cu[j] - s.cv[j]) * (s.cu[j] - s.cv[j]);
  };

  const int m = gram_columns(r);
  std::vector<double> z(r, 0.0), zn(r), grad(r), H(r * r), G(r * r), step(std::max(r - 1, 1)),
      work(r * r + r);
  State state(r), trial(r);
  evaluate(z, state);
  bool at_z = true;  // whether the factors' last evaluation is at z
  int64_t it = 0;
  for (; it < max_iter; ++it) {
    if (max_abs_diff(state.cu.data(), state.cv.data(), r) < tol) break;
    // H = diag(cu + cv) - U^T U - V^T V (the leading r - 1 rows and columns)
    for (int j = 0; j < r; ++j) {
      grad[j] = state.cu[j] - state.cv[j];
      for (int k = 0; k < r; ++k) H[j * r + k] = j == k ? state.cu[j] + state.cv[j] : 0.0;
    }
    std::fill(G.begin(), G.end(), 0.0);
    pu.add_gram(G.data(), m, acc);
    pv.add_gram(G.data(), m, acc);
    for (int e = 0; e < r * r; ++e) H[e] -= G[e];
    if (!solve_reduced_newton(H.data(), grad.data(), r, work.data(), step.data())) break;
    bool accepted = false;
    for (double alpha = 1.0; alpha > kMinStep; alpha *= 0.5) {
      for (int j = 0; j + 1 < r; ++j) zn[j] = z[j] + alpha * step[j];
      zn[r - 1] = 0;
      evaluate(zn, trial);
      if (accept_step(trial.grad_sq, state.grad_sq, alpha, trial.dual, state.dual,
                      state.dual_scale)) {
        std::swap(z, zn);
        std::swap(state, trial);
        accepted = true;
        break;
      }
    }
    at_z = accepted;
    if (!accepted) break;
  }
  // The reference implementation reports it + 1 (the number of states it examined),
  // capped at max_iter.
  const int64_t iters = std::min(it + 1, max_iter);

  if (!at_z) evaluate(z, state);  // the line search stalled: the last evaluation was a trial
  pu.write(U);
  pv.write(V);
  for (int j = 0; j < r; ++j) z_out[j] = static_cast<scalar_t>(z[j]);
  return {iters, max_abs_diff(state.cu.data(), state.cv.data(), r)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kl_project_cpu(
    const at::Tensor& log_u_ref, const at::Tensor& log_v_ref, double tol, int64_t max_iter) {
  auto p = prepare_projection(log_u_ref, log_v_ref, tol, max_iter, 4096,
                              "the dense r x r Newton system");
  const int64_t n = p.n;
  const int r = p.r;
  const auto a = log_u_ref.contiguous();
  const auto b = log_v_ref.contiguous();
  AT_DISPATCH_FLOATING_TYPES(p.U.scalar_type(), "kl_project_cpu", [&] {
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pb = b.const_data_ptr<scalar_t>();
    scalar_t* pU = p.U.mutable_data_ptr<scalar_t>();
    scalar_t* pV = p.V.mutable_data_ptr<scalar_t>();
    scalar_t* pz = p.z.mutable_data_ptr<scalar_t>();
    int64_t* pit = p.iters.mutable_data_ptr<int64_t>();
    double* pres = p.residual.mutable_data_ptr<double>();
    at::parallel_for(0, p.problems, 1, [&](int64_t begin, int64_t end) {
      // One scratch per task, reused by its problems: O(threads * n * r), not O(batch * n * r).
      auto scratch = at::empty({scratch_size<scalar_t>(Panels(n, r))},
                               at::TensorOptions().dtype(at::kDouble));
      for (int64_t i = begin; i < end; ++i) {
        const int64_t off = i * n * r;
        const auto sol = solve_one(pa + off, pb + off, n, r, tol, max_iter,
                                   scratch.mutable_data_ptr<double>(), pU + off, pV + off,
                                   pz + i * r);
        pit[i] = sol.iters;
        pres[i] = sol.residual;
      }
    });
  });
  return p.outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("kl_project", HEADSCOPE_KERNEL("kl_project", kl_project_cpu));
}

}  // namespace headscope::mixer::cpu
