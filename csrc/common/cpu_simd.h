// The one vector type of the CPU kernels and its helpers: 32 bytes of T (8 floats, 4
// doubles, 8 int32) as a GCC/Clang vector extension, which is one AVX register with
// -march=native and two SSE halves otherwise, so the same code builds for any x86-64 (or
// other) target. Loads and stores go through memcpy: no alignment or aliasing rules, and
// the compiler emits plain vector moves.
#pragma once

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace headscope {

template <typename T>
struct VecOf {
  typedef T type __attribute__((vector_size(32)));
};
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int kLanes = 32 / static_cast<int>(sizeof(T));

using f8 = Vec<float>;
using d4 = Vec<double>;
using i8 = Vec<int32_t>;

template <typename T>
inline Vec<T> vload(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
inline void vstore(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof v);
}

// The widest vector of doubles the target has: 8 lanes (one register) where AVX-512 is
// enabled (-march=native on such a host), else 4 (one AVX register, or two SSE halves on a
// portable build). For loops whose lanes are independent rows (the mixer's panels); the
// rest keep the 32-byte Vec, whose 8-float layout their shuffles assume.
#if defined(__AVX512F__)
inline constexpr int kWideBytes = 64;
#else
inline constexpr int kWideBytes = 32;
#endif
typedef double dw __attribute__((vector_size(kWideBytes)));
typedef int64_t iw __attribute__((vector_size(kWideBytes)));  // dw's comparison results
typedef double d8 __attribute__((vector_size(64)));  // 8 doubles: one AVX-512 register or two
inline constexpr int kWideLanes = kWideBytes / static_cast<int>(sizeof(double));

// Loads and stores of dw and d8 at any address, as one instruction each where the vector is
// one register: through a type that may alias anything and needs 8-byte alignment (as
// _mm512_loadu_pd is written). A 64-byte memcpy is emitted as two 32-byte moves, and a
// wide load of a vector stored in halves stalls on store forwarding.
typedef double dw_unaligned __attribute__((vector_size(kWideBytes), aligned(8), may_alias));
typedef double d8_unaligned __attribute__((vector_size(64), aligned(8), may_alias));

inline dw wload(const double* p) { return *reinterpret_cast<const dw_unaligned*>(p); }
inline void wstore(double* p, dw v) { *reinterpret_cast<dw_unaligned*>(p) = v; }
inline d8 load_d8(const double* p) { return *reinterpret_cast<const d8_unaligned*>(p); }
inline void store_d8(double* p, const d8& v) { *reinterpret_cast<d8_unaligned*>(p) = v; }

// [0, 1, 2, ...]: with a comparison, the mask of a partial vector's lanes.
inline dw wiota() {
  dw v;
  for (int k = 0; k < kWideLanes; ++k) v[k] = k;
  return v;
}

// Lane-wise max and min of dw, `a > b ? a : b` and `a < b ? a : b` (the second operand where
// one is NaN): vmaxpd / vminpd where dw is one register. A portable build's dw is two SSE
// registers, and GCC lowers a comparison of vectors wider than the target's lane by lane
// through memory: there, the SSE instructions on each half.
#if defined(__SSE2__) && !defined(__AVX__)
inline dw vmax(dw a, dw b) {
  __m128d x[2], y[2];
  std::memcpy(x, &a, sizeof x);
  std::memcpy(y, &b, sizeof y);
  x[0] = _mm_max_pd(x[0], y[0]);
  x[1] = _mm_max_pd(x[1], y[1]);
  std::memcpy(&a, x, sizeof a);
  return a;
}
inline dw vmin(dw a, dw b) {
  __m128d x[2], y[2];
  std::memcpy(x, &a, sizeof x);
  std::memcpy(y, &b, sizeof y);
  x[0] = _mm_min_pd(x[0], y[0]);
  x[1] = _mm_min_pd(x[1], y[1]);
  std::memcpy(&a, x, sizeof a);
  return a;
}
#else
inline dw vmax(dw a, dw b) { return a > b ? a : b; }
inline dw vmin(dw a, dw b) { return a < b ? a : b; }
#endif

// The lanes of x where mask is set (all ones), 0 elsewhere, and |x|: bit operations, which
// every target does on whole vectors.
inline dw keep_lanes(iw mask, dw x) {
  iw bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits &= mask;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline dw vabs(dw x) {
  iw bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits &= INT64_MAX;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// x in every lane.
template <typename T>
inline Vec<T> vsplat(T x) {
  if constexpr (kLanes<T> == 8) {
    return Vec<T>{x, x, x, x, x, x, x, x};
  } else {
    static_assert(kLanes<T> == 4, "vsplat: 32-byte vectors of 4 or 8 lanes");
    return Vec<T>{x, x, x, x};
  }
}

// Lanes [0, n) of p, the others 0 (n may exceed the lane count).
template <typename T>
inline Vec<T> vload_part(const T* p, int64_t n) {
  if (n >= kLanes<T>) return vload(p);
  Vec<T> v = {};
  for (int64_t k = 0; k < n; ++k) v[k] = p[k];
  return v;
}

// The sum of a vector's lanes in lane order, in its element type (any vector width).
template <typename V>
inline auto hsum(V v) {
  using T = std::remove_cv_t<std::remove_reference_t<decltype(v[0])>>;
  T r = 0;
  for (int k = 0; k < static_cast<int>(sizeof(V) / sizeof(T)); ++k) r += v[k];
  return r;
}

// The sum of 8 float lanes in lane order, in double: short float partial sums (a tile
// row's) turned into one number without a further float rounding.
inline double hsum_f64(f8 v) {
  double d = 0;
  for (int k = 0; k < 8; ++k) d += v[k];
  return d;
}

// Four vectors' lane sums at once, [sum c0, sum c1, sum c2, sum c3]: pairwise adds across
// the vectors instead of four scalar chains (floats); doubles lane by lane.
template <typename T>
inline void hsum4(Vec<T> c0, Vec<T> c1, Vec<T> c2, Vec<T> c3, T out[4]) {
  if constexpr (std::is_same_v<T, float>) {
    auto hadd = [](f8 x, f8 y) {
      return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
             __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
    };
    const f8 h = hadd(hadd(c0, c1), hadd(c2, c3));  // [c0..c3 low halves, c0..c3 high halves]
    for (int i = 0; i < 4; ++i) out[i] = h[i] + h[i + 4];
  } else {
    out[0] = hsum(c0);
    out[1] = hsum(c1);
    out[2] = hsum(c2);
    out[3] = hsum(c3);
  }
}

// The low and high four float lanes as doubles.
inline d4 widen_lo(f8 v) {
  return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), d4);
}
inline d4 widen_hi(f8 v) {
  return __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), d4);
}

