// CUDA kernels of headscope::vas_head_stats, vas_head_stats_qk and vas_aggregate.
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
#include "common/cuda_reduce.cuh"
#include "vas/cuda/vas_head_stats_tile_mma_cuda.cuh"
#include "vas/vas_checks.h"
#include "vas/vas_math.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cfloat>
#include <cmath>
#include <optional>
#include <vector>

namespace headscope::vas::cuda {
namespace {

using namespace headscope::cuda_reduce;
using mma::kThreads;
using mma::kTile;
using mma::Lane;

constexpr int kExactDh = 16;        // Dh up to this: Gram entries by FMA in index order
constexpr int kVChunk = 32;         // Dh columns per split-Vn panel load
constexpr int kVld = 40;            // row stride (halves) of those panels: conflict-free
constexpr int kVldExact = 20;       // row stride (floats) of the float32 Vn panels
constexpr int kXld = 68;            // row stride (floats) of q / k panels
constexpr int kPrepRows = 16;       // rows per prep block
constexpr int kAccs = 8;            // per-head float64 sums, see Sums
constexpr int kSlots = 32;          // a head's sums and ticket are spread over 32 slots, so
                                    // that thousands of blocks do not queue on one address
constexpr float kEps = 1e-12f;      // the reference implementation's clip of p and q
constexpr float kLog2Eps = -39.863137138648348f;  // log2(1e-12)
// Shared memory of a pass block: the Vn panels (dead after the Gram, then reused for the
// reductions), then the A tiles or the q / k panels.
constexpr size_t kVBytes = 4 * kTile * kVld * sizeof(__half);
constexpr size_t kRedBytes = (12 * kTile + 4 * 16) * sizeof(float);
static_assert(kRedBytes <= kVBytes, "the reductions reuse the Vn panels' shared memory");

struct Strides4 {
  int64_t s0, s1, s2, s3;
};
Strides4 strides4(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

struct Heads {
  int64_t B, H, T, Dh, T64, Dh16;
  const int64_t* len;
  const int64_t* off;  // nullptr without offsets
  __half* vs;          // [2 (hi, lo), BH, T64, Dh16] split Vn (Dh > kExactDh)
  float* vf;           // [BH, T64, 16] Vn (Dh <= kExactDh)
  float* mrow;         // [BH, T] qk op: row max of the scaled logits
  float* izrow;        // [BH, T] qk op: 1 / softmax denominator
  double* rows;        // [BH, T] row sums of A
  double* cols;        // [BH, T] column sums of A
  double* grow;        // [BH, T] row sums of G
  double* acc;         // [BH, kSlots, kAccs]
  int* bad;            // [BH] non-finite input in the window
  int* done;           // [BH, kSlots + 1] pass blocks finished per slot, slots finished
};

__device__ inline void window(const Heads& P, int64_t b, int64_t& n, int64_t& s) {
  n = window_len(P.len[b], P.T);
  s = P.off != nullptr ? window_start(P.off[b], n, P.T) : 0;
}

template <typename T>
__device__ inline float ldf(const T* p) {
  return static_cast<float>(*p);
}

// ---- 1. prep ------------------------------------------------------------------------------

// Sum of squares of row[0 .. n) (shared memory) in NumPy's pairwise order over float32
// squares (np.linalg.norm): the reference implementation's norms bit for bit. Called by a
// whole warp; every lane gets the result. NumPy sums blocks of up to 128 with 8
// interleaved accumulators (lanes 0..7 here, each in NumPy's order), combines them as a
// fixed tree, adds the tail, and splits longer rows in two at a multiple of 8.
__device__ float numpy_pairwise_sumsq(const float* row, int n) {
  auto sqr = [&](int i) { return __fmul_rn(row[i], row[i]); };  // never fused into an add
  if (n > 128) {
    int n2 = n / 2;
    n2 -= n2 % 8;
    return __fadd_rn(numpy_pairwise_sumsq(row, n2), numpy_pairwise_sumsq(row + n2, n - n2));
  }
  float res = 0.0f;
  int i = 0;
  if (n >= 8) {
    const int k = threadIdx.x & 7, m = n - n % 8;
    float r = sqr(k);
    for (int j = 8; j < m; j += 8) r = __fadd_rn(r, sqr(j + k));
    float rk[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) rk[q] = __shfl_sync(0xffffffffu, r, q);
    res = __fadd_rn(__fadd_rn(__fadd_rn(rk[0], rk[1]), __fadd_rn(rk[2], rk[3])),
                    __fadd_rn(__fadd_rn(rk[4], rk[5]), __fadd_rn(rk[6], rk[7])));
    i = m;
  }
  for (; i < n; ++i) res = __fadd_rn(res, sqr(i));
  return res;
}

// Each warp takes kPrepRows / 4 rows: loads them all (the loads in flight together), then
// normalises each: Vn_i = V_i / max(||V_i||, 1e-9) (a division, as the reference
// implementation). Rows from n to T64 and columns from Dh to Dh16 are zero.
template <typename V_t, bool kExact>
__global__ void __launch_bounds__(kThreads) prep_kernel(Heads P, const V_t* __restrict__ hw,
                                                        Strides4 sv) {
  constexpr int kRows = kPrepRows / 4;
  extern __shared__ float rowbuf_all[];  // [warps, kRows, Dh]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t bh = blockIdx.y, b = bh / P.H, h = bh % P.H, BH = P.B * P.H;
  int64_t n, s;
  window(P, b, n, s);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kPrepRows + warp * kRows;
  float* rowbuf = rowbuf_all + warp * kRows * P.Dh;
  double sq = 0;
  for (int rr = 0; rr < kRows; ++rr) {
    if (i0 + rr >= n) break;
    const V_t* row = hw + b * sv.s0 + h * sv.s1 + (s + i0 + rr) * sv.s2;
    for (int64_t c = lane; c < P.Dh; c += 32) {
      const float x = ldf(row + c * sv.s3);
      rowbuf[rr * P.Dh + c] = x;
      sq += static_cast<double>(x) * x;
    }
  }
  const bool bad = !isfinite(warp_sum(sq));
  __syncwarp();
  for (int rr = 0; rr < kRows; ++rr) {
    const int64_t i = i0 + rr;
    float den = 1.0f;
    if (i < n) {
      const float nrm = sqrtf(numpy_pairwise_sumsq(rowbuf + rr * P.Dh, static_cast<int>(P.Dh)));
      den = nrm > 1e-9f ? nrm : 1e-9f;
    }
    for (int64_t c = lane; c < P.Dh16; c += 32) {
      const float x = (i < n && c < P.Dh) ? rowbuf[rr * P.Dh + c] / den : 0.0f;
      if (kExact) {
        P.vf[(bh * P.T64 + i) * 16 + c] = x;
      } else {
        const __half hi = __float2half_rn(x);
        const __half lo = __float2half_rn((x - __half2float(hi)) * mma::kLoScale);
        P.vs[(bh * P.T64 + i) * P.Dh16 + c] = hi;
        P.vs[((BH + bh) * P.T64 + i) * P.Dh16 + c] = lo;
      }
    }
  }
  if (lane == 0 && bad) atomicOr(P.bad + bh, 1);
}

// ---- qk op: softmax statistics per row ------------------------------------------------------

// A 64 x 64 panel of rows (window-relative row r at rows + r * s_row) and columns
// d0 .. d0 + 64 of a q or k tensor into shared memory as float, zero outside.
template <typename T>
__device__ void load_panel(float* dst, const T* rows, int64_t s_row, int64_t s_col,
                           int64_t rows_valid, int64_t d0, int64_t D) {
  for (int e = threadIdx.x; e < kTile * 64; e += kThreads) {
    const int r = e >> 6, c = e & 63;
    dst[r * kXld + c] = (r < rows_valid && d0 + c < D) ? ldf(rows + r * s_row + (d0 + c) * s_col) : 0.0f;
  }
}

// acc (fragment layout) = X Y^T over the D columns of q / k rows, 3xTF32.
template <typename T>
__device__ __forceinline__ void logits_tile(float* acc, float* sx, float* sy, const T* x, int64_t sx_row,
                            int64_t sx_col, int64_t x_rows, const T* y, int64_t sy_row,
                            int64_t sy_col, int64_t y_rows, int64_t D, const Lane& L) {
  #pragma unroll
  for (int e = 0; e < mma::kFrag; ++e) acc[e] = 0.0f;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __syncthreads();
    load_panel(sx, x, sx_row, sx_col, x_rows, d0, D);
    load_panel(sy, y, sy_row, sy_col, y_rows, d0, D);
    __syncthreads();
    const int kw = static_cast<int>((min((int64_t)64, D - d0) + 7) / 8 * 8);
    mma::gemm_3xtf32(acc, sx, sy, kXld, kw, L);
  }
}

// (m, z) of two parts of a softmax row combined.
__device__ inline void merge_mz(float& m, float& z, float m2, float z2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) return;
  z = z * __expf(m - mm) + z2 * __expf(m2 - mm);
  m = mm;
}

// A scaled logit, soft-capped when the pattern says so.
__device__ inline float logit(float l, const BatchPattern& pat) {
  return pat.softcap > 0 ? softcap_logit(l, static_cast<float>(pat.softcap)) : l;
}

// Whether key `key` of batch row b is padding (kpm: the contiguous (B, T) key padding
// mask, nullptr for none). Padding keys are left out of the softmax.
__device__ inline bool key_padded(const bool* kpm, int64_t b, int64_t T, int64_t key) {
  return kpm != nullptr && kpm[b * T + key];
}

template <typename Q_t>
__global__ void __launch_bounds__(kThreads)
qk_rows_kernel(Heads P, const Q_t* __restrict__ q, Strides4 sq, const Q_t* __restrict__ k,
               Strides4 sk, int64_t Hkv, int64_t D, float scale, BatchPattern pat,
               const bool* __restrict__ kpm) {
  extern __shared__ float4 smem_rows[];
  float* sx = reinterpret_cast<float*>(smem_rows);
  float* sy = sx + kTile * kXld;
  float* mz = sy + kTile * kXld;  // [2 (wn), 64, 2]
  const Lane L;
  const int64_t bh = blockIdx.y, b = bh / P.H, h = bh % P.H, hk = h / (P.H / Hkv);
  int64_t n, s;
  window(P, b, n, s);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  if (i0 >= n) return;
  // the keys the block's rows may see (absolute): from its first row's window start
  // (window starts never decrease; any earlier key of a block that the window does not
  // bound) to its last row's last key, or every later key with blocks
  const AttentionPattern ap = pat.row(b);
  const int64_t last_row = s + min(i0 + kTile, n) - 1;
  const bool blocks_unbound = ap.has_blocks() && !ap.window_bounds_blocks;
  const int64_t key_begin = blocks_unbound ? 0 : max(ap.window_start(s + i0), (int64_t)0);
  const int64_t key_end = ap.has_blocks() ? P.T : ap.last_key(last_row, P.T, -1, -1) + 1;
  const Q_t* qrows = q + b * sq.s0 + h * sq.s1 + (s + i0) * sq.s2;
  const Q_t* krows = k + b * sk.s0 + hk * sk.s1;
  float m[4], z[4];
  #pragma unroll
  for (int r = 0; r < 4; ++r) m[r] = -INFINITY, z[r] = 0.0f;
  bool finite = true;
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kTile) {
    float acc[mma::kFrag];
    logits_tile(acc, sx, sy, qrows, sq.s2, sq.s3, n - i0, krows + k0 * sk.s2, sk.s2, sk.s3,
                P.T - k0, D, L);
    // slot r = 2 mi + hrow holds one row; its 8 elements: ni = 0..3, two columns each
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int mi = r >> 1, hr = r & 1;
      const int il = L.slot_row(r);
      const int64_t ia = s + i0 + il;
      const int64_t qb = ap.query_block(ia, P.T);
      float l[8];
      float tmax = -INFINITY;
      #pragma unroll
      for (int t = 0; t < 8; ++t) {
        const int e = (mi * 4 + (t >> 1)) * 4 + hr * 2 + (t & 1);
        const int64_t key = k0 + L.col(e);
        const bool valid = i0 + il < n && key < P.T && ap.sees(ia, qb, key) &&
                           !key_padded(kpm, b, P.T, key);
        l[t] = valid ? logit(acc[e] * scale, pat) : -INFINITY;
        if (valid) finite &= isfinite(l[t]);
        tmax = fmaxf(tmax, l[t]);
      }
      if (tmax == -INFINITY) continue;
      float zt = 0.0f;
      #pragma unroll
      for (int t = 0; t < 8; ++t) zt += __expf(l[t] - tmax);
      merge_mz(m[r], z[r], tmax, zt);
    }
  }
  #pragma unroll
  for (int r = 0; r < 4; ++r)
    #pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[r], o), z2 = __shfl_xor_sync(0xffffffffu, z[r], o);
      merge_mz(m[r], z[r], m2, z2);
    }
  if (L.tq == 0)
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int il = L.slot_row(r);
      mz[(L.wn * kTile + il) * 2] = m[r];
      mz[(L.wn * kTile + il) * 2 + 1] = z[r];
    }
  if (__any_sync(0xffffffffu, !finite) && (threadIdx.x & 31) == 0) atomicOr(P.bad + bh, 1);
  __syncthreads();
  const int t = threadIdx.x;
  if (t < kTile && i0 + t < n) {
    float mm = mz[t * 2], zz = mz[t * 2 + 1];
    merge_mz(mm, zz, mz[(kTile + t) * 2], mz[(kTile + t) * 2 + 1]);
    P.mrow[bh * P.T + i0 + t] = mm;
    P.izrow[bh * P.T + i0 + t] = 1.0f / zz;
  }
}

