// CPU kernels of region_pool (from attention probabilities) and region_pool_qk (from q
// and k, streaming: flash-attention style tiles of keys with an online softmax), with
// region_pool_qk_layers: every layer's region_pool_qk in one call.
#include "attribution/attribution_checks.h"
#include "attribution/cpu/region_pool_common_cpu.h"
#include "common/attention_pattern_host.h"
#include "common/checks.h"
#include "common/cpu_simd.h"
#include "common/kernel.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace headscope::attribution::cpu {
namespace {

// out[b, k, h] = acc / (count[b, k] if mean) for one (b, h) column.
template <typename acc_t, typename out_t>
void write_column(out_t* out, const acc_t* acc, int64_t b, int64_t h, int64_t H, int64_t K,
                  const RegionLists& regions, bool mean) {
  for (int64_t k = 0; k < K; ++k) {
    acc_t v = acc[k];
    if (mean) {
      const int64_t c = regions.count[b * K + k];
      v = c > 0 ? v / static_cast<acc_t>(c) : acc_t(0);
    }
    out[(b * K + k) * H + h] = static_cast<out_t>(v);
  }
}

at::Tensor region_pool_cpu(const at::Tensor& attn, const at::Tensor& query_weights,
                           const at::Tensor& region_ids, int64_t num_regions,
                           c10::string_view reduce,
                           const std::optional<at::Tensor>& key_weights) {
  const char* op = "headscope::region_pool";
  check_region_pool_args(attn, query_weights, region_ids, num_regions, reduce, key_weights);
  const bool mean = parse_reduce(op, reduce);
  const int64_t B = attn.size(0), H = attn.size(1), K = num_regions;
  const RegionLists regions = build_region_lists(op, region_ids, K);
  const SpanWeights span = build_span_weights(op, query_weights);
  auto out = at::empty({B, K, H}, attn.options().dtype(accum_dtype(attn.scalar_type())));
  if (out.numel() == 0) return out;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, attn.scalar_type(),
                                  "headscope_region_pool_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* a = attn.const_data_ptr<scalar_t>();
    const int64_t s0 = attn.stride(0), s1 = attn.stride(1), s2 = attn.stride(2),
                  s3 = attn.stride(3);
    acc_t* o = out.mutable_data_ptr<acc_t>();
    const auto kw = read_key_weights<acc_t>(op, "key_weights", key_weights, H, regions);
    // Work of one (b, h): the image tokens times the span's queries; threads only pay off
    // for a few tens of thousands of multiply-adds each.
    int64_t work = 1;
    for (int64_t b = 0; b < B; ++b)
      work = std::max<int64_t>(work, static_cast<int64_t>(regions.pos[b].size()) *
                                         static_cast<int64_t>(span.active[b].size()));
    const int64_t grain = std::max<int64_t>(1, 32768 / work);
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(K), key_factor;
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        std::fill(acc.begin(), acc.end(), acc_t(0));
        const auto& pos = regions.pos[b];
        const auto& reg = regions.reg[b];
        const int64_t n = static_cast<int64_t>(pos.size());
        if (kw.given) {  // the image tokens' factors, gathered once per (b, h)
          const acc_t* kr = kw.row(b, h);
          key_factor.resize(n);
          for (int64_t i = 0; i < n; ++i) key_factor[i] = kr[pos[i] * kw.s2];
        }
        for (size_t qi = 0; qi < span.active[b].size(); ++qi) {
          const acc_t w = static_cast<acc_t>(span.weight[b][qi]);
          const scalar_t* row = a + b * s0 + h * s1 + span.active[b][qi] * s2;
          if (kw.given) {
            for (int64_t i = 0; i < n; ++i)
              acc[reg[i]] += w * static_cast<acc_t>(row[pos[i] * s3]) * key_factor[i];
          } else if (s3 == 1) {
            for (int64_t i = 0; i < n; ++i) acc[reg[i]] += w * static_cast<acc_t>(row[pos[i]]);
          } else {
            for (int64_t i = 0; i < n; ++i)
              acc[reg[i]] += w * static_cast<acc_t>(row[pos[i] * s3]);
          }
        }
        write_column(o, acc.data(), b, h, H, K, regions, mean);
      }
    });
  });
  return out;
}

