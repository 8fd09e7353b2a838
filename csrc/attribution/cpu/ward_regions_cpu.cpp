// CPU kernel of ward_regions: greedy Ward merging of grid-adjacent clusters (in a frame,
// and the same place in adjacent frames) with a heap
// of neighbour-pair distances and lazy invalidation, O(E log E + merges * degree * C).
//
// Exactly scikit-learn's ward_tree (sklearn/cluster/_agglomerative.py) restricted to the
// first M - K merges (its _hc_cut of the full tree gives the same partition): the same
// moments (counts and float64 feature sums, merged by one addition), the same distance
// formula and operation order as _hierarchical.compute_ward_dist, and the same heap key
// (distance, newer node, older node). Floating-point contraction is disabled below so
// the distances are bit-identical to the Cython ones on x86-64.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "attribution/cpu/ward_regions_cpu.h"
#include "common/kernel.h"

#include "attribution/attribution_checks.h"
#include "common/checks.h"
#include "common/cpu_simd.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <queue>
#include <tuple>
#include <vector>

namespace headscope::attribution::cpu {

namespace {

struct Pair {
  double dist;
  int64_t i, j;  // i > j (i the newer node), as scikit-learn's (inertia, row, col)
  bool operator>(const Pair& o) const {
    return std::tie(dist, i, j) > std::tie(o.dist, o.i, o.j);
  }
};

}  // namespace

void ward_grid_labels(double* X, int64_t frames, int64_t height, int64_t width, int64_t C,
                      int64_t num_regions, int64_t* labels) {
  const int64_t plane = height * width;
  const int64_t M = frames * plane;
  const int64_t nodes = 2 * M - num_regions;  // leaves + merges performed
  std::vector<double> count(nodes, 0.0);
  std::vector<int64_t> slot(nodes, -1), parent(nodes, -1);
  std::vector<char> used(nodes, 0);
  double* sums = X;  // one slot per leaf (the caller's buffer); a merge reuses a slot
  // centroid[slot] = sums[slot] / count, the very quotients scikit-learn forms per pair
  // (m_2[row, j] / m_1[row]); computed once per node, bit-identical.
  std::vector<double> cent(X, X + M * C);
  std::vector<std::vector<int64_t>> nb(nodes);
  for (int64_t p = 0; p < M; ++p) {
    count[p] = 1.0;
    slot[p] = p;
    used[p] = 1;
  }
  // Ward distances of (row, cols[j]) for j < n into out[j]: sklearn's formula term by term;
  // each pair's sum runs over c in order (bit-identical), and up to 8 pairs are summed
  // side by side so that the additions of different pairs overlap in the pipeline.
  auto dist_batch = [&](const int64_t* rows, const int64_t* cols, int64_t n, double* out) {
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const int64_t m = std::min<int64_t>(8, n - j0);
      const double* a[8];
      const double* b[8];
      double pa[8];
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t jj = j0 + (j < m ? j : 0);
        a[j] = cent.data() + slot[rows[jj]] * C;
        b[j] = cent.data() + slot[cols[jj]] * C;
        pa[j] = 0.;
      }
      // Squares four columns at a time (vector), then added to each pair's sum one by
      // one, in column order: the additions are exactly the sequential ones.
      const int64_t C4 = C / 4 * 4;
      for (int64_t c = 0; c < C4; c += 4)
        for (int64_t j = 0; j < 8; ++j) {
          const d4 d = vload(a[j] + c) - vload(b[j] + c);
          const d4 sq = d * d;
          pa[j] = (((pa[j] + sq[0]) + sq[1]) + sq[2]) + sq[3];
        }
      for (int64_t c = C4; c < C; ++c)
        for (int64_t j = 0; j < 8; ++j) {
          const double d = a[j][c] - b[j][c];
          pa[j] += d * d;
        }
      for (int64_t j = 0; j < m; ++j) {
        const double mr = count[rows[j0 + j]], mc = count[cols[j0 + j]];
        const double nn = (mr * mc) / (mr + mc);
        out[j0 + j] = pa[j] * nn;
      }
    }
  };
  std::priority_queue<Pair, std::vector<Pair>, std::greater<Pair>> heap;
  {
    std::vector<Pair> init;
    init.reserve(3 * M);
    for (int64_t p = 0; p < M; ++p) {
      const int64_t f = p / plane, r = (p % plane) / width, c = p % width;
      // grid_to_graph's 6-neighbourhood (4 in a frame); each pair once, as (larger, smaller)
      if (f > 0) init.push_back({0, p, p - plane});
      if (r > 0) init.push_back({0, p, p - width});
      if (c > 0) init.push_back({0, p, p - 1});
      if (f + 1 < frames) nb[p].push_back(p + plane);
      if (f > 0) nb[p].push_back(p - plane);
      if (r + 1 < height) nb[p].push_back(p + width);
      if (r > 0) nb[p].push_back(p - width);
      if (c + 1 < width) nb[p].push_back(p + 1);
      if (c > 0) nb[p].push_back(p - 1);
    }
    std::vector<int64_t> ri(init.size()), ci(init.size());
    std::vector<double> di(init.size());
    for (size_t e = 0; e < init.size(); ++e) {
      ri[e] = init[e].i;
      ci[e] = init[e].j;
    }
    dist_batch(ri.data(), ci.data(), static_cast<int64_t>(init.size()), di.data());
    for (size_t e = 0; e < init.size(); ++e) init[e].dist = di[e];
    heap = decltype(heap)(std::greater<Pair>(), std::move(init));
  }
  std::vector<int64_t> merged, krow;
  std::vector<double> kdist;
  for (int64_t k = M; k < nodes; ++k) {
    Pair top{};
    for (;;) {
      TORCH_CHECK(!heap.empty(), "headscope::ward_regions: internal error, the grid graph ran "
                  "out of neighbour pairs");
      top = heap.top();
      heap.pop();
      if (used[top.i] && used[top.j]) break;
    }
    const int64_t i = top.i, j = top.j;
    used[i] = used[j] = 0;
    parent[i] = parent[j] = k;
    used[k] = 1;
    count[k] = count[i] + count[j];
    slot[k] = slot[i];
    double* si = sums + slot[i] * C;
    const double* sj = sums + slot[j] * C;
    for (int64_t c = 0; c < C; ++c) si[c] = si[c] + sj[c];
    double* ci = cent.data() + slot[k] * C;
    for (int64_t c = 0; c < C; ++c) ci[c] = si[c] / count[k];
    // New neighbours: the live neighbours of i and j, deduplicated.
    merged.clear();
    for (int64_t src : {i, j})
      for (int64_t v : nb[src])
        if (v != i && v != j && used[v]) merged.push_back(v);
    std::sort(merged.begin(), merged.end());
    merged.erase(std::unique(merged.begin(), merged.end()), merged.end());
    krow.assign(merged.size(), k);
    kdist.resize(merged.size());
    dist_batch(krow.data(), merged.data(), static_cast<int64_t>(merged.size()), kdist.data());
    for (size_t e = 0; e < merged.size(); ++e) {
      const int64_t v = merged[e];
      auto& lst = nb[v];
      lst.erase(std::remove_if(lst.begin(), lst.end(),
                               [&](int64_t u) { return u == i || u == j || !used[u]; }),
                lst.end());
      lst.push_back(k);
      heap.push({kdist[e], k, v});
    }
    nb[k] = merged;
    std::vector<int64_t>().swap(nb[i]);
    std::vector<int64_t>().swap(nb[j]);
  }
  // Roots of the leaves, numbered by first appearance.
  std::vector<int64_t> root_label(nodes, -1);
  int64_t next = 0;
  for (int64_t p = 0; p < M; ++p) {
    int64_t r = p;
    while (parent[r] >= 0) r = parent[r];
    if (root_label[r] < 0) root_label[r] = next++;
    labels[p] = root_label[r];
  }
}