// ---- 2. the pass over tile pairs ------------------------------------------------------------

// Tile pair p (0 .. nt (nt + 1) / 2) of a head: I >= J, diagonal by diagonal (d = I - J),
// so that blocks running at the same time add into different rows and columns.
__device__ inline void pair_of(int64_t p, int64_t nt, int& I, int& J) {
  auto offset = [nt](int64_t d) { return d * nt - d * (d - 1) / 2; };  // first pair of diagonal d
  const double b = 2.0 * static_cast<double>(nt) + 1.0;
  int64_t d = static_cast<int64_t>((b - sqrt(fmax(0.0, b * b - 8.0 * static_cast<double>(p)))) / 2.0);
  d = max((int64_t)0, min(d, nt - 1));
  while (d > 0 && offset(d) > p) --d;
  while (d + 1 < nt && offset(d + 1) <= p) ++d;
  J = static_cast<int>(p - offset(d));
  I = J + static_cast<int>(d);
}

// Issues the cp.async copies of one Dh chunk of the Vn panels of rows i0.. and j0..
template <bool kExact>
__device__ void issue_v_chunk(const Heads& P, int64_t bh, int64_t i0, int64_t j0, int64_t k0,
                              int kw, void* sv) {
  if (kExact) {
    float* dst = static_cast<float*>(sv);
    for (int e = threadIdx.x; e < 2 * kTile * 4; e += kThreads) {
      const int panel = e / (kTile * 4), r = (e / 4) % kTile, c = (e % 4) * 4;
      const int64_t row = (panel == 0 ? i0 : j0) + r;
      mma::cp_async16(dst + (panel * kTile + r) * kVldExact + c, P.vf + (bh * P.T64 + row) * 16 + c);
    }
  } else {
    __half* dst = static_cast<__half*>(sv);
    const int per_row = kw / 8, per_panel = kTile * per_row;
    const int64_t BH = P.B * P.H;
    for (int e = threadIdx.x; e < 4 * per_panel; e += kThreads) {
      const int panel = e / per_panel, r = (e % per_panel) / per_row, c = (e % per_row) * 8;
      const int part = panel & 1;  // 0 hi, 1 lo; panels: I hi, I lo, J hi, J lo
      const int64_t row = (panel < 2 ? i0 : j0) + r;
      mma::cp_async16(dst + (panel * kTile + r) * kVld + c,
                      P.vs + ((part * BH + bh) * P.T64 + row) * P.Dh16 + k0 + c);
    }
  }
}