// S (R x n, row-major, leading dim ldc) = Q (R x D, ld D) . Ktile (n x D, ld ldk)^T.
// Register-blocked: four keys at a time (kept in L1) against every row, eight partial
// sums per dot product, written as plain loops that GCC/Clang vectorise (AVX2/AVX-512
// with -march=native). No BLAS call: a BLAS would start its own threads inside
// at::parallel_for (oversubscription), and this is memory-bound on K anyway. Nor
// common/cpu_gemm.h's gemm_nn (the vas qk tiles' product): it takes K transposed, one more
// pass over keys this op streams from memory once (a decode step took 1.5x as long).
// readable: keys that may be read from Kt (>= n; past the tile: the next tiles, prefetched).
template <typename T>
void scores_tile(const T* Q, const T* Kt, int64_t ldk, T* S, int64_t R, int64_t n, int64_t D,
                 int64_t ldc, int64_t readable) {
  using V = Vec<T>;
  constexpr int W = kLanes<T>;
  constexpr int64_t kAhead = 32;  // keys prefetched ahead: K streams from memory
  const int64_t DV = D / W * W;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const T* b0 = Kt + t * ldk;
    const T* b1 = b0 + ldk;
    const T* b2 = b1 + ldk;
    const T* b3 = b2 + ldk;
    if (t + kAhead + 4 <= readable)
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t d = 0; d < D; d += 64 / static_cast<int64_t>(sizeof(T)))
          __builtin_prefetch(b0 + (kAhead + i) * ldk + d, 0, 3);
    for (int64_t r = 0; r < R; ++r) {
      const T* a = Q + r * D;
      V c0 = {}, c1 = {}, c2 = {}, c3 = {};
      for (int64_t d = 0; d < DV; d += W) {
        const V x = vload(a + d);
        c0 += x * vload(b0 + d);
        c1 += x * vload(b1 + d);
        c2 += x * vload(b2 + d);
        c3 += x * vload(b3 + d);
      }
      T sums[4];
      hsum4<T>(c0, c1, c2, c3, sums);
      T s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3];
      for (int64_t d = DV; d < D; ++d) {
        s0 += a[d] * b0[d];
        s1 += a[d] * b1[d];
        s2 += a[d] * b2[d];
        s3 += a[d] * b3[d];
      }
      T* srow = S + r * ldc + t;
      srow[0] = s0;
      srow[1] = s1;
      srow[2] = s2;
      srow[3] = s3;
    }
  }
  for (; t < n; ++t) {
    const T* b0 = Kt + t * ldk;
    for (int64_t r = 0; r < R; ++r) {
      const T* a = Q + r * D;
      V c0 = {};
      for (int64_t d = 0; d < DV; d += W) c0 += vload(a + d) * vload(b0 + d);
      T s0 = hsum(c0);
      for (int64_t d = DV; d < D; ++d) s0 += a[d] * b0[d];
      S[r * ldc + t] = s0;
    }
  }
}

