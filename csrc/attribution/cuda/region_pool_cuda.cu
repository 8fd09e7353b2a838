// CUDA kernels of region_pool and region_pool_qk.
//
// region_pool: one block per (b, h); threads stride over keys, each folds the span's
// weighted queries of its key and adds the result to its region's accumulator (shared
// memory when K fits, global scratch otherwise).
//
// region_pool_qk (flash-decoding style, never storing (B, H, Tq, Tk)):
//   pass A, one block per (active query row, head, key split): scores of a tile of keys
//     (one warp per key, lanes over D) go to shared memory; an online softmax keeps the
//     split's running max m, normaliser z and per-region mass acc[K] (rescaled when m
//     grows). Writes (m, z, acc) per (row, head, split).
//   pass B, one block per (b, h): combines the splits of every active row of batch b,
//     acc / z at the common max, weighted by the row's normalised weight.
// Rows with zero weight are never computed (only the active rows are launched).
// key_weights (converted to the accumulation dtype, any strides) multiply each key's
// softmax numerator (pass A) or folded attention (region_pool) before its region's sum.
#include "attribution/attribution_checks.h"
#include "common/attention_pattern_host.h"
#include "common/checks.h"
#include "common/kernel.h"
#include "common/cuda_launch.h"
#include "common/cuda_reduce.cuh"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

namespace headscope::attribution::cuda {
namespace {

using namespace headscope::cuda_reduce;
using cuda_launch::try_enable_smem;

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }

constexpr int kThreads = 256;
constexpr int kTile = 256;  // keys per shared-memory tile in pass A

// key_weights as the kernels read them: factor of query head h on key t at
// p[b * s0 + (h / group) * s1 + t * s2]; p null: none.
template <typename acc_t>
struct KeyFactors {
  const acc_t* p = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0, group = 1, heads = 0;
  __device__ __forceinline__ acc_t at(int64_t b, int64_t h, int64_t t) const {
    return p[b * s0 + h / group * s1 + t * s2];
  }
};

// key_weights converted to acc (a view when already of that dtype), for H query heads.
template <typename acc_t>
KeyFactors<acc_t> key_factors(const std::optional<at::Tensor>& key_weights, int64_t H,
                              at::Tensor& holder) {
  KeyFactors<acc_t> f;
  if (!key_weights.has_value() || !key_weights->defined()) return f;
  holder = key_weights->to(c10::CppTypeToScalarType<acc_t>::value);
  f.p = holder.const_data_ptr<acc_t>();
  f.s0 = holder.stride(0);
  f.s1 = holder.stride(1);
  f.s2 = holder.stride(2);
  f.heads = holder.size(1);
  f.group = H / f.heads;
  return f;
}

// The factors of accumulation dtype acc_t (the last argument's type) of the two prepared.
inline const KeyFactors<float>& select_factors(const KeyFactors<float>& f,
                                               const KeyFactors<double>&, float) {
  return f;
}
inline const KeyFactors<double>& select_factors(const KeyFactors<float>&,
                                                const KeyFactors<double>& d, double) {
  return d;
}

// ---- region_pool ----------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
__global__ void region_pool_kernel(const scalar_t* __restrict__ attn, int64_t s0, int64_t s1,
                                   int64_t s2, int64_t s3, const acc_t* __restrict__ wn,
                                   const int64_t* __restrict__ rid, int64_t r0, int64_t r1,
                                   int64_t H, int64_t Tq, int64_t Tk, int64_t K, bool mean,
                                   KeyFactors<acc_t> kw, bool use_shared,
                                   acc_t* __restrict__ gacc,
                                   int* __restrict__ gcnt, acc_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / H, h = bh % H;
  acc_t* acc;
  int* cnt;
  if (use_shared) {
    acc = reinterpret_cast<acc_t*>(smem_raw);
    cnt = reinterpret_cast<int*>(acc + K);
  } else {
    acc = gacc + bh * K;
    cnt = gcnt + bh * K;
  }
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    acc[k] = acc_t(0);
    cnt[k] = 0;
  }
  __syncthreads();
  const scalar_t* a = attn + b * s0 + h * s1;
  const acc_t* w = wn + b * Tq;
  for (int64_t t = threadIdx.x; t < Tk; t += blockDim.x) {
    const int64_t r = rid[b * r0 + t * r1];
    if (r < 0) continue;
    acc_t v = 0;
    for (int64_t q = 0; q < Tq; ++q) {
      const acc_t wq = w[q];
      if (wq != acc_t(0)) v += wq * static_cast<acc_t>(a[q * s2 + t * s3]);
    }
    atomicAdd(acc + r, kw.p != nullptr ? v * kw.at(b, h, t) : v);
    if (mean) atomicAdd(cnt + r, 1);
  }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    acc_t v = acc[k];
    if (mean) v = cnt[k] > 0 ? v / static_cast<acc_t>(cnt[k]) : acc_t(0);
    out[(b * K + k) * H + h] = v;
  }
}