// G_IJ into g (fragment layout). Before the call the caller has issued Dh chunk 0
// (issue_v_chunk, committed) and then committed exactly one more group (its A tiles, or an
// empty group): chunk 0 is awaited without waiting for that group.
// Dh <= kExactDh: float32 FMA in index order, as the reference implementation's float32
// product, which keeps entries of S near 0 (antiparallel writes, common for tiny Dh) equal
// to its.
template <bool kExact>
__device__ __forceinline__ void gram_tile(const Heads& P, int64_t bh, int64_t i0, int64_t j0, void* sv,
                          float* g, const Lane& L) {
  if (kExact) {
    mma::cp_async_wait<1>();
    __syncthreads();
    const float* x = static_cast<const float*>(sv);
    const float* y = x + kTile * kVldExact;
    #pragma unroll
    for (int e = 0; e < mma::kFrag; ++e) {
      const float* xr = x + L.row(e) * kVldExact;
      const float* yr = y + L.col(e) * kVldExact;
      float acc = 0.0f;
      #pragma unroll
      for (int c = 0; c < 16; ++c) acc = fmaf(xr[c], yr[c], acc);
      g[e] = acc;
    }
    return;
  }
  float hh[mma::kFrag] = {}, x[mma::kFrag] = {};
  const __half* v = static_cast<const __half*>(sv);
  for (int64_t k0 = 0; k0 < P.Dh16; k0 += kVChunk) {
    const int kw = static_cast<int>(min((int64_t)kVChunk, P.Dh16 - k0));
    if (k0 == 0) {
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    mma::gemm_f16_split(hh, x, v, v + kTile * kVld, v + 2 * kTile * kVld, v + 3 * kTile * kVld,
                        kVld, kw, L);
    __syncthreads();
    if (k0 + kVChunk < P.Dh16) {
      issue_v_chunk<false>(P, bh, i0, j0, k0 + kVChunk,
                           static_cast<int>(min((int64_t)kVChunk, P.Dh16 - k0 - kVChunk)),
                           const_cast<__half*>(v));
      mma::cp_async_commit();
    }
  }
  #pragma unroll
  for (int e = 0; e < mma::kFrag; ++e) g[e] = hh[e] + x[e] * (1.0f / mma::kLoScale);
}

// The float constants the pass folds into its sums, which finalize must undo exactly: the
// centring value 1/n and L0 = log2(n / 2) (see Sums).
__device__ inline float centre_of(int64_t n) { return 1.0f / static_cast<float>(n); }
__device__ inline float log2_half_n(int64_t n) { return __log2f(0.5f * static_cast<float>(n)); }

// Per-thread partial sums of a tile pair, logarithms in base 2 (one MUFU.LG2 each). With
// S = (g + 1) / 2, lS = log2 S - L0 (L0 = log2(n / 2), so that lS is close to log2 q =
// log2 S - log2 mS) and lq = lS, or log2 eps where q is clipped (S <= 0), an entry a adds
//   kA += a+ (log2 a - lq), sU += a+ (a+ = max(a, 0); unclipped p),
//   when a+ < FLT_MIN and S > 0 (clipped p): c1 += log2 eps - lS, n1 += 1,
//   when S <= 0: sneg += a+ (so that s1 = sU - sneg sums a+ where S > 0).
// Then, with mA and mS the max row sums of A and S and D = ln mS - L0 ln 2 (finalize):
//   sum p ln(p / q) = (kA ln 2 + D s1 - ln(mA) sU) / mA + eps (c1 ln 2 + D n1).
// q is clipped exactly when S <= 0: S is a multiple of 2^-25 near 0 and mS <= n, so for
// n < 29000 any S > 0 has S / mS > eps. p is taken unclipped for a >= FLT_MIN: where
// a / mA < eps after all, the term differs from the clipped one by < 2 eps (|ln eps| +
// |ln q|) ~ 1e-10 (docs/vas.md, differences). ||A||^2 follows from ax2 = sum (a - 1/n)^2
// (finalize), and a NaN or infinity in A makes ax2 non-finite.
struct Sums {
  float kA = 0, sU = 0, sneg = 0, c1 = 0, n1 = 0, ag = 0, ax2 = 0, g2 = 0;
};

struct Entry {
  float g, lq, cterm, xc, sp1;  // lq, cterm = log2 eps - lS, sp1 = 1 where S > 0 else 0
  __device__ __forceinline__ void add(float a, Sums& m) const {
    const float ap = fmaxf(a, 0.0f);
    m.kA = fmaf(ap, __log2f(fmaxf(a, FLT_MIN)) - lq, m.kA);
    m.sU += ap;
    const float z = ap < FLT_MIN ? sp1 : 0.0f;
    m.n1 += z;
    m.c1 = fmaf(z, cterm, m.c1);
    m.sneg += sp1 != 0.0f ? 0.0f : ap;
    m.ag = fmaf(a, g, m.ag);
    const float d = a - xc;
    m.ax2 = fmaf(d, d, m.ax2);
  }
};

// The entries of a tile pair into the thread's sums; kFull: every element inside the window.
template <bool kFull>
__device__ __forceinline__ void accumulate(const float* g, const float* aij, const float* aji,
                                           bool pair, int ni, int nj, float xc, float L0,
                                           const Lane& L, Sums& m, float (&rI)[3][4],
                                           float (&cJ)[3][8]) {
#pragma unroll
  for (int e = 0; e < mma::kFrag; ++e) {
    if (!kFull && (L.row(e) >= ni || L.col(e) >= nj)) continue;
    const int ri = Lane::row_slot(e), cj = Lane::col_slot(e);
    const float S = (g[e] + 1.0f) * 0.5f;
    const bool sp = S > 0.0f;
    const float lS = __log2f(sp ? S : 1.0f) - L0;
    const Entry en{g[e], sp ? lS : kLog2Eps, kLog2Eps - lS, xc, sp ? 1.0f : 0.0f};
    m.g2 = fmaf(g[e], g[e], m.g2);
    rI[2][ri] += g[e];
    en.add(aij[e], m);
    rI[0][ri] += aij[e];
    cJ[0][cj] += aij[e];
    if (pair) {
      cJ[2][cj] += g[e];
      en.add(aji[e], m);
      rI[1][ri] += aji[e];
      cJ[1][cj] += aji[e];
    }
  }
}

// Shared memory of the reductions at the end of a pass block.
struct Red {
  float* rowI;  // [3 (A rows, A^T cols, G rows), 2 (wn), 64]: indexed by tile-I row
  float* colJ;  // [3 (A cols, A^T rows, G cols), 2 (wm), 64]: indexed by tile-J column
  float* sc;    // [4 warps, 16]
  __device__ explicit Red(void* p) {
    rowI = static_cast<float*>(p);
    colJ = rowI + 6 * kTile;
    sc = colJ + 6 * kTile;
  }
};

// Epilogue of a tile pair: g = G_IJ, aij = A_IJ and aji = A_JI transposed (element e of
// both at (row(e), col(e)) of the I x J tile); pair: aji is a separate tile (I != J).
// Accumulates into the head's sums (atomics), takes the block's ticket and, in the last
// block of the head, writes (d, c, r).
__device__ __forceinline__ void pass_epilogue(const Heads& P, int64_t bh, int64_t n, int64_t i0, int64_t j0,
                              bool pair, const float* g, const float* aij, const float* aji,
                              const Lane& L, Red red) {
  const float xc = centre_of(n), L0 = log2_half_n(n);
  Sums m;
  float rI[3][4] = {}, cJ[3][8] = {};  // [A, A^T, G][slot]
  const int ni = static_cast<int>(min((int64_t)kTile, n - i0)), nj = static_cast<int>(min((int64_t)kTile, n - j0));
  if (ni == kTile && nj == kTile) {
    accumulate<true>(g, aij, aji, pair, ni, nj, xc, L0, L, m, rI, cJ);
  } else {
    accumulate<false>(g, aij, aji, pair, ni, nj, xc, L0, L, m, rI, cJ);
  }
  if (pair) m.g2 *= 2.0f;  // G_IJ stands for G_JI too
  // rows of the I tile: sum over the 4 lanes of a quad; columns of J: over the 8 quads
  #pragma unroll
  for (int k = 0; k < 3; ++k) {
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      float v = rI[k][r];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (L.tq == 0) red.rowI[(k * 2 + L.wn) * kTile + L.slot_row(r)] = v;
    }
    #pragma unroll
    for (int c = 0; c < 8; ++c) {
      float v = cJ[k][c];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (L.gq == 0) red.colJ[(k * 2 + L.wm) * kTile + L.slot_col(c)] = v;
    }
  }
  float sc[kAccs] = {m.kA, m.sU, m.sneg, m.c1, m.n1, m.ag, m.ax2, m.g2};
  #pragma unroll
  for (int k = 0; k < kAccs; ++k) sc[k] = warp_sum(sc[k]);
  if ((threadIdx.x & 31) == 0)
    #pragma unroll
    for (int k = 0; k < kAccs; ++k) red.sc[(threadIdx.x >> 5) * 16 + k] = sc[k];
  __syncthreads();
  const int t = threadIdx.x;
  const int64_t T = P.T;
  if (t < kTile) {
    if (i0 + t < n) {
      const float* ri = red.rowI;
      atomicAdd(P.rows + bh * T + i0 + t, static_cast<double>(ri[t] + ri[kTile + t]));
      atomicAdd(P.grow + bh * T + i0 + t, static_cast<double>(ri[4 * kTile + t] + ri[5 * kTile + t]));
      if (pair) atomicAdd(P.cols + bh * T + i0 + t, static_cast<double>(ri[2 * kTile + t] + ri[3 * kTile + t]));
    }
  } else {
    const int c = t - kTile;
    if (j0 + c < n) {
      const float* cj = red.colJ;
      atomicAdd(P.cols + bh * T + j0 + c, static_cast<double>(cj[c] + cj[kTile + c]));
      if (pair) {
        atomicAdd(P.rows + bh * T + j0 + c, static_cast<double>(cj[2 * kTile + c] + cj[3 * kTile + c]));
        atomicAdd(P.grow + bh * T + j0 + c, static_cast<double>(cj[4 * kTile + c] + cj[5 * kTile + c]));
      }
    }
  }
  if (t < kAccs) {
    double v = 0;
    for (int wp = 0; wp < kThreads / 32; ++wp) v += red.sc[wp * 16 + t];
    atomicAdd(P.acc + (bh * kSlots + blockIdx.x % kSlots) * kAccs + t, v);
  }
}