// region_pool_qk of layers l = 0..L-1 (q[l], k[l], scales[l], windows[l], chunks[l]; every
// layer of q[0]'s and k[0]'s sizes) into out[b, k, l * H + h], in one pass over every
// layer's work items. key_weights: empty, or layer l's (named key_weights_names[l]);
// chunk_origin: where each row's chunks start (pattern_rows).
at::Tensor pool_qk_layers(const char* op, at::TensorList q, at::TensorList k_in,
                          const at::Tensor& query_weights, const at::Tensor& region_ids,
                          int64_t num_regions, const std::vector<double>& scales, bool causal,
                          const std::optional<at::Tensor>& key_padding_mask, bool mean,
                          const std::vector<int64_t>& windows, const std::vector<int64_t>& chunks,
                          const std::optional<at::Tensor>& block_ids,
                          std::optional<double> softcap, bool window_bounds_blocks,
                          const std::vector<std::optional<at::Tensor>>& key_weights,
                          const std::vector<std::string>& key_weights_names,
                          const std::optional<at::Tensor>& chunk_origin) {
  const int64_t L = static_cast<int64_t>(q.size());
  const int64_t B = q[0].size(0), H = q[0].size(1), Tq = q[0].size(2), D = q[0].size(3);
  const int64_t Hkv = k_in[0].size(1), Tk = k_in[0].size(2), K = num_regions, G = H / Hkv;
  const int64_t LH = L * H;
  const RegionLists regions = build_region_lists(op, region_ids, K);
  const SpanWeights span = build_span_weights(op, query_weights);
  const auto out_options = q[0].options().dtype(accum_dtype(q[0].scalar_type()));
  if (B * K * LH == 0 || Tk == 0) return at::zeros({B, K, LH}, out_options);  // no key: 0
  // Keys must be contiguous along D (any stride between keys is fine: cache views).
  std::vector<at::Tensor> k(k_in.begin(), k_in.end());
  std::vector<int64_t> ldk(L);
  for (int64_t l = 0; l < L; ++l) {
    if (k[l].stride(3) != 1 || (Tk > 1 && k[l].stride(2) < D)) k[l] = k[l].contiguous();
    ldk[l] = Tk > 1 ? k[l].stride(2) : std::max<int64_t>(D, 1);
  }
  const bool* pad = nullptr;
  int64_t pad_s0 = 0, pad_s1 = 0;
  at::Tensor pad_t;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    pad_t = *key_padding_mask;
    pad = pad_t.const_data_ptr<bool>();
    pad_s0 = pad_t.stride(0);
    pad_s1 = pad_t.stride(1);
  }
  // Each layer's pattern per batch row (windows and chunks may differ between layers).
  const PatternRows pat =
      pattern_rows(B, Tk, causal, 0, 0, block_ids, key_padding_mask, softcap,
                   window_bounds_blocks, chunk_origin);
  std::vector<AttentionPattern> layer_pat(L * B);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t b = 0; b < B; ++b) {
      layer_pat[l * B + b] = pat.row[b];
      layer_pat[l * B + b].window = windows[l];
      layer_pat[l * B + b].chunk = chunks[l];
    }

  // Work items: (layer, b, kv head, block of QB active queries); the G query heads of a kv
  // head share each K tile, so K is read once per item and never copied or repeated. Row
  // r = j * G + g of an item is query j's head g, so that the queries a key tile concerns
  // (its key range [lo_j, hi_j] meets the tile) are one run of rows: with a window or
  // chunks, a tile costs only the queries that see it.
  const int64_t QB = std::max<int64_t>(1, 64 / G);
  int64_t max_active = 0;
  for (const auto& a : span.active) max_active = std::max<int64_t>(max_active, a.size());
  const int64_t NQB = (max_active + QB - 1) / QB;
  const int64_t per_layer = B * Hkv * NQB;
  const int64_t items = L * per_layer;
  if (items == 0) return at::zeros({B, K, LH}, out_options);
  auto out = at::empty({B, K, LH}, out_options);  // every entry written below
  constexpr int64_t TT = 256;  // keys per tile

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q[0].scalar_type(),
                                  "headscope_region_pool_qk_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    constexpr bool direct = std::is_same_v<scalar_t, acc_t>;
    // partial[item][g][qi][k] would be large for long prefill spans; instead each item
    // reduces its queries into part[item][g][k] (already weighted) and a serial pass adds
    // the items of one (layer, b, kv head) in a fixed order (deterministic).
    std::vector<acc_t> part(items * G * K, acc_t(0));  // not an ATen op: a cold call's cost
    acc_t* part_p = part.data();
    std::vector<KeyWeights<acc_t>> kw(L);
    for (size_t l = 0; l < key_weights.size(); ++l)
      kw[l] = read_key_weights<acc_t>(op, key_weights_names[l].c_str(), key_weights[l], H,
                                      regions);

    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> Qb, S, Kbuf, acc, m, z;
      std::vector<int64_t> klo, khi, kqb, tile_pos, tile_reg;
      for (int64_t it = begin; it < end; ++it) {
        const int64_t l = it / per_layer, rest = it % per_layer;
        const int64_t b = rest / (Hkv * NQB), hk = (rest / NQB) % Hkv, qb = rest % NQB;
        const auto& act = span.active[b];
        const int64_t q0 = qb * QB;
        if (q0 >= static_cast<int64_t>(act.size())) continue;
        const int64_t nq = std::min<int64_t>(QB, act.size() - q0);
        const int64_t R = G * nq;  // row r = j * G + g
        const AttentionPattern& ap = layer_pat[l * B + b];
        const at::Tensor& ql = q[l];
        const scalar_t* qp = ql.const_data_ptr<scalar_t>();
        const int64_t qs0 = ql.stride(0), qs1 = ql.stride(1), qs2 = ql.stride(2),
                      qs3 = ql.stride(3);
        const acc_t sc = static_cast<acc_t>(scales[l]);
        Qb.assign(R * D, acc_t(0));
        klo.assign(nq, 0);
        khi.assign(nq, -1);
        kqb.assign(nq, -1);
        int64_t min_lo = Tk, max_hi = -1;  // the keys any of the item's queries sees
        for (int64_t j = 0; j < nq; ++j) {
          const int64_t qi = act[q0 + j];
          for (int64_t g = 0; g < G; ++g) {
            const scalar_t* src = qp + b * qs0 + (hk * G + g) * qs1 + qi * qs2;
            acc_t* dst = Qb.data() + (j * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<acc_t>(src[d * qs3]) * sc;
          }
          // the query's keys, queries aligned with the last Tq keys (bottom-right)
          pat.keys(ap, b, qi + Tk - Tq, klo[j], khi[j], kqb[j]);
          klo[j] = std::max<int64_t>(klo[j], 0);
          if (klo[j] <= khi[j]) {
            min_lo = std::min(min_lo, klo[j]);
            max_hi = std::max(max_hi, khi[j]);
          }
        }
        S.resize(R * TT);
        acc.assign(R * K, acc_t(0));
        m.assign(R, -INFINITY);
        z.assign(R, acc_t(0));
        if (!direct) Kbuf.resize(TT * std::max<int64_t>(D, 1));
        const scalar_t* kbase =
            k[l].const_data_ptr<scalar_t>() + b * k[l].stride(0) + hk * k[l].stride(1);
        for (int64_t t0 = min_lo / TT * TT; t0 <= max_hi; t0 += TT) {
          const int64_t T = std::min<int64_t>(TT, max_hi + 1 - t0);
          int64_t jmin = nq, jmax = -1;  // the queries that see a key of this tile
          for (int64_t j = 0; j < nq; ++j)
            if (klo[j] <= khi[j] && klo[j] < t0 + T && khi[j] >= t0) {
              jmin = std::min(jmin, j);
              jmax = j;
            }
          if (jmax < 0) continue;
          const acc_t* Kt;
          int64_t ld, readable = T;
          if constexpr (direct) {
            Kt = reinterpret_cast<const acc_t*>(kbase + t0 * ldk[l]);
            ld = ldk[l];
            readable = max_hi + 1 - t0;
          } else {
            for (int64_t t = 0; t < T; ++t)
              for (int64_t d = 0; d < D; ++d)
                Kbuf[t * D + d] = static_cast<acc_t>(kbase[(t0 + t) * ldk[l] + d]);
            Kt = Kbuf.data();
            ld = std::max<int64_t>(D, 1);
          }
          scores_tile(Qb.data() + jmin * G * D, Kt, ld, S.data() + jmin * G * TT,
                      (jmax + 1 - jmin) * G, T, D, TT, readable);
          // Image tokens of this tile (shared by all rows).
          tile_pos.clear();
          tile_reg.clear();
          {
            const auto& pos = regions.pos[b];
            auto lo = std::lower_bound(pos.begin(), pos.end(), t0);
            auto hi = std::lower_bound(lo, pos.end(), t0 + T);
            for (auto p = lo; p != hi; ++p) {
              tile_pos.push_back(*p - t0);
              tile_reg.push_back(regions.reg[b][p - pos.begin()]);
            }
          }
          for (int64_t r = jmin * G; r < (jmax + 1) * G; ++r) {
            const int64_t j = r / G;
            // the row's keys in this tile: [c0, c0 + n)
            const int64_t c0 = std::max<int64_t>(0, klo[j] - t0);
            const int64_t n = std::min<int64_t>(T, khi[j] + 1 - t0) - c0;
            if (n <= 0) continue;
            acc_t* s = S.data() + r * TT + c0;
            pat.apply(ap, s, act[q0 + j] + Tk - Tq, kqb[j], t0 + c0, n);
            if (pad != nullptr)
              for (int64_t t = 0; t < n; ++t)
                if (pad[b * pad_s0 + (t0 + c0 + t) * pad_s1]) s[t] = -INFINITY;
            const acc_t tmax = max_of(s, n);
            if (tmax == -INFINITY) {  // every key of the tile masked, or NaN logits
              for (int64_t t = 0; t < n; ++t)
                if (s[t] != s[t]) z[r] = NAN;
              continue;
            }
            acc_t* ar = acc.data() + r * K;
            if (tmax > m[r]) {
              const acc_t f = m[r] == -INFINITY ? acc_t(0) : std::exp(m[r] - tmax);
              z[r] *= f;
              for (int64_t kk = 0; kk < K; ++kk) ar[kk] *= f;
              m[r] = tmax;
            }
            z[r] += exp_shift_sum(s, n, m[r]);
            if (kw[l].given) {
              const acc_t* kr = kw[l].row(b, hk * G + r % G) + t0 * kw[l].s2;
              for (size_t i = 0; i < tile_pos.size(); ++i) {
                if (tile_pos[i] < c0) continue;
                if (tile_pos[i] >= c0 + n) break;
                ar[tile_reg[i]] += s[tile_pos[i] - c0] * kr[tile_pos[i] * kw[l].s2];
              }
            } else {
              for (size_t i = 0; i < tile_pos.size(); ++i) {
                if (tile_pos[i] < c0) continue;
                if (tile_pos[i] >= c0 + n) break;
                ar[tile_reg[i]] += s[tile_pos[i] - c0];
              }
            }
          }
        }
        // Weighted sum over the item's queries; rows without a visible key add nothing,
        // rows with NaN or infinite logits (z NaN) make their features NaN.
        acc_t* pp = part_p + it * G * K;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t j = 0; j < nq; ++j) {
            const int64_t r = j * G + g;
            if (z[r] != z[r] && span.weight[b][q0 + j] > 0) {
              for (int64_t kk = 0; kk < K; ++kk) pp[g * K + kk] = NAN;
              continue;
            }
            if (!(z[r] > 0)) continue;
            const acc_t w = static_cast<acc_t>(span.weight[b][q0 + j]) / z[r];
            for (int64_t kk = 0; kk < K; ++kk) pp[g * K + kk] += w * acc[r * K + kk];
          }
      }
    });

    acc_t* o = out.mutable_data_ptr<acc_t>();
    for (int64_t l = 0; l < L; ++l)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t hk = 0; hk < Hkv; ++hk)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            for (int64_t kk = 0; kk < K; ++kk) {
              acc_t v = 0;
              for (int64_t qb = 0; qb < NQB; ++qb)
                v += part_p[(((l * B + b) * Hkv + hk) * NQB + qb) * G * K + g * K + kk];
              if (mean) {
                const int64_t c = regions.count[b * K + kk];
                v = c > 0 ? v / static_cast<acc_t>(c) : acc_t(0);
              }
              o[(b * K + kk) * LH + l * H + h] = v;
            }
          }
  });
  return out;
}

