// Setup of a vas CPU call: the windows, the schedule and buffers (setup, alloc_scratch), the
// value side of every head (prepare_values) and the qk op's inputs as float (qk_prepare).
#include "vas/cpu/vas_head_stats_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace headscope::vas::cpu {
namespace {

// Whether n floats are all finite: x - x is 0 for a finite x, NaN for an infinity or a NaN.
inline bool all_finite(const float* x, int64_t n) {
  f8 acc = {};
  for_each8(x, n, [&](f8 v, int64_t) { acc += v - v; });
  return hsum(acc) == 0.0f;
}

// NumPy's pairwise summation of float32 values (what np.linalg.norm uses): the reference's
// row norms, reproduced bit for bit so that Vn (and Gram entries near -1, where S ~ 0 and
// the KL's logarithm is sensitive) match the reference's.
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

// Below this ||Sc||^2 / ||S||^2 a head's Gram tiles are formed from W (see prepare_values).
constexpr double kCentredGram = 1e-2;

template <typename V_t>
void prepare_values_typed(Problem& P, const at::Tensor& head_writes, const Range* only) {
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
        for (int64_t c = 0; c < Dh; ++c) vi[c] = row[c] / den;  // a division, as the reference
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
      transpose(vn, Dh, n, Dh, vnt, P.Tp);
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
      // rebuilt G's rounding would matter); elsewhere Vn keeps the Gram tiles the reference's
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
        transpose(vn, Dh, n, Dh, vnt, P.Tp);
        for (int64_t c = 0; c < Dh; ++c) std::copy(vnt + c * P.Tp, vnt + c * P.Tp + n, WT + c * P.Tp);
        value_norms();
      } else {
        std::fill(e, e + n, 0.0f);
      }
      P.msq[bh] = msq;
    }
  });
}

template <typename Q_t, typename K_t>
void qk_prepare_typed(Problem& P, QK& Q, const at::Tensor& q, const at::Tensor& k) {
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
        // with blocks any key may be seen, else keys up to key_end
        const int64_t j1 = Q.block_seen.empty() ? Q.key_end(P, b) : P.T;
        for (int64_t j = 0; j < j1; ++j) {
          // keys no row sees and padding keys: never used, their values (maybe not finite)
          // not read; stored as zeros, since key blocks span them
          if (!Q.seen(P, b, j) || Q.padded(b, j, P.T)) {
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

}  // namespace

at::Tensor no_heads(const char* op, int64_t B, int64_t H, int64_t T, const at::Tensor& lengths,
                    const std::optional<at::Tensor>& offsets, const at::TensorOptions& options) {
  check_window_values(op, lengths, offsets.has_value() && offsets->defined() ? &*offsets : nullptr, T);
  return at::empty({B, H, 3}, options.dtype(at::kFloat));
}

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
  // twice), so whole heads win while their ceil(BH / threads) rounds take at most
  // 1.5 BH / threads.
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

void alloc_scratch(Problem& P, int64_t extra) {
  // tiles A_IJ, A_JI, the Gram panel | a row | W (+16 floats read past the end by gemm_nn) |
  // W^T | C
  P.scratch_per_thread = 3 * kTileFloats + std::max(P.T, P.Dh) + 16 + P.T * P.Dh + 16 +
                         P.Dh * P.Tp + P.Dh * P.Dh + extra;
  P.scratch_extra = extra;
  P.scratch = at::empty({P.nthreads, P.scratch_per_thread}, at::TensorOptions().dtype(at::kFloat));
}

void prepare_values(Problem& P, const at::Tensor& head_writes, const Range* only) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, head_writes.scalar_type(), "vas_v",
                                  [&] { prepare_values_typed<scalar_t>(P, head_writes, only); });
}

void qk_prepare(Problem& P, QK& Q, const at::Tensor& q, const at::Tensor& k) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "vas_q", [&] {
    using Q_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "vas_k",
                                    [&] { qk_prepare_typed<Q_t, scalar_t>(P, Q, q, k); });
  });
}

}  // namespace headscope::vas::cpu