// (d, c, r) of head bh from its sums, by the last pass block of the head.
__device__ void finalize_head(const Heads& P, int64_t bh, int64_t n, float* out, double* red) {
  const int64_t T = P.T;
  const double nn = static_cast<double>(n);
  const double x = centre_of(n);
  double sA = 0, mA = 0, sG = 0, mG = -DBL_MAX, ra = 0, ca = 0, rr = 0, cc = 0, g1sq = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double r = __ldcg(P.rows + bh * T + i), c = __ldcg(P.cols + bh * T + i);
    const double gr = __ldcg(P.grow + bh * T + i), adot = gr / nn;
    sA += r;
    mA = fmax(mA, r);
    sG += gr;
    mG = fmax(mG, gr);
    ra += r * adot;
    ca += c * adot;
    rr += (r - nn * x) * (r - nn * x);
    cc += (c - nn * x) * (c - nn * x);
    g1sq += gr * gr;
  }
  sA = block_sum(sA, red);
  mA = block_max(mA, red);
  sG = block_sum(sG, red);
  mG = block_max(mG, red);
  ra = block_sum(ra, red);
  ca = block_sum(ca, red);
  rr = block_sum(rr, red);
  cc = block_sum(cc, red);
  g1sq = block_sum(g1sq, red);
  if (threadIdx.x != 0) return;
  float* o = out + bh * 3;
  double a[kAccs] = {};
  for (int sl = 0; sl < kSlots; ++sl)
