// Step 2 of the vas CUDA kernels (vas_head_stats_cuda.cu): the pass over tile pairs, one
// block per pair, and the finalisation of each head by its last block.
#pragma once

#include "vas/cuda/vas_head_stats_common_cuda.cuh"
#include "vas/cuda/vas_head_stats_qk_rows_cuda.cuh"

#include <cfloat>
#include <cmath>

namespace headscope::vas::cuda {
namespace {

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

}  // namespace
}  // namespace headscope::vas::cuda
