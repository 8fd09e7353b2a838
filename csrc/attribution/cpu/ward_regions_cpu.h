// Ward agglomerative clustering on a patch grid of frames, 4 neighbours within a frame and
// the same patch in the previous and next frame (host code, shared by the CPU kernel and
// the CUDA kernel, which runs it on a host copy).
#pragma once

#include <cstdint>

namespace headscope::attribution::cpu {

// X: (frames * height * width, C) doubles, frame by frame, each frame row-major, finite;
// used as scratch (overwritten). Writes labels[0..M) in [0, K), numbered by first
// appearance. Merge order equals scikit-learn's ward_tree with grid_to_graph(frames,
// height, width) connectivity (same distances, same (distance, i, j) heap order).
void ward_grid_labels(double* X, int64_t frames, int64_t height, int64_t width, int64_t C,
                      int64_t num_regions, int64_t* labels);

}  // namespace headscope::attribution::cpu