#pragma unroll
    for (int k = 0; k < kAccs; ++k) a[k] += __ldcg(P.acc + (bh * kSlots + sl) * kAccs + k);
  const double ln2 = 0.69314718055994531;
  const double kA = a[0] * ln2, sU = a[1], s1 = a[1] - a[2], c1 = a[3] * ln2, n1 = a[4],
               ag = a[5], ax2 = a[6], g2 = a[7];
  if (__ldcg(P.bad + bh) || !isfinite(ax2)) {
    o[0] = o[1] = o[2] = NAN;
    return;
  }
  // ||Ac||^2 = ||H B H||^2 for B = A - x 1 1^T (x constant): exact, no large cancellation
  const double b1 = sA - nn * nn * x;
  const double Acc = centred_norm2(nn, ax2, rr, cc, b1);
  // G = Vn Vn^T: ||H G H||^2 = sum G^2 - 2/n sum_i (G 1)_i^2 + (1^T G 1)^2 / n^2
  const double Scc = fmax(0.0, g2 - 2.0 * g1sq / nn + sG * sG / (nn * nn)) / 4.0;
  const double Snorm2 = (g2 + 2.0 * sG + nn * nn) / 4.0;
  const double msq = sG / (nn * nn);
  // <Ac, Sc> = <A, H G H> / 2
  const double a2 = fmax(0.0, ax2 + 2.0 * x * sA - nn * nn * x * x);  // sum (a - x + x)^2
  const DistanceCka dc = distance_and_cka(Acc, Scc, ag - ra - ca + sA * msq, a2, Snorm2);
  const double mAe = fmax(mA, 1e-12), mS = fmax(0.0, 0.5 * (nn + mG));
  const double D = log(fmax(mS, 1e-12)) - ln2 * static_cast<double>(log2_half_n(n));
  const double kl = (kA + D * s1 - log(mAe) * sU) / mAe + static_cast<double>(kEps) * (c1 + D * n1);
  o[0] = static_cast<float>(dc.d);
  o[1] = static_cast<float>(dc.c);
  o[2] = static_cast<float>(kl / nn);
}