// Checks the values of region_ids and query_weights and normalises the weights, one block
// per batch row: flag bit 1 marks a region id outside [-1, K), bit 2 a negative or
// non-finite weight, bit 4 a row whose weights sum to <= 0 (in float64), bit 8 a
// non-finite key weight at an image key (the only ones read).
template <typename w_t, typename acc_t>
__global__ void pool_prepare_kernel(const w_t* __restrict__ w, int64_t w0, int64_t w1, int64_t Tq,
                                    const int64_t* __restrict__ rid, int64_t r0, int64_t r1,
                                    int64_t Tk, int64_t K, KeyFactors<acc_t> kw,
                                    acc_t* __restrict__ wn, int* __restrict__ flag) {
  __shared__ double red[32];
  const int64_t b = blockIdx.x;
  int bad = 0;
  double sum = 0;
  for (int64_t q = threadIdx.x; q < Tq; q += blockDim.x) {
    const double v = static_cast<double>(w[b * w0 + q * w1]);
    if (!(v >= 0.0) || isinf(v)) bad |= 2;
    sum += v;
  }
  sum = block_sum(sum, red);
  if (!(sum > 0.0)) bad |= 4;
  for (int64_t q = threadIdx.x; q < Tq; q += blockDim.x)
    wn[b * Tq + q] = static_cast<acc_t>(static_cast<double>(w[b * w0 + q * w1]) / sum);
  for (int64_t t = threadIdx.x; t < Tk; t += blockDim.x) {
    const int64_t r = rid[b * r0 + t * r1];
    if (r < -1 || r >= K) bad |= 1;
    if (kw.p != nullptr && r >= 0)
      for (int64_t h = 0; h < kw.heads; ++h)
        if (!isfinite(kw.p[b * kw.s0 + h * kw.s1 + t * kw.s2])) bad |= 8;
  }
  if (bad) atomicOr(flag, bad);
}

