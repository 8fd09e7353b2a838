// The finalisation of a vas CPU call: each head's chunk sums combined and turned into
// (d, c, r) by vas_math.h's head_stats.
#include "vas/cpu/vas_head_stats_cpu.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <limits>

namespace headscope::vas::cpu {

// refine, where given, runs for heads whose ||Ac|| is below 1e-8 ||A||: B's row sums come
// from A's, and below about 1e-12 ||A|| a double's rounding of those is most of them.
void finalize_into(Problem& P, float* o, const Range* only, const Refine& refine) {
  run_range(only, P.BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      float* ob = o + bh * 3;
      if (P.bad[bh]) {
        ob[0] = ob[1] = ob[2] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const int64_t n = P.n[bh / P.H];
      HeadSums h{};
      h.n = static_cast<double>(n);
      const double* part = P.part.data_ptr<double>() + bh * P.P * kParts;
      for (const double* pt = part; pt < part + P.P * kParts; pt += kParts) {
        h.kl2 += pt[0];
        h.ap += pt[1];
        h.bg += pt[2];
        h.b2 += pt[3];
        h.a2 += pt[4];
      }
      const double* rsum = P.rsum.data_ptr<double>() + bh * P.T;
      const double* rlo = P.rlo.data_ptr<double>() + bh * P.T;
      const double* colp = P.colp.data_ptr<double>() + bh * P.P * P.T;
      const double* adot = P.adot.data_ptr<double>() + bh * P.T;
      const float* x = P.xrow.data_ptr<float>() + bh * P.T;
      const float* y = P.ycol.data_ptr<float>() + bh * P.T;
      // B = A - x 1^T - 1 y^T: colp holds B's column sums, its row sums are
      // r_i - n x_i - sum(y) (sum(y)'s rounding shifts every row sum alike: no centred sum
      // changes)
      double sy = 0;
      for (int64_t i = 0; i < n; ++i) sy += y[i];
      auto border_sums = [&] {
        h.border = BorderSums{};
        h.mA = 0;
        for (int64_t i = 0; i < n; ++i) {
          double c = 0;
          for (int64_t p = 0; p < P.P; ++p) c += colp[p * P.T + i];
          h.mA = std::max(h.mA, rsum[i] + rlo[i]);
          // (where refined, r_i's large part cancels exactly)
          h.border.add(((rsum[i] - h.n * x[i]) - sy) + rlo[i], c, adot[i]);
        }
      };
      border_sums();
      if (refine) {
        const BorderSums& e = h.border;
        if (centred_norm2(h.n, h.b2, e.rb2, e.cb2, e.total) < 1e-16 * h.a2) {
          refine(bh);
          border_sums();
        }
      }
      h.centred = P.centred[bh];
      h.msq = P.msq[bh];
      h.Scc = P.Scc[bh];
      h.s2 = P.Snorm2[bh];
      const HeadStats st = head_stats(h);
      ob[0] = static_cast<float>(st.d);
      ob[1] = static_cast<float>(st.c);
      ob[2] = static_cast<float>(st.r);
    }
  });
}

at::Tensor finalize(Problem& P, const at::TensorOptions& out_opts, const Refine& refine) {
  at::Tensor out = at::empty({P.B, P.H, 3}, out_opts.dtype(at::kFloat));
  finalize_into(P, out.data_ptr<float>(), nullptr, refine);
  return out;
}

}  // namespace headscope::vas::cpu
