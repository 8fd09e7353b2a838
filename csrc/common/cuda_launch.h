// Host-side launch helpers shared by the CUDA kernels of every family.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace headscope::cuda_launch {

// Lets `kernel` take `bytes` of dynamic shared memory per block (above the default 48 KiB
// this needs an opt-in); false when the current device cannot give that much.
inline bool try_enable_smem(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return true;
  int dev = 0, max_optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (bytes > static_cast<size_t>(max_optin)) return false;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  return true;
}

}  // namespace headscope::cuda_launch
