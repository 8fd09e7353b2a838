// Every headscope op schema, declared once. Kernels register per dispatch key next
// to their code: csrc/<family>/<backend>/ (docs/DEVELOPING.md, "Where things live").
// Shared conventions: q/k ops take `float? scale=None` (None: head_dim ** -0.5),
// `bool causal=True` and `Tensor? key_padding_mask=None` (true = padding); sizes that
// shape an output are SymInt so torch.compile keeps them symbolic. The region-pooling ops
// take `key_weights` after the pattern (per-key factors on the attention weights,
// docs/attribution.md); every q/k op takes `chunk_origin` last (where each row's chunks start:
// a pattern argument added after key_weights, so that positional calls keep their meaning).
#include <torch/library.h>

TORCH_LIBRARY(headscope, m) {
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};

  // ---- mixer: joint KL projection and the thin doubly-stochastic mixer ----------
  m.def("kl_project(Tensor log_u_ref, Tensor log_v_ref, float tol, int max_iter)"
        " -> (Tensor U, Tensor V, Tensor z, Tensor iters, Tensor residual)", pt2);
  m.def("kl_hvp(Tensor U, Tensor V, Tensor s) -> Tensor", pt2);
  m.def("thin_mix(Tensor U, Tensor V, Tensor X) -> Tensor", pt2);

  // ---- vas: value-attention similarity features ---------------------------------
  m.def("vas_head_stats(Tensor attn, Tensor head_writes, Tensor lengths, Tensor? offsets=None)"
        " -> Tensor", pt2);
  m.def("vas_head_stats_qk(Tensor q, Tensor k, Tensor head_writes, Tensor lengths, float? scale=None,"
        " bool causal=True, Tensor? offsets=None, Tensor? key_padding_mask=None, int? window=None,"
        " int? chunk=None, Tensor? block_ids=None, float? softcap=None,"
        " bool window_bounds_blocks=True, Tensor? chunk_origin=None) -> Tensor", pt2);
  m.def("vas_aggregate(Tensor head_stats) -> Tensor", pt2);

  // ---- attribution: vStream region pooling, linear head, correlations, regions ----
  m.def("region_pool(Tensor attn, Tensor query_weights, Tensor region_ids, SymInt num_regions,"
        " str reduce=\"sum\", Tensor? key_weights=None) -> Tensor", pt2);
  m.def("region_pool_qk(Tensor q, Tensor k, Tensor query_weights, Tensor region_ids,"
        " SymInt num_regions, float? scale=None, bool causal=True, Tensor? key_padding_mask=None,"
        " str reduce=\"sum\", int? window=None, int? chunk=None, Tensor? block_ids=None,"
        " float? softcap=None,"
        " bool window_bounds_blocks=True, Tensor? key_weights=None, Tensor? chunk_origin=None)"
        " -> Tensor", pt2);
  m.def("region_pool_qk_layers(Tensor[] q, Tensor[] k, Tensor query_weights, Tensor region_ids,"
        " SymInt num_regions, float[]? scale=None, bool causal=True, Tensor? key_padding_mask=None,"
        " str reduce=\"sum\", int[]? window=None, int[]? chunk=None, Tensor? block_ids=None,"
        " float? softcap=None,"
        " bool window_bounds_blocks=True, Tensor[]? key_weights=None,"
        " Tensor? chunk_origin=None) -> Tensor", pt2);
  m.def("linear_attribution(Tensor features, Tensor weight, Tensor mean, Tensor std,"
        " Tensor? bias=None) -> Tensor", pt2);
  m.def("spearman(Tensor pred, Tensor target, int dim=-1) -> Tensor", pt2);
  m.def("pearson(Tensor pred, Tensor target, int dim=-1) -> Tensor", pt2);
  m.def("ward_regions(Tensor features, SymInt height, SymInt width, SymInt num_regions,"
        " SymInt frames=1) -> Tensor", pt2);
}