namespace {

at::Tensor ward_regions_cpu(const at::Tensor& features, int64_t height, int64_t width,
                            int64_t num_regions, int64_t frames) {
  const char* op = "headscope::ward_regions";
  check_ward_args(features, height, width, num_regions, frames);
  // Serial float64 copy (with the finite check): the clustering itself is serial, and an
  // ATen parallel copy would wake threads for a few microseconds of work.
  const int64_t M = frames * height * width, C = features.size(1);
  std::vector<double> X(M * C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(),
                                  "headscope_ward_regions_cpu", [&] {
    const scalar_t* f = features.const_data_ptr<scalar_t>();
    const int64_t s0 = features.stride(0), s1 = features.stride(1);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t c = 0; c < C; ++c) {
        const double v = static_cast<double>(f[i * s0 + c * s1]);
        HEADSCOPE_CHECK_ARG(std::isfinite(v), op, "features",
                            "must hold only finite values, got ", v, " at [", i, ", ", c, "]");
        X[i * C + c] = v;
      }
  });
  double* xp = X.data();
  auto out = at::empty({M}, features.options().dtype(at::kLong));
  ward_grid_labels(xp, frames, height, width, C, num_regions, out.mutable_data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(headscope, CPU, m) {
  m.impl("ward_regions", HEADSCOPE_KERNEL("ward_regions", ward_regions_cpu));
}

}  // namespace headscope::attribution::cpu