// The values check of both pooling ops (key weights kw when given) and the normalised span
// weights (B, Tq) in acc dtype: one launch and one host synchronisation; the detailed checks
// (which word the error) run only when the flag is set.
template <typename acc_t>
at::Tensor checked_normalised_weights(const char* op, const at::Tensor& query_weights,
                                      const at::Tensor& region_ids, int64_t K,
                                      const KeyFactors<acc_t>& kw, const at::Tensor& kw_values) {
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const int64_t B = query_weights.size(0), Tq = query_weights.size(1), Tk = region_ids.size(1);
  auto wn = at::empty({B, Tq}, query_weights.options().dtype(acc));
  if (B == 0) return wn;
  if (Tq == 0) check_pool_values(op, region_ids, K, query_weights);  // throws: empty span
  auto flag = at::zeros({1}, query_weights.options().dtype(at::kInt));
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query_weights.scalar_type(),
                                  "headscope_pool_prepare", [&] {
    pool_prepare_kernel<scalar_t, acc_t><<<static_cast<unsigned>(B), kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(query_weights.const_data_ptr()), query_weights.stride(0),
        query_weights.stride(1), Tq, region_ids.const_data_ptr<int64_t>(), region_ids.stride(0),
        region_ids.stride(1), Tk, K, kw, static_cast<acc_t*>(wn.mutable_data_ptr()),
        flag.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (flag.item<int>() != 0) {  // throws
    check_pool_values(op, region_ids, K, query_weights);
    if (kw_values.defined()) check_key_weights_values(op, "key_weights", kw_values, region_ids);
  }
  return wn;
}

size_t pool_smem_bytes(int64_t K, size_t acc_size) { return K * (acc_size + sizeof(int)); }

at::Tensor region_pool_cuda(const at::Tensor& attn, const at::Tensor& query_weights,
                            const at::Tensor& region_ids, int64_t num_regions,
                            c10::string_view reduce,
                            const std::optional<at::Tensor>& key_weights) {
  const char* op = "headscope::region_pool";
  check_region_pool_args(attn, query_weights, region_ids, num_regions, reduce, key_weights);
  const bool mean = parse_reduce(op, reduce);
  const c10::cuda::CUDAGuard guard(attn.device());
  const int64_t B = attn.size(0), H = attn.size(1), Tq = attn.size(2), Tk = attn.size(3);
  const int64_t K = num_regions;
  const auto acc_type = accum_dtype(attn.scalar_type());
  auto out = at::empty({B, K, H}, attn.options().dtype(acc_type));
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(),
                                  "headscope_region_pool_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor kw_values;
    const auto kw = key_factors<acc_t>(key_weights, H, kw_values);
    const auto wn = checked_normalised_weights<acc_t>(op, query_weights, region_ids, K, kw,
                                                      kw_values);
    if (out.numel() == 0) return;
    auto kernel = region_pool_kernel<scalar_t, acc_t>;
    const size_t smem = pool_smem_bytes(K, sizeof(acc_t));
    const bool use_shared = try_enable_smem(reinterpret_cast<const void*>(kernel), smem);
    at::Tensor gacc, gcnt;
    if (!use_shared) {
      gacc = at::empty({B * H, K}, out.options());
      gcnt = at::empty({B * H, K}, out.options().dtype(at::kInt));
    }
    const unsigned blocks = static_cast<unsigned>(B * H);
    const size_t smem_launch = use_shared ? smem : 0;
    kernel<<<blocks, kThreads, smem_launch, stream>>>(
        attn.const_data_ptr<scalar_t>(), attn.stride(0), attn.stride(1), attn.stride(2),
        attn.stride(3), wn.const_data_ptr<acc_t>(), region_ids.const_data_ptr<int64_t>(),
        region_ids.stride(0), region_ids.stride(1), H, Tq, Tk, K, mean, kw, use_shared,
        use_shared ? nullptr : gacc.mutable_data_ptr<acc_t>(),
        use_shared ? nullptr : gcnt.mutable_data_ptr<int>(), out.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// ---- region_pool_qk ---------------------------------------------------------------------------

struct QKParams {
  int64_t B, H, Hkv, Tq, Tk, D, K, G;
  int64_t qs0, qs1, qs2, qs3;  // q strides
  int64_t ks0, ks1, ks2;       // k strides (stride of D is 1)
  int64_t r0, r1;              // region_ids strides
  int64_t p0, p1;              // key_padding_mask strides
  int64_t n_active, nsplit, chunk;
  double scale;
  bool causal;
  BatchPattern pat;
};

// Pass A. Grid: n_active * H * nsplit blocks. Shared: q (D), scores (kTile), acc (K),
// reduction scratch (32).
template <typename scalar_t, typename acc_t>
__global__ void qk_split_kernel(QKParams p, KeyFactors<acc_t> kw, const scalar_t* __restrict__ q,
                                const scalar_t* __restrict__ k,
                                const int64_t* __restrict__ active,  // (n_active, 2): b, q; nullptr: (row, 0)
                                const int64_t* __restrict__ rid, const bool* __restrict__ pad,
                                acc_t* __restrict__ part_m, acc_t* __restrict__ part_z,
                                acc_t* __restrict__ part_acc) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* qs = reinterpret_cast<acc_t*>(smem_raw);
  acc_t* sc = qs + p.D;
  acc_t* acc = sc + kTile;
  acc_t* red = acc + p.K;
  __shared__ acc_t m_sh, z_sh;

  const int64_t split = blockIdx.x % p.nsplit;
  const int64_t rh = blockIdx.x / p.nsplit;  // (active row, head)
  const int64_t row = rh / p.H, h = rh % p.H;
  const int64_t b = active != nullptr ? active[2 * row] : row;
  const int64_t qi = active != nullptr ? active[2 * row + 1] : 0;
  const int64_t hk = h / p.G;
  // the query's keys [lo, hi] under the pattern (queries aligned with the last Tq keys);
  // a query with a block may see any key of it (each key's block is checked below)
  const AttentionPattern ap = p.pat.row(b);
  const int64_t pos = qi + p.Tk - p.Tq;
  const int64_t qb = ap.query_block(pos, p.Tk);
  const int64_t lo = ap.first_key(pos, qb, 0);
  const int64_t hi = ap.last_key(pos, p.Tk, qb, p.Tk - 1);
  const int64_t t_begin = std::max<int64_t>(split * p.chunk, lo);
  const int64_t t_end = std::min<int64_t>(split * p.chunk + p.chunk, hi + 1);

  for (int64_t d = threadIdx.x; d < p.D; d += blockDim.x)
    qs[d] = static_cast<acc_t>(q[b * p.qs0 + h * p.qs1 + qi * p.qs2 + d * p.qs3]) *
            static_cast<acc_t>(p.scale);
  for (int64_t kk = threadIdx.x; kk < p.K; kk += blockDim.x) acc[kk] = acc_t(0);
  if (threadIdx.x == 0) {
    m_sh = -INFINITY;
    z_sh = acc_t(0);
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const scalar_t* kb = k + b * p.ks0 + hk * p.ks1;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int64_t T = std::min<int64_t>(kTile, t_end - t0);
    for (int64_t j = warp; j < T; j += warps) {
      const int64_t t = t0 + j;
      const scalar_t* kr = kb + t * p.ks2;
      acc_t s = 0;
      for (int64_t d = lane; d < p.D; d += 32) s += qs[d] * static_cast<acc_t>(kr[d]);
      s = warp_sum(s);
      if (lane == 0) {
        const bool masked =
            (pad != nullptr && pad[b * p.p0 + t * p.p1]) || !ap.sees(pos, qb, t);
        if (p.pat.softcap > 0) s = softcap_logit(s, static_cast<acc_t>(p.pat.softcap));
        sc[j] = masked ? acc_t(-INFINITY) : s;
      }
    }
    __syncthreads();
    acc_t lm = -INFINITY;
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) lm = sc[j] > lm ? sc[j] : lm;
    const acc_t tmax = block_max(lm, red);
    const acc_t m_old = m_sh;
    const acc_t m_new = tmax > m_old ? tmax : m_old;
    if (m_new == acc_t(-INFINITY)) {  // uniform across the block: all masked so far, or NaN
      acc_t nan_seen = 0;               // logits, which make the row's features NaN
      for (int64_t j = threadIdx.x; j < T; j += blockDim.x) nan_seen = sc[j] != sc[j] ? 1 : nan_seen;
      if (block_max(nan_seen, red) > 0 && threadIdx.x == 0) z_sh = NAN;
      __syncthreads();
      continue;
    }
    if (m_new > m_old) {
      const acc_t f = m_old == acc_t(-INFINITY) ? acc_t(0) : exp_acc(m_old - m_new);
      for (int64_t kk = threadIdx.x; kk < p.K; kk += blockDim.x) acc[kk] *= f;
      if (threadIdx.x == 0) z_sh *= f;
    }
    __syncthreads();
    acc_t lz = 0;
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
      const acc_t e = exp_acc(sc[j] - m_new);  // exp(-inf) = 0 for masked keys
      lz += e;
      const int64_t r = rid[b * p.r0 + (t0 + j) * p.r1];
      if (r >= 0) atomicAdd(acc + r, kw.p != nullptr ? e * kw.at(b, h, t0 + j) : e);
    }
    const acc_t tz = block_sum(lz, red);
    if (threadIdx.x == 0) {
      z_sh += tz;
      m_sh = m_new;
    }
    __syncthreads();
  }
  const int64_t slot = rh * p.nsplit + split;
  if (threadIdx.x == 0) {
    part_m[slot] = m_sh;
    part_z[slot] = z_sh;
  }
  for (int64_t kk = threadIdx.x; kk < p.K; kk += blockDim.x) part_acc[slot * p.K + kk] = acc[kk];
}

