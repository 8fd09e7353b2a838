// CUDA kernels of headscope::vas_head_stats, vas_head_stats_qk and vas_aggregate.
//
// Same algorithm as the CPU kernels (csrc/vas/cpu/vas_cpu.cpp), every head of a layer in
// each launch (5 launches per layer, none per head):
//   1. prep     (one block per head): Vn, m . Vn_i, max row sum of S, ||S||^2, ||Sc||^2
//   2. rows     (one warp per row):   row sums of A, or the online softmax statistics of
//                                     q k^T for the qk op; which A tiles are nonzero
//   3. centre   (one block per head): 1 / max row sum, centring values, bad-head flags
//   4. tiles    (one block per 64 x 64 tile of every head): the Vn Gram tile and the A tile
//               (loaded, or recomputed from q and k) in shared memory / registers; KL,
//               <A, G>, ||A||^2, centred sums, row and column sums, reduced in shared
//               memory, then one atomic per block and statistic
//   5. finalize (one block per head): (d, c, r)
// FP32 FMA throughout (no tensor cores yet); double accumulators across tiles.
#include "vas/vas_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cfloat>
#include <cmath>

namespace headscope::vas {
namespace {

constexpr int TILE = 64;   // tile edge of step 4
constexpr int KC = 16;     // depth chunk of the tile products
constexpr int THREADS = 256;

struct Strides4 {
  int64_t s0, s1, s2, s3;
};
Strides4 strides4(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

struct Heads {
  int64_t B, H, T, Dh, nt;  // nt: tiles per side for T
  const int64_t* len;
  const int64_t* off;       // nullptr without offsets
  // scratch
  float* vn;       // [BH, T, Dh]
  double* mvec;    // [BH, Dh]
  double* adot;    // [BH, T]
  double* rsum;    // [BH, T] row sums from step 2
  double* rowp;    // [BH, T] row sums from step 4
  double* colp;    // [BH, T]
  float* xcen;     // [BH, T]
  double* hs;      // [BH, 8]: msq, Scc, Snorm2, inv_mS, inv_mA
  double* acc;     // [BH, 4]: kl, ag, a2, ax2
  int* bad;        // [BH]
  int* flags;      // [BH, nt, nt] nonzero tiles (attn op)
  float* mrow;     // [BH, T] (qk op)
  float* izrow;    // [BH, T] (qk op)
};

__device__ inline void window(const Heads& P, int64_t b, int64_t& n, int64_t& s) {
  const int64_t l = P.len[b];
  n = min(max(min(l, P.T), (int64_t)4), P.T);
  s = P.off != nullptr ? max((int64_t)0, min(P.off[b], P.T - n)) : 0;
}

template <typename T>
__device__ inline float ldf(const T* p) {
  return static_cast<float>(*p);
}

__device__ inline double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline double warp_max(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum (or max) over the block; every thread gets the result. smem: 32 doubles.
__device__ double block_sum(double v, double* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  double t = 0;
  for (int w = 0; w < nw; ++w) t += smem[w];
  return t;
}
__device__ double block_max(double v, double* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  double t = -DBL_MAX;
  for (int w = 0; w < nw; ++w) t = fmax(t, smem[w]);
  return t;
}

// ---- 1. prep ------------------------------------------------------------------------------

// sum of squares of row[0 .. n) (stride st) in NumPy's pairwise order over float32 squares
// (np.linalg.norm): the seed's norms bit for bit. Blocks of 128, combined pairwise.
template <typename V_t>
__device__ float numpy_pairwise_sumsq(const V_t* row, int64_t st, int64_t n) {
  auto sqr = [&](int64_t i) {
    const float x = ldf(row + i * st);
    return __fmul_rn(x, x);  // rounded product, never fused into an add
  };
  if (n < 8) {
    float res = 0.0f;
    for (int64_t i = 0; i < n; ++i) res = __fadd_rn(res, sqr(i));
    return res;
  }
  if (n <= 128) {
    float r[8];
    for (int k = 0; k < 8; ++k) r[k] = sqr(k);
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int k = 0; k < 8; ++k) r[k] = __fadd_rn(r[k], sqr(i + k));
    float res = __fadd_rn(__fadd_rn(__fadd_rn(r[0], r[1]), __fadd_rn(r[2], r[3])),
                          __fadd_rn(__fadd_rn(r[4], r[5]), __fadd_rn(r[6], r[7])));
    for (; i < n; ++i) res = __fadd_rn(res, sqr(i));
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return __fadd_rn(numpy_pairwise_sumsq(row, st, n2), numpy_pairwise_sumsq(row + n2 * st, st, n - n2));
}

template <typename V_t>
__global__ void prep_kernel(Heads P, const V_t* __restrict__ hw, Strides4 sv) {
  __shared__ double red[32];
  __shared__ int sbad;
  const int64_t bh = blockIdx.x, b = bh / P.H, h = bh % P.H, Dh = P.Dh;
  int64_t n, s;
  window(P, b, n, s);
  if (threadIdx.x == 0) sbad = 0;
  __syncthreads();
  float* vn = P.vn + bh * P.T * Dh;
  double* m = P.mvec + bh * Dh;
  double* adot = P.adot + bh * P.T;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const V_t* row = hw + b * sv.s0 + h * sv.s1 + (s + i) * sv.s2;
    double nr = 0;
    for (int64_t c = 0; c < Dh; ++c) {
      const double v = ldf(row + c * sv.s3);
      nr += v * v;
    }
    if (!isfinite(nr)) sbad = 1;
    const float nrm = sqrtf(numpy_pairwise_sumsq(row, sv.s3, Dh));
    const float den = nrm > 1e-9f ? nrm : 1e-9f;
    for (int64_t c = 0; c < Dh; ++c) vn[i * Dh + c] = ldf(row + c * sv.s3) / den;
  }
  __syncthreads();
  if (sbad) {
    if (threadIdx.x == 0) P.bad[bh] = 1;
    return;
  }
  double msq_part = 0;
  for (int64_t c = threadIdx.x; c < Dh; c += blockDim.x) {
    double u = 0;
    for (int64_t i = 0; i < n; ++i) u += vn[i * Dh + c];
    m[c] = u / static_cast<double>(n);
    msq_part += m[c] * m[c];
  }
  const double msq = block_sum(msq_part, red);  // also a barrier: m is complete
  const double nn = static_cast<double>(n);
  double mS = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    double a = 0;
    for (int64_t c = 0; c < Dh; ++c) a += m[c] * vn[i * Dh + c];
    adot[i] = a;
    mS = fmax(mS, 0.5 * (nn * a + nn));  // row sum of S: (Vn_i . u + n) / 2, u = n m
  }
  mS = block_max(mS, red);
  // C = W^T W, W = Vn - m: ||C||^2 and m^T C m
  double c2 = 0, mcm = 0;
  for (int64_t e = threadIdx.x; e < Dh * Dh; e += blockDim.x) {
    const int64_t p = e / Dh, q = e % Dh;
    if (q < p) continue;  // symmetric: upper triangle, off-diagonal counted twice
    double cpq = 0;
    for (int64_t i = 0; i < n; ++i) cpq += (vn[i * Dh + p] - m[p]) * (vn[i * Dh + q] - m[q]);
    const double w = p == q ? 1.0 : 2.0;
    c2 += w * cpq * cpq;
    mcm += w * m[p] * cpq * m[q];
  }
  c2 = block_sum(c2, red);
  mcm = block_sum(mcm, red);
  if (threadIdx.x == 0) {
    double* hs = P.hs + bh * 8;
    hs[0] = msq;
    hs[1] = c2 / 4.0;
    const double vtv2 = c2 + 2.0 * nn * mcm + nn * nn * msq * msq;
    hs[2] = (vtv2 + 2.0 * nn * nn * msq + nn * nn) / 4.0;  // |u|^2 = n^2 |m|^2
    hs[3] = 1.0 / fmax(mS, 1e-12);
  }
}

// ---- 2. rows --------------------------------------------------------------------------------

template <typename A_t>
__global__ void attn_rows_kernel(Heads P, const A_t* __restrict__ A, Strides4 sa) {
  const int lane = threadIdx.x & 31;
  const int64_t bh = blockIdx.y, b = bh / P.H, h = bh % P.H;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  int64_t n, s;
  window(P, b, n, s);
  if (i >= n) return;  // warp-uniform (no read of flags other warps may be writing)
  const A_t* row = A + b * sa.s0 + h * sa.s1 + (s + i) * sa.s2 + s * sa.s3;
  int* flags = P.flags + (bh * P.nt + i / TILE) * P.nt;
  double sum = 0, abs_sum = 0;
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const int64_t j = j0 + lane;
    const float a = j < n ? ldf(row + j * sa.s3) : 0.0f;
    sum += a;
    abs_sum += fabsf(a);
    const unsigned any = __ballot_sync(0xffffffffu, a != 0.0f);
    if (lane == 0 && any) atomicOr(flags + j0 / TILE, 1);
  }
  sum = warp_sum(sum);
  abs_sum = warp_sum(abs_sum);
  if (lane == 0) {
    P.rsum[bh * P.T + i] = sum;
    if (!isfinite(abs_sum)) atomicOr(P.bad + bh, 1);
  }
}

template <typename Q_t, typename K_t>
__global__ void qk_rows_kernel(Heads P, const Q_t* __restrict__ q, Strides4 sq,
                               const K_t* __restrict__ k, Strides4 sk, int64_t Hkv, int64_t D,
                               float scale, bool causal) {
  extern __shared__ float qrow_all[];  // [warps, D]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bh = blockIdx.y, b = bh / P.H, h = bh % P.H, hk = h / (P.H / Hkv);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  int64_t n, s;
  window(P, b, n, s);
  if (i >= n) return;  // warp-uniform (no read of flags other warps may be writing)
  float* qrow = qrow_all + warp * D;
  const Q_t* qp = q + b * sq.s0 + h * sq.s1 + (s + i) * sq.s2;
  for (int64_t c = lane; c < D; c += 32) qrow[c] = ldf(qp + c * sq.s3);
  __syncwarp();
  const int64_t ia = s + i, kend = causal ? ia + 1 : P.T;
  float mx = -INFINITY;
  double z = 0, r = 0;
  bool finite = true;
  for (int64_t j = lane; j < kend; j += 32) {
    const K_t* kp = k + b * sk.s0 + hk * sk.s1 + j * sk.s2;
    float l = 0;
    for (int64_t c = 0; c < D; ++c) l += qrow[c] * ldf(kp + c * sk.s3);
    l *= scale;
    finite &= isfinite(l);
    if (!isfinite(l)) continue;
    if (l > mx) {
      const double f = exp(static_cast<double>(mx) - l);
      z *= f;
      r *= f;
      mx = l;
    }
    const double e = exp(static_cast<double>(l) - mx);
    z += e;
    if (j >= s && j < s + n) r += e;
  }
  // combine the lanes' (max, z, r)
  float gmx = mx;
  for (int o = 16; o > 0; o >>= 1) gmx = fmaxf(gmx, __shfl_xor_sync(0xffffffffu, gmx, o));
  const double f = mx == -INFINITY ? 0.0 : exp(static_cast<double>(mx) - gmx);
  z = warp_sum(z * f);
  r = warp_sum(r * f);
  const unsigned all_finite = __all_sync(0xffffffffu, finite);
  if (lane == 0) {
    if (!all_finite) atomicOr(P.bad + bh, 1);
    P.mrow[bh * P.T + i] = gmx;
    P.izrow[bh * P.T + i] = static_cast<float>(1.0 / z);
    P.rsum[bh * P.T + i] = r / z;
  }
}

// ---- 3. centre ------------------------------------------------------------------------------

__global__ void centre_kernel(Heads P) {
  __shared__ double red[32];
  const int64_t bh = blockIdx.x;
  int64_t n, s;
  window(P, bh / P.H, n, s);
  if (P.bad[bh]) return;
  double mA = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double r = P.rsum[bh * P.T + i];
    mA = fmax(mA, r);
    P.xcen[bh * P.T + i] = static_cast<float>(r / static_cast<double>(n));
  }
  mA = block_max(mA, red);
  if (threadIdx.x == 0) P.hs[bh * 8 + 4] = 1.0 / fmax(mA, 1e-12);
}