// 1 in lanes [0, n), 0 in the others: masks the last partial vector of a row.
inline f8 lane_mask(int64_t n) {
  f8 m;
  for (int k = 0; k < 8; ++k) m[k] = k < n ? 1.0f : 0.0f;
  return m;
}

// Whether one of 8 floats is nonzero (or NaN).
inline bool any_nonzero(f8 v) {
  const auto nz = v != 0.0f;
#if defined(__AVX__)
  return _mm256_movemask_ps(reinterpret_cast<__m256>(nz)) != 0;
#else
  for (int k = 0; k < 8; ++k)
    if (nz[k]) return true;
  return false;
#endif
}

// Lane-wise max for operands that are never NaN (vmaxps where available: one instruction
// instead of a compare and a blend).
inline f8 vmax(f8 a, f8 b) {
#if defined(__AVX__)
  return __builtin_ia32_maxps256(a, b);
#else
  return a < b ? b : a;
#endif
}

// f(v, j) for each 8 floats v of x[0, n), j their first index (lanes past n are 0).
template <typename F>
inline void for_each8(const float* x, int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) f(vload(x + j), j);
  if (j < n) f(vload_part(x + j, n - j), j);
}

// Transposes 8 rows of 8 lanes in registers (f8, or 8 doubles): r[k][c] becomes r[c][k].
template <typename V8>
inline void transpose8x8(V8 r[8]) {
  static_assert(sizeof(V8) / sizeof(r[0][0]) == 8, "transpose8x8: vectors of 8 lanes");
  V8 t[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * k + 1] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  V8 u[8];
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 (h = 1)
    const V8 a = t[4 * h], b = t[4 * h + 1], c = t[4 * h + 2], d = t[4 * h + 3];
    u[4 * h + 0] = __builtin_shufflevector(a, c, 0, 1, 8, 9, 4, 5, 12, 13);
    u[4 * h + 1] = __builtin_shufflevector(a, c, 2, 3, 10, 11, 6, 7, 14, 15);
    u[4 * h + 2] = __builtin_shufflevector(b, d, 0, 1, 8, 9, 4, 5, 12, 13);
    u[4 * h + 3] = __builtin_shufflevector(b, d, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int k = 0; k < 4; ++k) {  // column k from u[k] (rows 0-3) and u[4 + k] (rows 4-7)
    r[k] = __builtin_shufflevector(u[k], u[4 + k], 0, 1, 2, 3, 8, 9, 10, 11);
    r[k + 4] = __builtin_shufflevector(u[k], u[4 + k], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// dst = src^T for a rows x cols float block (row strides lds, ldd): 8 x 8 blocks in
// registers (a scalar strided transpose stalls on stores that share cache sets), scalar
// edges.
inline void transpose(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                      int64_t ldd) {
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t r0 = 0; r0 < rows8; r0 += 8)
    for (int64_t c0 = 0; c0 < cols8; c0 += 8) {
      f8 r[8];
      for (int k = 0; k < 8; ++k) r[k] = vload(src + (r0 + k) * lds + c0);
      transpose8x8(r);
      for (int k = 0; k < 8; ++k) vstore(dst + (c0 + k) * ldd + r0, r[k]);
    }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c_begin = r < rows8 ? cols8 : 0;
    for (int64_t c = c_begin; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
}

}  // namespace headscope