// Pass B. Grid: B * H blocks; threads over regions.
template <typename acc_t>
__global__ void qk_combine_kernel(QKParams p, const int64_t* __restrict__ active,
                                  const acc_t* __restrict__ wn, const int64_t* __restrict__ rid,
                                  const acc_t* __restrict__ part_m,
                                  const acc_t* __restrict__ part_z,
                                  const acc_t* __restrict__ part_acc, bool mean,
                                  int* __restrict__ gcnt, acc_t* __restrict__ out) {
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / p.H, h = bh % p.H;
  int* cnt = gcnt + bh * p.K;
  if (mean) {
    for (int64_t kk = threadIdx.x; kk < p.K; kk += blockDim.x) cnt[kk] = 0;
    __syncthreads();
    for (int64_t t = threadIdx.x; t < p.Tk; t += blockDim.x) {
      const int64_t r = rid[b * p.r0 + t * p.r1];
      if (r >= 0) atomicAdd(cnt + r, 1);
    }
    __syncthreads();
  }
  for (int64_t kk = threadIdx.x; kk < p.K; kk += blockDim.x) {
    acc_t total = 0;
    for (int64_t row = 0; row < p.n_active; ++row) {
      if ((active != nullptr ? active[2 * row] : row) != b) continue;
      const int64_t qi = active != nullptr ? active[2 * row + 1] : 0;
      const int64_t base = (row * p.H + h) * p.nsplit;
      acc_t M = -INFINITY;
      bool nan_logits = false;
      for (int64_t s = 0; s < p.nsplit; ++s) {
        M = part_m[base + s] > M ? part_m[base + s] : M;
        nan_logits |= part_z[base + s] != part_z[base + s];
      }
      if (nan_logits) {  // a weighted row whose logits hold NaN or an infinity
        total = NAN;
        break;
      }
      if (M == acc_t(-INFINITY)) continue;  // no visible key: the row adds nothing
      acc_t Z = 0, A = 0;
      for (int64_t s = 0; s < p.nsplit; ++s) {
        const acc_t ms = part_m[base + s];
        if (ms == acc_t(-INFINITY)) continue;
        const acc_t f = exp_acc(ms - M);
        Z += part_z[base + s] * f;
        A += part_acc[(base + s) * p.K + kk] * f;
      }
      total += wn[b * p.Tq + qi] * (A / Z);
    }
    if (mean) total = cnt[kk] > 0 ? total / static_cast<acc_t>(cnt[kk]) : acc_t(0);
    out[(b * p.K + kk) * p.H + h] = total;
  }
}