// ---- 4. tiles -------------------------------------------------------------------------------

// One 64 x 64 tile: A (loaded, or softmax(q k^T) recomputed) against G = Vn_I Vn_J^T.
template <typename A_t, typename K_t, bool QK>
__global__ void __launch_bounds__(THREADS)
tiles_kernel(Heads P, const A_t* __restrict__ A, Strides4 sa, const K_t* __restrict__ k,
             Strides4 sk, int64_t Hkv, int64_t D, float scale, bool causal) {
  // A is q for the qk op (its dtype A_t)
  __shared__ float Xi[KC][TILE + 1];
  __shared__ float Xj[KC][TILE + 1];
  __shared__ float rowacc[TILE], colacc[TILE];
  __shared__ double red[32];
  const int64_t bh = blockIdx.y, b = bh / P.H, h = bh % P.H;
  const int64_t I = blockIdx.x / P.nt, J = blockIdx.x % P.nt;
  int64_t n, s;
  window(P, b, n, s);
  const int64_t i0 = I * TILE, j0 = J * TILE;
  if (i0 >= n || j0 >= n || P.bad[bh]) return;
  const int64_t ni = min((int64_t)TILE, n - i0), nj = min((int64_t)TILE, n - j0);
  const float* xc = P.xcen + bh * P.T;
  const bool zero = QK ? (causal && j0 > i0 + ni - 1) : (P.flags[(bh * P.nt + I) * P.nt + J] == 0);
  if (zero) {  // sum over the tile of (0 - x_i)^2
    double sx2 = 0;
    for (int64_t r = threadIdx.x; r < ni; r += blockDim.x) sx2 += static_cast<double>(xc[i0 + r]) * xc[i0 + r];
    sx2 = block_sum(sx2, red);
    if (threadIdx.x == 0) atomicAdd(P.acc + bh * 4 + 3, sx2 * static_cast<double>(nj));
    return;
  }
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  if (threadIdx.x < TILE) rowacc[threadIdx.x] = colacc[threadIdx.x] = 0.0f;

  // G tile: acc[r][c] = Vn[i0 + 4 ty + r] . Vn[j0 + 4 tx + c]
  float g[4][4] = {};
  const float* vn = P.vn + bh * P.T * P.Dh;
  for (int64_t k0 = 0; k0 < P.Dh; k0 += KC) {
    for (int e = threadIdx.x; e < KC * TILE; e += blockDim.x) {
      const int r = e / KC, c = e % KC;
      const bool kin = k0 + c < P.Dh;
      Xi[c][r] = (r < ni && kin) ? vn[(i0 + r) * P.Dh + k0 + c] : 0.0f;
      Xj[c][r] = (r < nj && kin) ? vn[(j0 + r) * P.Dh + k0 + c] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      float a[4], bb[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        a[t] = Xi[c][ty * 4 + t];
        bb[t] = Xj[c][tx * 4 + t];
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) g[r][cc] += a[r] * bb[cc];
    }
    __syncthreads();
  }

  // A tile values for this thread's 4 x 4 entries
  float av[4][4] = {};
  if (QK) {
    const int64_t hk = h / (P.H / Hkv);
    float l[4][4] = {};
    for (int64_t k0 = 0; k0 < D; k0 += KC) {
      for (int e = threadIdx.x; e < KC * TILE; e += blockDim.x) {
        const int r = e / KC, c = e % KC;
        const bool kin = k0 + c < D;
        Xi[c][r] = (r < ni && kin) ? ldf(A + b * sa.s0 + h * sa.s1 + (s + i0 + r) * sa.s2 + (k0 + c) * sa.s3) : 0.0f;
        Xj[c][r] = (r < nj && kin) ? ldf(k + b * sk.s0 + hk * sk.s1 + (s + j0 + r) * sk.s2 + (k0 + c) * sk.s3) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        float a[4], bb[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          a[t] = Xi[c][ty * 4 + t];
          bb[t] = Xj[c][tx * 4 + t];
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int cc = 0; cc < 4; ++cc) l[r][cc] += a[r] * bb[cc];
      }
      __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t i = i0 + ty * 4 + r;
      if (i >= n) continue;
      const float m = P.mrow[bh * P.T + i], iz = P.izrow[bh * P.T + i];
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) {
        const int64_t j = j0 + tx * 4 + cc;
        const bool masked = j >= n || (causal && j > i);
        av[r][cc] = masked ? 0.0f : expf(l[r][cc] * scale - m) * iz;
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t i = i0 + ty * 4 + r;
      if (i >= n) continue;
      const A_t* row = A + b * sa.s0 + h * sa.s1 + (s + i) * sa.s2;
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) {
        const int64_t j = j0 + tx * 4 + cc;
        av[r][cc] = j < n ? ldf(row + (s + j) * sa.s3) : 0.0f;
      }
    }
  }

  const double* hs = P.hs + bh * 8;
  const float inv_mS = static_cast<float>(hs[3]), inv_mA = static_cast<float>(hs[4]);
  float kl = 0, ag = 0, a2 = 0, ax2 = 0;
  float csum[4] = {0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int64_t i = i0 + ty * 4 + r;
    if (i >= n) continue;
    const float xi = xc[i];
    float rs = 0;
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int64_t j = j0 + tx * 4 + cc;
      if (j >= n) continue;
      const float a = av[r][cc], gv = g[r][cc];
      const float S = (gv + 1.0f) * 0.5f;
      const float p = fmaxf(a * inv_mA, 1e-12f), q = fmaxf(S * inv_mS, 1e-12f);
      kl += p * logf(p / q);
      ag += a * gv;
      a2 += a * a;
      ax2 += (a - xi) * (a - xi);
      rs += a;
      csum[cc] += a;
    }
    atomicAdd(&rowacc[ty * 4 + r], rs);
  }
