// The VAS math every backend shares, for host and device code (nvcc compiles it into the
// CUDA kernels, the CPU kernels include it as plain C++): the window rule and the step
// from a head's sums to its (d, c, r).
//
// Per head over its window of n positions, with A the attention, Vn the row-normalised head
// writes, G = Vn Vn^T, S = (G + 1) / 2, H = I - 1 1^T / n and Xc = H X H:
//   d = ||Ac - Sc|| / (||A|| ||S||),   c = <Ac, Sc> / (||Ac|| ||Sc||),
//   r = mean_i sum_j p_ij ln(p_ij / q_ij), p and q: A and S over their largest row sums,
//       clipped below at 1e-12,
// as the reference implementation (extract_vas in vas_reference.py; the tests' NumPy
// transcription is tests/python/vas_reference_impl.py) computes them in float32.
// A kernel never forms Ac or Sc: it accumulates ||B||^2, <B, G> and the row and column sums
// of B = A - x 1^T - 1 y^T for shifts x, y of its choice (any shifts give H B H = Ac; shifts
// near A's row and column means keep the sums small where Ac is tiny, as under attention
// sinks), and ||S||^2, ||Sc||^2 from the value side.
// The CPU kernels finish every head through head_stats; the CUDA pass, which still centres
// A by 1/n and sums the KL in another form, uses the window rule, centred_norm2 and
// distance_and_cka, and moves to head_stats with the CPU's shifts (docs/PERF-H200.md).
#pragma once

#include "common/host_device.h"

#include <cmath>
#include <cstdint>

namespace headscope::vas {

// The reference's clip of p, q and the row-sum maxima.
constexpr double kClip = 1e-12;

// The reference's window length: max(min(length, T), 4), then bounded by T.
HEADSCOPE_HD inline int64_t window_len(int64_t length, int64_t T) {
  const int64_t n = length < T ? length : T;
  const int64_t at_least_4 = n > 4 ? n : 4;
  return at_least_4 < T ? at_least_4 : T;
}

// First position of the window: 0 (the reference's first-T rule) or, with offsets (left
// padding), offsets[b], moved left where needed so that the window fits in T.
HEADSCOPE_HD inline int64_t window_start(int64_t offset, int64_t n, int64_t T) {
  const int64_t s = offset < T - n ? offset : T - n;
  return s > 0 ? s : 0;
}

// ||H B H||^2 for an n x n matrix B from ||B||^2, the sums of squares of its row sums and of
// its column sums, and its total (exact algebra; a difference of large sums only where B
// is far from H B H).
HEADSCOPE_HD inline double centred_norm2(double n, double sq, double row_sq, double col_sq,
                                         double total) {
  return fmax(0.0, sq - row_sq / n - col_sq / n + total * total / (n * n));
}

struct DistanceCka {
  double d, c;
};

// d and c from Acc = ||Ac||^2, Scc = ||Sc||^2, an estimate of 2 <Ac, Sc> and the squared
// norms of A and S. <Ac, Sc> is bounded by Cauchy-Schwarz, so that c is exactly 0 when
// either centred matrix is (e.g. n = 1), as in the reference.
HEADSCOPE_HD inline DistanceCka distance_and_cka(double Acc, double Scc, double two_ac_sc,
                                                 double a2, double s2) {
  const double bound = sqrt(Acc * Scc);
  const double Asc = fmin(bound, fmax(-bound, 0.5 * two_ac_sc));
  const double c = Asc / fmax(bound, 1e-12);
  const double num = sqrt(fmax(0.0, Acc - 2.0 * Asc + Scc));
  const double den = fmax(sqrt(a2) * sqrt(s2), 1e-9);
  return {num / den, c};
}

// r from the row KL's sums taken without A's normalisation: kl2 = sum a' log2(a' / q) and
// ap = sum a' over the window (a' = max(a, 1e-30)), mA the largest row sum of A:
// sum p ln(p / q) = (ln 2 kl2 - ln(mA) ap) / mA for p = a' / mA.
HEADSCOPE_HD inline double row_kl_mean(double kl2, double ap, double mA, double n) {
  const double m = fmax(mA, kClip);  // the reference's max(max row sum, 1e-12)
  return (0.6931471805599453 * kl2 - log(m) * ap) / m / n;
}

// The sums over a head's rows i of B's row sums rb_i and column sums cb_i, with
// adot_i = m . Vn_i (m the mean of Vn's rows), which turn <B, G> into <B, Gc>.
struct BorderSums {
  double rb2 = 0, cb2 = 0, rba = 0, cba = 0, total = 0;
  HEADSCOPE_HD void add(double rb, double cb, double adot) {
    total += rb;
    rb2 += rb * rb;
    cb2 += cb * cb;
    rba += rb * adot;
    cba += cb * adot;
  }
};

// Everything a head's (d, c, r) needs.
struct HeadSums {
  double n;
  double b2;         // ||B||^2
  double bg;         // <B, G>, or <B, W W^T> with W = Vn - m (centred)
  bool centred;      // bg is <B, W W^T> = <B, H G H> already
  BorderSums border;
  double a2;         // ||A||^2
  double kl2, ap;    // the row KL's sums (row_kl_mean)
  double mA;         // A's largest row sum
  double msq;        // |m|^2
  double Scc, s2;    // ||Sc||^2, ||S||^2
};

struct HeadStats {
  double d, c, r;
};

// <Ac, Sc> = <B, H G H> / 2 and H G H = G - adot 1^T - 1 adot^T + |m|^2 1 1^T.
HEADSCOPE_HD inline HeadStats head_stats(const HeadSums& h) {
  const BorderSums& e = h.border;
  const double Acc = centred_norm2(h.n, h.b2, e.rb2, e.cb2, e.total);
  const double bwwt = h.centred ? h.bg : h.bg - e.rba - e.cba + e.total * h.msq;
  const DistanceCka dc = distance_and_cka(Acc, h.Scc, bwwt, h.a2, h.s2);
  return {dc.d, dc.c, row_kl_mean(h.kl2, h.ap, h.mA, h.n)};
}

}  // namespace headscope::vas