at::Tensor region_pool_qk_cuda(const at::Tensor& q, const at::Tensor& k_in,
                               const at::Tensor& query_weights, const at::Tensor& region_ids,
                               int64_t num_regions, std::optional<double> scale, bool causal,
                               const std::optional<at::Tensor>& key_padding_mask,
                               c10::string_view reduce, std::optional<int64_t> window,
                               std::optional<int64_t> chunk,
                               const std::optional<at::Tensor>& block_ids,
                               std::optional<double> softcap, bool window_bounds_blocks,
                               const std::optional<at::Tensor>& key_weights,
                               const std::optional<at::Tensor>& chunk_origin) {
  const char* op = "headscope::region_pool_qk";
  check_region_pool_qk_args(q, k_in, query_weights, region_ids, num_regions, scale,
                            key_padding_mask, reduce, window, chunk, block_ids, softcap,
                            key_weights, chunk_origin);
  const bool mean = parse_reduce(op, reduce);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto acc_type = accum_dtype(q.scalar_type());
  // key factors and span weights in the accumulation dtype (float or double)
  at::Tensor kw_values, wn;
  KeyFactors<float> kw_float;
  KeyFactors<double> kw_double;
  if (acc_type == at::kDouble) {
    kw_double = key_factors<double>(key_weights, q.size(1), kw_values);
    wn = checked_normalised_weights<double>(op, query_weights, region_ids, num_regions,
                                            kw_double, kw_values);
  } else {
    kw_float = key_factors<float>(key_weights, q.size(1), kw_values);
    wn = checked_normalised_weights<float>(op, query_weights, region_ids, num_regions, kw_float,
                                           kw_values);
  }
  QKParams p{};
  p.B = q.size(0);
  p.H = q.size(1);
  p.Tq = q.size(2);
  p.D = q.size(3);
  p.Hkv = k_in.size(1);
  p.Tk = k_in.size(2);
  p.K = num_regions;
  p.G = p.H / p.Hkv;
  p.scale = scale_or_default(scale, q.size(3));
  p.causal = causal;
  p.pat.row0 = AttentionPattern{causal, window.value_or(0), chunk.value_or(0), 0, nullptr, 1,
                                window_bounds_blocks};
  if (block_ids.has_value() && block_ids->defined()) {
    p.pat.row0.blocks = block_ids->const_data_ptr<int64_t>();
    p.pat.row0.bstride = block_ids->stride(1);
    p.pat.bstride0 = block_ids->stride(0);
  }
  p.pat.softcap = softcap.value_or(0.0);
  auto out = at::zeros({p.B, p.K, p.H}, q.options().dtype(acc_type));
  if (out.numel() == 0 || p.Tk == 0) return out;
  at::Tensor k = k_in;
  if (k.stride(3) != 1) k = k.contiguous();
  // (n_active, 2) rows (b, q) with a nonzero weight, sorted. A decode step (Tq = 1) has
  // every row active (each batch row's weight sum is positive): row b is (b, 0), no tensor
  // and no second host sync.
  at::Tensor active;
  if (p.Tq == 1) {
    p.n_active = p.B;
  } else {
    active = at::nonzero(query_weights).contiguous();
    p.n_active = active.size(0);
  }
  if (p.n_active == 0) return out;
  p.qs0 = q.stride(0);
  p.qs1 = q.stride(1);
  p.qs2 = q.stride(2);
  p.qs3 = q.stride(3);
  p.ks0 = k.stride(0);
  p.ks1 = k.stride(1);
  p.ks2 = k.stride(2);
  p.r0 = region_ids.stride(0);
  p.r1 = region_ids.stride(1);
  const bool* pad = nullptr;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    pad = key_padding_mask->const_data_ptr<bool>();
    p.p0 = key_padding_mask->stride(0);
    p.p1 = key_padding_mask->stride(1);
  }
  // where each row's chunks start (on the device: no host sync)
  const at::Tensor origin =
      p.pat.row0.chunk > 0 ? chunk_origins(chunk_origin, key_padding_mask) : at::Tensor();
  if (origin.defined()) p.pat.origin = origin.const_data_ptr<int64_t>();
  // Split the keys so that there are about two blocks per SM (decode: few rows).
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int64_t rows = p.n_active * p.H;
  const int64_t max_split = (p.Tk + kTile - 1) / kTile;
  const int64_t want = std::max<int64_t>(1, (2 * props->multiProcessorCount + rows - 1) / rows);
  int64_t nsplit = std::min(max_split, want);
  p.chunk = ((p.Tk + nsplit - 1) / nsplit + kTile - 1) / kTile * kTile;
  p.nsplit = (p.Tk + p.chunk - 1) / p.chunk;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(),
                                  "headscope_region_pool_qk_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto part_m = at::empty({rows * p.nsplit}, out.options());
    auto part_z = at::empty({rows * p.nsplit}, out.options());
    auto part_acc = at::empty({rows * p.nsplit, p.K}, out.options());
    auto split_kernel = qk_split_kernel<scalar_t, acc_t>;
    const size_t smem = (p.D + kTile + p.K + 32) * sizeof(acc_t);
    TORCH_CHECK(try_enable_smem(reinterpret_cast<const void*>(split_kernel), smem), op,
                ": argument 'num_regions' (", p.K, ") with head dimension ", p.D,
                " needs more shared memory per block (", smem, " bytes) than this GPU has");
    const unsigned blocks_a = static_cast<unsigned>(rows * p.nsplit);
    split_kernel<<<blocks_a, kThreads, smem, stream>>>(
        p, select_factors(kw_float, kw_double, acc_t(0)), q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
        active.defined() ? active.const_data_ptr<int64_t>() : nullptr,
        region_ids.const_data_ptr<int64_t>(), pad,
        part_m.mutable_data_ptr<acc_t>(), part_z.mutable_data_ptr<acc_t>(),
        part_acc.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto cnt = at::empty({mean ? p.B * p.H * p.K : 1}, out.options().dtype(at::kInt));
    const unsigned blocks_b = static_cast<unsigned>(p.B * p.H);
    auto combine_kernel = qk_combine_kernel<acc_t>;
    combine_kernel<<<blocks_b, kThreads, 0, stream>>>(
        p, active.defined() ? active.const_data_ptr<int64_t>() : nullptr, wn.const_data_ptr<acc_t>(),
        region_ids.const_data_ptr<int64_t>(), part_m.const_data_ptr<acc_t>(),
        part_z.const_data_ptr<acc_t>(), part_acc.const_data_ptr<acc_t>(), mean,
        cnt.mutable_data_ptr<int>(), out.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CUDA, m) {
  m.impl("region_pool", HEADSCOPE_KERNEL("region_pool", region_pool_cuda));
  m.impl("region_pool_qk", HEADSCOPE_KERNEL("region_pool_qk", region_pool_qk_cuda));
}

}  // namespace headscope::attribution::cuda