#pragma unroll
  for (int cc = 0; cc < 4; ++cc) atomicAdd(&colacc[tx * 4 + cc], csum[cc]);
  const double skl = block_sum(kl, red);  // the barrier also completes rowacc / colacc
  const double sag = block_sum(ag, red);
  const double sa2 = block_sum(a2, red);
  const double sax2 = block_sum(ax2, red);
  if (threadIdx.x == 0) {
    atomicAdd(P.acc + bh * 4 + 0, skl);
    atomicAdd(P.acc + bh * 4 + 1, sag);
    atomicAdd(P.acc + bh * 4 + 2, sa2);
    atomicAdd(P.acc + bh * 4 + 3, sax2);
  }
  if (threadIdx.x < ni) atomicAdd(P.rowp + bh * P.T + i0 + threadIdx.x, static_cast<double>(rowacc[threadIdx.x]));
  if (threadIdx.x < nj) atomicAdd(P.colp + bh * P.T + j0 + threadIdx.x, static_cast<double>(colacc[threadIdx.x]));
}

// ---- 5. finalize ----------------------------------------------------------------------------

__global__ void finalize_kernel(Heads P, float* __restrict__ out) {
  __shared__ double red[32];
  const int64_t bh = blockIdx.x;
  int64_t n, s;
  window(P, bh / P.H, n, s);
  float* o = out + bh * 3;
  if (P.bad[bh]) {
    if (threadIdx.x == 0) o[0] = o[1] = o[2] = NAN;
    return;
  }
  const double nn = static_cast<double>(n);
  const double* rowp = P.rowp + bh * P.T;
  const double* colp = P.colp + bh * P.T;
  const double* adot = P.adot + bh * P.T;
  const float* x = P.xcen + bh * P.T;
  double sx = 0, sA = 0, ra = 0, ca = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    sx += x[i];
    sA += rowp[i];
    ra += rowp[i] * adot[i];
    ca += colp[i] * adot[i];
  }
  sx = block_sum(sx, red);
  sA = block_sum(sA, red);
  ra = block_sum(ra, red);
  ca = block_sum(ca, red);
  double rr = 0, cc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double br = rowp[i] - nn * x[i], bc = colp[i] - sx;
    rr += br * br;
    cc += bc * bc;
  }
  rr = block_sum(rr, red);
  cc = block_sum(cc, red);
  if (threadIdx.x == 0) {
    const double* hs = P.hs + bh * 8;
    const double* acc = P.acc + bh * 4;
    const double b1 = sA - nn * sx;
    const double Acc = fmax(0.0, acc[3] - rr / nn - cc / nn + b1 * b1 / (nn * nn));
    const double Scc = hs[1];
    const double bound = sqrt(Acc * Scc);
    const double Asc = fmin(bound, fmax(-bound, 0.5 * (acc[1] - ra - ca + sA * hs[0])));
    const double c = Asc / fmax(bound, 1e-12);
    const double num = sqrt(fmax(0.0, Acc - 2.0 * Asc + Scc));
    const double den = fmax(sqrt(acc[2]) * sqrt(hs[2]), 1e-9);
    o[0] = static_cast<float>(num / den);
    o[1] = static_cast<float>(c);
    o[2] = static_cast<float>(acc[0] / nn);
  }
}