at::Tensor region_pool_qk_cpu(const at::Tensor& q, const at::Tensor& k,
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
  check_region_pool_qk_args(q, k, query_weights, region_ids, num_regions, scale,
                            key_padding_mask, reduce, window, chunk, block_ids, softcap,
                            key_weights, chunk_origin);
  return pool_qk_layers(op, {q}, {k}, query_weights, region_ids, num_regions,
                        {scale_or_default(scale, q.size(3))}, causal, key_padding_mask,
                        parse_reduce(op, reduce), {window.value_or(0)}, {chunk.value_or(0)},
                        block_ids, softcap, window_bounds_blocks, {key_weights},
                        {"key_weights"}, chunk_origin);
}

at::Tensor region_pool_qk_layers_cpu(at::TensorList q, at::TensorList k,
                                     const at::Tensor& query_weights,
                                     const at::Tensor& region_ids, int64_t num_regions,
                                     std::optional<at::ArrayRef<double>> scale, bool causal,
                                     const std::optional<at::Tensor>& key_padding_mask,
                                     c10::string_view reduce, at::OptionalIntArrayRef window,
                                     at::OptionalIntArrayRef chunk,
                                     const std::optional<at::Tensor>& block_ids,
                                     std::optional<double> softcap, bool window_bounds_blocks,
                                     std::optional<at::TensorList> key_weights,
                                     const std::optional<at::Tensor>& chunk_origin) {
  const char* op = "headscope::region_pool_qk_layers";
  check_region_pool_qk_layers_args(q, k, query_weights, region_ids, num_regions, scale,
                                   key_padding_mask, reduce, window, chunk, block_ids, softcap,
                                   key_weights, chunk_origin);
  std::vector<double> scales(q.size(), scale_or_default(std::nullopt, q[0].size(3)));
  if (scale.has_value()) scales.assign(scale->begin(), scale->end());
  std::vector<int64_t> windows(q.size()), chunks(q.size());
  for (size_t l = 0; l < q.size(); ++l) {
    windows[l] = layer_length(window, l);
    chunks[l] = layer_length(chunk, l);
  }
  std::vector<std::optional<at::Tensor>> layer_weights;
  std::vector<std::string> names;
  if (key_weights.has_value())
    for (size_t l = 0; l < q.size(); ++l) {
      layer_weights.emplace_back((*key_weights)[l]);
      names.push_back("key_weights[" + std::to_string(l) + "]");
    }
  return pool_qk_layers(op, q, k, query_weights, region_ids, num_regions, scales, causal,
                        key_padding_mask, parse_reduce(op, reduce), windows, chunks, block_ids,
                        softcap, window_bounds_blocks, layer_weights, names, chunk_origin);
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("region_pool", HEADSCOPE_KERNEL("region_pool", region_pool_cpu));
  m.impl("region_pool_qk", HEADSCOPE_KERNEL("region_pool_qk", region_pool_qk_cpu));
  m.impl("region_pool_qk_layers",
         HEADSCOPE_KERNEL("region_pool_qk_layers", region_pool_qk_layers_cpu));
}

}  // namespace headscope::attribution::cpu
