// What the CUDA kernels of vas_head_stats and vas_head_stats_qk share: their sizes and the
// per-call state every kernel reads and writes (Heads), set up by vas_head_stats_cuda.cu.
#pragma once

#include "common/cuda_reduce.cuh"
#include "vas/cuda/vas_head_stats_tile_mma_cuda.cuh"
#include "vas/vas_math.h"

#include <ATen/core/Tensor.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

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

}  // namespace
}  // namespace headscope::vas::cuda