// ---- host side ------------------------------------------------------------------------------

struct Scratch {
  at::Tensor f32, f64, i32;
};

Heads make_heads(int64_t B, int64_t H, int64_t T, int64_t Dh, const at::Tensor& lengths,
                 const std::optional<at::Tensor>& offsets, bool qk, Scratch& sc,
                 const at::TensorOptions& opts) {
  Heads P{};
  P.B = B;
  P.H = H;
  P.T = T;
  P.Dh = Dh;
  P.nt = (T + TILE - 1) / TILE;
  const int64_t BH = B * H;
  P.len = lengths.data_ptr<int64_t>();
  P.off = (offsets.has_value() && offsets->defined()) ? offsets->data_ptr<int64_t>() : nullptr;
  const int64_t nf = BH * T * Dh + BH * T + (qk ? 2 * BH * T : 0);
  const int64_t nd = BH * Dh + 4 * BH * T + 8 * BH + 4 * BH;
  const int64_t ni = BH + (qk ? 0 : BH * P.nt * P.nt);
  sc.f32 = at::empty({nf}, opts.dtype(at::kFloat));
  sc.f64 = at::zeros({nd}, opts.dtype(at::kDouble));
  sc.i32 = at::zeros({ni}, opts.dtype(at::kInt));
  float* f = sc.f32.data_ptr<float>();
  double* d = sc.f64.data_ptr<double>();
  int* in = sc.i32.data_ptr<int>();
  P.vn = f;
  f += BH * T * Dh;
  P.xcen = f;
  f += BH * T;
  if (qk) {
    P.mrow = f;
    f += BH * T;
    P.izrow = f;
  }
  P.mvec = d;
  d += BH * Dh;
  P.adot = d;
  d += BH * T;
  P.rsum = d;
  d += BH * T;
  P.rowp = d;
  d += BH * T;
  P.colp = d;
  d += BH * T;
  P.hs = d;
  d += 8 * BH;
  P.acc = d;
  P.bad = in;
  P.flags = qk ? nullptr : in + BH;
  return P;
}

