// Warp and block reductions shared by the CUDA kernels of every family.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace headscope::cuda_reduce {

struct Plus {
  template <typename T>
  __device__ __forceinline__ T operator()(T acc, T other) const { return acc + other; }
};
struct Max {  // keeps acc where other is NaN or not larger
  template <typename T>
  __device__ __forceinline__ T operator()(T acc, T other) const { return other > acc ? other : acc; }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reduction; every thread gets the result. `scratch` holds >= 32 values and is
// reused after the call returns (a trailing __syncthreads protects it).
template <typename T, typename Op>
__device__ T block_reduce(T v, T* scratch, Op op, T identity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = warp_reduce(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < warps ? scratch[lane] : identity;
  r = warp_reduce(r, op);
  __syncthreads();
  return r;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) { return warp_reduce(v, Plus{}); }
template <typename T>
__device__ T block_sum(T v, T* scratch) { return block_reduce(v, scratch, Plus{}, T(0)); }
template <typename T>
__device__ T block_max(T v, T* scratch) { return block_reduce(v, scratch, Max{}, T(-INFINITY)); }

}  // namespace headscope::cuda_reduce
