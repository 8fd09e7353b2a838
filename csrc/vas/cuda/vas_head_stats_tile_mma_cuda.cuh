// Warp-level tensor-core tile products for the vas CUDA kernels (sm_80 and newer).
//
// A block of 4 warps computes one 64 x 64 tile C = X Y^T from row-major 64-row panels of X
// and Y in shared memory; warp (wm, wn) owns rows 32 wm .. +32 and columns 32 wn .. +32,
// as 2 x 4 fragments of 16 x 8. Fragment element e (0..31) of a thread sits at
//   row 32 wm + 16 mi + gq + 8 (q >> 1), column 32 wn + 8 ni + 2 tq + (q & 1),
// with e = (mi * 4 + ni) * 4 + q, gq = lane / 4, tq = lane % 4 (the mma.sync C layout).
//
// Two float32-accurate products:
//   * split float16: x = hi + lo / 2048 with hi, lo float16 (22 significant bits); three
//     m16n8k16 products (hi hi, hi lo, lo hi), the cross terms in their own accumulator;
//   * 3xTF32: x = hi + lo with hi, lo TF32; three m16n8k8 products into one accumulator.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "headscope's vas CUDA kernels need sm_80 or newer (mma.sync m16n8k16, cp.async)"
#endif

namespace headscope::vas::cuda::mma {

constexpr int kTile = 64;
constexpr int kThreads = 128;
constexpr int kFrag = 32;              // fragment elements per thread
constexpr float kLoScale = 2048.0f;    // lo parts of the float16 split are stored times 2^11

struct Lane {
  int wm, wn, gq, tq;
  __device__ Lane() {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    wm = warp >> 1;
    wn = warp & 1;
    gq = lane >> 2;
    tq = lane & 3;
  }
  __device__ int row(int e) const { return 32 * wm + 16 * (e >> 4) + gq + 8 * ((e & 3) >> 1); }
  __device__ int col(int e) const { return 32 * wn + 8 * ((e >> 2) & 3) + 2 * tq + (e & 1); }
  // A thread's elements cover 4 rows (row slot 2 mi + (q >> 1)) and 8 columns (column slot
  // 2 ni + (q & 1)): the slot of element e, and the tile row / column of a slot.
  __device__ static int row_slot(int e) { return (e >> 4) * 2 + ((e & 3) >> 1); }
  __device__ static int col_slot(int e) { return ((e >> 2) & 3) * 2 + (e & 1); }
  __device__ int slot_row(int r) const { return row((r >> 1) * 16 + (r & 1) * 2); }
  __device__ int slot_col(int c) const { return col((c >> 1) * 4 + (c & 1)); }
};

__device__ inline void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ inline void mma_f16(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline void mma_tf32(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline uint32_t tf32_bits(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// Split float16 panels: hi and lo parts of X and Y, kw columns (a multiple of 16) from
// column 0, row stride ld halves. acc_hh += Xhi Yhi^T, acc_x += Xhi Ylo^T + Xlo Yhi^T.
__device__ inline void gemm_f16_split(float* acc_hh, float* acc_x, const __half* xhi,
                                      const __half* xlo, const __half* yhi, const __half* ylo,
                                      int ld, int kw, const Lane& L) {
  auto word = [ld](const __half* p, int r, int c) {
    return *reinterpret_cast<const uint32_t*>(p + r * ld + c);
  };
  for (int k0 = 0; k0 < kw; k0 += 16) {
    uint32_t ah[2][4], al[2][4], bh[4][2], bl[4][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int r = 32 * L.wm + 16 * mi + L.gq, c = k0 + 2 * L.tq;
      ah[mi][0] = word(xhi, r, c);
      ah[mi][1] = word(xhi, r + 8, c);
      ah[mi][2] = word(xhi, r, c + 8);
      ah[mi][3] = word(xhi, r + 8, c + 8);
      al[mi][0] = word(xlo, r, c);
      al[mi][1] = word(xlo, r + 8, c);
      al[mi][2] = word(xlo, r, c + 8);
      al[mi][3] = word(xlo, r + 8, c + 8);
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int r = 32 * L.wn + 8 * ni + L.gq, c = k0 + 2 * L.tq;
      bh[ni][0] = word(yhi, r, c);
      bh[ni][1] = word(yhi, r, c + 8);
      bl[ni][0] = word(ylo, r, c);
      bl[ni][1] = word(ylo, r, c + 8);
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        float* x = acc_x + (mi * 4 + ni) * 4;
        mma_f16(x, al[mi], bh[ni]);
        mma_f16(x, ah[mi], bl[ni]);
        mma_f16(acc_hh + (mi * 4 + ni) * 4, ah[mi], bh[ni]);
      }
  }
}

// 3xTF32 on float panels X, Y (kw columns, a multiple of 8; row stride ld floats):
// acc += X Y^T to about float32 accuracy.
__device__ inline void gemm_3xtf32(float* acc, const float* x, const float* y, int ld, int kw,
                                   const Lane& L) {
  for (int k0 = 0; k0 < kw; k0 += 8) {
    uint32_t ah[2][4], al[2][4], bh[4][2], bl[4][2];
    auto split = [](float v, uint32_t& hi, uint32_t& lo) {
      hi = tf32_bits(v);
      lo = tf32_bits(v - __uint_as_float(hi));
    };
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int r = 32 * L.wm + 16 * mi + L.gq, c = k0 + L.tq;
      split(x[r * ld + c], ah[mi][0], al[mi][0]);
      split(x[(r + 8) * ld + c], ah[mi][1], al[mi][1]);
      split(x[r * ld + c + 4], ah[mi][2], al[mi][2]);
      split(x[(r + 8) * ld + c + 4], ah[mi][3], al[mi][3]);
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int r = 32 * L.wn + 8 * ni + L.gq, c = k0 + L.tq;
      split(y[r * ld + c], bh[ni][0], bl[ni][0]);
      split(y[r * ld + c + 4], bh[ni][1], bl[ni][1]);
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        float* d = acc + (mi * 4 + ni) * 4;
        mma_tf32(d, al[mi], bh[ni]);
        mma_tf32(d, ah[mi], bl[ni]);
        mma_tf32(d, ah[mi], bh[ni]);
      }
  }
}

}  // namespace headscope::vas::cuda::mma