// The pass block's tickets; true in the last block of the head (which then finalizes).
// Block p counts in slot p % kSlots; the last block of each slot counts in the head's.
__device__ bool last_block_of_head(const Heads& P, int64_t bh, int64_t pairs) {
  __shared__ int last;
  __threadfence();  // this block's atomics before its ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t sl = blockIdx.x % kSlots, used = min(pairs, (int64_t)kSlots);
    const int64_t in_slot = (pairs - 1 - sl) / kSlots + 1;
    int* done = P.done + bh * (kSlots + 1);
    last = atomicAdd(done + sl, 1) == in_slot - 1;
    if (last) {
      __threadfence();
      last = atomicAdd(done + kSlots, 1) == used - 1;
    }
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

struct PairTask {
  int64_t n, s, pairs, i0, j0;
  bool pair;
};
// Which tile pair this block takes; false when the block has none (grid rounded up).
__device__ bool pair_task(const Heads& P, int64_t bh, PairTask& t) {
  window(P, bh / P.H, t.n, t.s);
  const int64_t nt = max((int64_t)1, (t.n + kTile - 1) / kTile);
  t.pairs = nt * (nt + 1) / 2;
  if (blockIdx.x >= t.pairs) return false;
  int I, J;
  pair_of(blockIdx.x, nt, I, J);
  t.i0 = static_cast<int64_t>(I) * kTile;
  t.j0 = static_cast<int64_t>(J) * kTile;
  t.pair = I != J;
  return true;
}

// A 64 x 64 tile of A (window rows r0.., columns c0..) into shared memory (row stride ld):
// cp.async where 16 bytes lie inside the window and vec (aligned, unit column stride),
// else element by element; zero outside the window.
template <typename A_t>
__device__ void issue_a_tile(const A_t* A, Strides4 sa, int64_t b, int64_t h, int64_t s,
                             int64_t n, int64_t r0, int64_t c0, A_t* dst, int ld, bool vec) {
  constexpr int CH = 16 / sizeof(A_t);
  const A_t* base = A + b * sa.s0 + h * sa.s1 + (s + r0) * sa.s2 + (s + c0) * sa.s3;
  for (int e = threadIdx.x; e < kTile * (kTile / CH); e += kThreads) {
    const int r = e / (kTile / CH), c = (e % (kTile / CH)) * CH;
    A_t* d = dst + r * ld + c;
    const A_t* src = base + r * sa.s2 + c * sa.s3;
    if (vec && r0 + r < n && c0 + c + CH <= n) {
      mma::cp_async16(d, src);
    } else {
      for (int k = 0; k < CH; ++k)
        d[k] = (r0 + r < n && c0 + c + k < n) ? src[k * sa.s3] : static_cast<A_t>(0.0f);
    }
  }
}

template <typename A_t>
struct ATiles {
  static constexpr int ld_ij = sizeof(A_t) == 2 ? 72 : 68;
  static constexpr int ld_ji = sizeof(A_t) == 2 ? 80 : 68;  // conflict-free transposed reads
  static constexpr size_t bytes = static_cast<size_t>(kTile) * (ld_ij + ld_ji) * sizeof(A_t);
};

template <typename A_t, bool kExact>
__global__ void __launch_bounds__(kThreads, 4)
attn_pass_kernel(Heads P, const A_t* __restrict__ A, Strides4 sa, bool vec, float* out) {
  extern __shared__ float4 smem_pass[];
  unsigned char* sm = reinterpret_cast<unsigned char*>(smem_pass);
  using Tiles = ATiles<A_t>;
  const int64_t bh = blockIdx.y;
  PairTask t;
  if (!pair_task(P, bh, t)) return;
  const Lane L;
  const Red red(sm);  // after the Gram
  if (!P.bad[bh]) {
    A_t* aij_s = reinterpret_cast<A_t*>(sm + kVBytes);
    A_t* aji_s = aij_s + kTile * Tiles::ld_ij;
    issue_v_chunk<kExact>(P, bh, t.i0, t.j0, 0, static_cast<int>(min((int64_t)kVChunk, P.Dh16)), sm);
    mma::cp_async_commit();
    const int64_t b = bh / P.H, h = bh % P.H;
    issue_a_tile(A, sa, b, h, t.s, t.n, t.i0, t.j0, aij_s, Tiles::ld_ij, vec);
    if (t.pair) issue_a_tile(A, sa, b, h, t.s, t.n, t.j0, t.i0, aji_s, Tiles::ld_ji, vec);
    mma::cp_async_commit();
    float g[mma::kFrag], aij[mma::kFrag], aji[mma::kFrag];
    gram_tile<kExact>(P, bh, t.i0, t.j0, sm, g, L);
    mma::cp_async_wait<0>();
    __syncthreads();
    #pragma unroll
    for (int e = 0; e < mma::kFrag; ++e) {
      const int il = L.row(e), jl = L.col(e);
      aij[e] = static_cast<float>(aij_s[il * Tiles::ld_ij + jl]);
      aji[e] = t.pair ? static_cast<float>(aji_s[jl * Tiles::ld_ji + il]) : 0.0f;
    }
    pass_epilogue(P, bh, t.n, t.i0, t.j0, t.pair, g, aij, aji, L, red);
  }
  if (last_block_of_head(P, bh, t.pairs)) finalize_head(P, bh, t.n, out, reinterpret_cast<double*>(red.sc));
}

template <typename Q_t, bool kExact>
__global__ void __launch_bounds__(kThreads, 3)
qk_pass_kernel(Heads P, const Q_t* __restrict__ q, Strides4 sq, const Q_t* __restrict__ k,
               Strides4 sk, int64_t Hkv, int64_t D, float scale, BatchPattern pat,
               const bool* __restrict__ kpm, float* out) {
  extern __shared__ float4 smem_pass[];
  unsigned char* sm = reinterpret_cast<unsigned char*>(smem_pass);
  const int64_t bh = blockIdx.y;
  PairTask t;
  if (!pair_task(P, bh, t)) return;
  const Lane L;
  float* sx = reinterpret_cast<float*>(sm + kVBytes);
  float* sy = sx + kTile * kXld;
  const Red red(sm);  // after the Gram
  if (!P.bad[bh]) {
    issue_v_chunk<kExact>(P, bh, t.i0, t.j0, 0, static_cast<int>(min((int64_t)kVChunk, P.Dh16)), sm);
    mma::cp_async_commit();
    mma::cp_async_commit();  // the empty group gram_tile expects after chunk 0
    float g[mma::kFrag], aij[mma::kFrag], aji[mma::kFrag], acc[mma::kFrag];
    gram_tile<kExact>(P, bh, t.i0, t.j0, sm, g, L);
    const int64_t b = bh / P.H, h = bh % P.H, hk = h / (P.H / Hkv), T = P.T;
    const Q_t* qh = q + b * sq.s0 + h * sq.s1 + t.s * sq.s2;
    const Q_t* kh = k + b * sk.s0 + hk * sk.s1 + t.s * sk.s2;
    const float* mrow = P.mrow + bh * T;
    const float* izrow = P.izrow + bh * T;
    const AttentionPattern ap = pat.row(b);
    // A_IJ: queries of I against keys of J (I >= J); none when J's keys all lie before the
    // window start of I's first row (unless blocks reach past windows), a test uniform over
    // the block
    if (t.s + t.j0 + kTile <= ap.window_start(t.s + t.i0) &&
        !(ap.has_blocks() && !ap.window_bounds_blocks)) {
      #pragma unroll
      for (int e = 0; e < mma::kFrag; ++e) aij[e] = 0.0f;
    } else {
      logits_tile(acc, sx, sy, qh + t.i0 * sq.s2, sq.s2, sq.s3, t.n - t.i0, kh + t.j0 * sk.s2,
                  sk.s2, sk.s3, t.n - t.j0, D, L);
      #pragma unroll
      for (int e = 0; e < mma::kFrag; ++e) {
        const int64_t i = t.i0 + L.row(e), j = t.j0 + L.col(e);
        // a row whose keys are all padding is zero here (its softmax statistics are not finite)
        const bool keep = i < t.n && j < t.n &&
                          ap.sees(t.s + i, ap.query_block(t.s + i, T), t.s + j) &&
                          !key_padded(kpm, b, T, t.s + j);
        aij[e] = keep ? __expf(logit(acc[e] * scale, pat) - mrow[i]) * izrow[i] : 0.0f;
      }
    }
    // A_JI transposed: queries of J against keys of I (all masked when causal without
    // blocks, J < I)
    if (t.pair && (!ap.causal || ap.has_blocks())) {
      logits_tile(acc, sx, sy, kh + t.i0 * sk.s2, sk.s2, sk.s3, t.n - t.i0, qh + t.j0 * sq.s2,
                  sq.s2, sq.s3, t.n - t.j0, D, L);
      #pragma unroll
      for (int e = 0; e < mma::kFrag; ++e) {
        const int64_t i = t.i0 + L.row(e), j = t.j0 + L.col(e);
        const bool keep = i < t.n && j < t.n &&
                          ap.sees(t.s + j, ap.query_block(t.s + j, T), t.s + i) &&
                          !key_padded(kpm, b, T, t.s + i);
        aji[e] = keep ? __expf(logit(acc[e] * scale, pat) - mrow[j]) * izrow[j] : 0.0f;
      }
    } else {
      #pragma unroll
      for (int e = 0; e < mma::kFrag; ++e) aji[e] = 0.0f;
    }
    pass_epilogue(P, bh, t.n, t.i0, t.j0, t.pair, g, aij, aji, L, red);
  }
  if (last_block_of_head(P, bh, t.pairs)) finalize_head(P, bh, t.n, out, reinterpret_cast<double*>(red.sc));
}

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

// ---- vas_aggregate --------------------------------------------------------------------------

__global__ void aggregate_kernel(const double* __restrict__ st, float* __restrict__ out,
                                 int64_t B, int64_t L, int64_t H) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= B * 12) return;
  const int64_t b = t / 12, qi = (t % 12) / 4, a = t % 4;  // one thread per (b, stat, head agg)
  double sum = 0, sq = 0, hi = -INFINITY;
  bool nan = false;
  // two passes over layers: mean, then population variance
  auto layer_stat = [&](int64_t l) -> double {
    const double* v = st + ((b * L + l) * H) * 3 + qi;
    double s = 0, mx = -INFINITY, mn = INFINITY;
    bool has_nan = false;
    for (int64_t h = 0; h < H; ++h) {
      const double x = v[h * 3];
      has_nan |= isnan(x);
      s += x;
      mx = fmax(mx, x);
      mn = fmin(mn, x);
    }
    const double mean = s / static_cast<double>(H);
    double var = 0;
    for (int64_t h = 0; h < H; ++h) var += (v[h * 3] - mean) * (v[h * 3] - mean);
    double r = a == 0 ? mean : a == 1 ? sqrt(var / static_cast<double>(H)) : a == 2 ? mx : mn;
    if (has_nan) r = NAN;
    // the reference implementation stores float32
    return static_cast<double>(static_cast<float>(r));
  };
  for (int64_t l = 0; l < L; ++l) {
    const double x = layer_stat(l);
    nan |= isnan(x);
    sum += x;
    hi = fmax(hi, x);
  }
  const double mean = sum / static_cast<double>(L);
  for (int64_t l = 0; l < L; ++l) {
    const double x = layer_stat(l);
    sq += (x - mean) * (x - mean);
  }
  float* o = out + b * 36 + qi * 12 + a * 3;
  o[0] = nan ? NAN : static_cast<float>(mean);
  o[1] = nan ? NAN : static_cast<float>(sqrt(sq / static_cast<double>(L)));
  o[2] = nan ? NAN : static_cast<float>(hi);
}

at::Tensor vas_aggregate_cuda(const at::Tensor& head_stats) {
  check_aggregate_args(head_stats);
  const c10::cuda::CUDAGuard guard(head_stats.device());
  const auto st = head_stats.to(at::kDouble).contiguous();
  const int64_t B = st.size(0), L = st.size(1), H = st.size(2);
  at::Tensor out = at::empty({B, 36}, head_stats.options().dtype(at::kFloat));
  if (B == 0) return out;
  const int64_t threads = 128, work = B * 12;
  aggregate_kernel<<<(work + threads - 1) / threads, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      st.const_data_ptr<double>(), out.data_ptr<float>(), B, L, H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CUDA, m) {
  m.impl("vas_head_stats", HEADSCOPE_KERNEL("vas_head_stats", vas_head_stats_cuda));
  m.impl("vas_head_stats_qk", HEADSCOPE_KERNEL("vas_head_stats_qk", vas_head_stats_qk_cuda));
  m.impl("vas_aggregate", HEADSCOPE_KERNEL("vas_aggregate", vas_aggregate_cuda));
}

}  // namespace headscope::vas::cuda