void check_windows_on_host(const char* op, const at::Tensor& lengths,
                           const std::optional<at::Tensor>& offsets, int64_t T) {
  const auto len_cpu = lengths.cpu();  // one small device-to-host copy per call
  if (offsets.has_value() && offsets->defined()) {
    const auto off_cpu = offsets->cpu();
    check_window_values(op, len_cpu, &off_cpu, T);
  } else {
    check_window_values(op, len_cpu, nullptr, T);
  }
}

template <typename V_t>
void launch_prep(const Heads& P, const at::Tensor& hw, cudaStream_t stream) {
  prep_kernel<V_t><<<P.B * P.H, THREADS, 0, stream>>>(P, hw.const_data_ptr<V_t>(), strides4(hw));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor vas_head_stats_cuda(const at::Tensor& attn, const at::Tensor& head_writes,
                               const at::Tensor& lengths, const std::optional<at::Tensor>& offsets) {
  const char* op = "headscope::vas_head_stats";
  check_head_stats_args(attn, head_writes, lengths, offsets);
  const c10::cuda::CUDAGuard guard(attn.device());
  const int64_t B = attn.size(0), H = attn.size(1), T = attn.size(2), Dh = head_writes.size(3);
  at::Tensor out = at::empty({B, H, 3}, attn.options().dtype(at::kFloat));
  if (B == 0 || H == 0) return out;
  check_windows_on_host(op, lengths, offsets, T);
  const auto len = lengths.contiguous();
  const auto off = (offsets.has_value() && offsets->defined())
                       ? std::optional<at::Tensor>(offsets->contiguous()) : std::nullopt;
  Scratch sc;
  Heads P = make_heads(B, H, T, Dh, len, off, false, sc, attn.options());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, head_writes.scalar_type(), "vas_v",
                                  [&] { launch_prep<scalar_t>(P, head_writes, stream); });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(), "vas_a", [&] {
    const dim3 rows_grid((T + 7) / 8, B * H);
    attn_rows_kernel<scalar_t><<<rows_grid, THREADS, 0, stream>>>(P, attn.const_data_ptr<scalar_t>(),
                                                                  strides4(attn));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    centre_kernel<<<B * H, THREADS, 0, stream>>>(P);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const dim3 tiles_grid(P.nt * P.nt, B * H);
    tiles_kernel<scalar_t, float, false><<<tiles_grid, THREADS, 0, stream>>>(
        P, attn.const_data_ptr<scalar_t>(), strides4(attn), nullptr, Strides4{0, 0, 0, 0}, 1, 1,
        1.0f, false);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  finalize_kernel<<<B * H, THREADS, 0, stream>>>(P, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor vas_head_stats_qk_cuda(const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& head_writes, const at::Tensor& lengths,
                                  double scale, bool causal,
                                  const std::optional<at::Tensor>& offsets) {
  const char* op = "headscope::vas_head_stats_qk";
  check_head_stats_qk_args(q, k, head_writes, lengths, scale, offsets);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  const int64_t Dh = head_writes.size(3);
  at::Tensor out = at::empty({B, H, 3}, q.options().dtype(at::kFloat));
  if (B == 0 || H == 0) return out;
  check_windows_on_host(op, lengths, offsets, T);
  const auto len = lengths.contiguous();
  const auto off = (offsets.has_value() && offsets->defined())
                       ? std::optional<at::Tensor>(offsets->contiguous()) : std::nullopt;
  Scratch sc;
  Heads P = make_heads(B, H, T, Dh, len, off, true, sc, q.options());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, head_writes.scalar_type(), "vas_v",
                                  [&] { launch_prep<scalar_t>(P, head_writes, stream); });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "vas_q", [&] {
    using Q_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "vas_k", [&] {
      using K_t = scalar_t;
      const dim3 rows_grid((T + 7) / 8, B * H);
      const size_t smem = sizeof(float) * 8 * D;
      qk_rows_kernel<Q_t, K_t><<<rows_grid, THREADS, smem, stream>>>(
          P, q.const_data_ptr<Q_t>(), strides4(q), k.const_data_ptr<K_t>(), strides4(k), Hkv, D,
          fscale, causal);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      centre_kernel<<<B * H, THREADS, 0, stream>>>(P);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const dim3 tiles_grid(P.nt * P.nt, B * H);
      tiles_kernel<Q_t, K_t, true><<<tiles_grid, THREADS, 0, stream>>>(
          P, q.const_data_ptr<Q_t>(), strides4(q), k.const_data_ptr<K_t>(), strides4(k), Hkv, D,
          fscale, causal);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  finalize_kernel<<<B * H, THREADS, 0, stream>>>(P, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
    return static_cast<double>(static_cast<float>(r));  // the seed stores float32
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
  m.impl("vas_head_stats", &vas_head_stats_cuda);
  m.impl("vas_head_stats_qk", &vas_head_stats_qk_cuda);
  m.impl("vas_aggregate", &vas_aggregate_cuda);
}

}  // namespace headscope::vas
