"""vStream attribution's ops: region pooling of attention, the linear score, the
correlations and Ward regions (thin wrappers over ``torch.ops.headscope.*``).

vStream (arXiv 2604.16587) scores the effect of ablating image region k on a generated
span S with one dot product: a feature f(S, k) of L*H entries (per layer and head, the
span's attention mass on region k's keys) against a weight vector fitted for Pearson
correlation with measured ablation effects (:class:`headscope.AttributionHead`,
``head.py``), scored by LDS (:func:`headscope.lds`, ``metrics.py``).

* ``region_pool`` / ``region_pool_qk``: one layer's features ``(B, K, H)`` from attention
  probabilities, or streamed from ``q`` and ``k`` without storing the attention matrix;
  ``stack_layers`` joins the layers into ``(B, K, L*H)`` (layer-major), and
  ``region_pool_qk_layers`` pools every layer from ``q`` and ``k`` in one call.
* ``linear_attribution``: the head's score ``((f - mean) / std) . weight + bias``.
* ``spearman``, ``pearson``: the correlations.
* ``ward_regions``: the paper's regions (Ward clustering of patch features on the grid).
"""
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["linear_attribution", "pearson", "region_pool", "region_pool_qk",
           "region_pool_qk_layers", "spearman", "stack_layers", "ward_regions"]


# ---- thin wrappers over torch.ops.headscope.* -------------------------------------------

def region_pool(attn: Tensor, query_weights: Tensor, region_ids: Tensor, num_regions: int,
                reduce: str = "sum", key_weights: Optional[Tensor] = None) -> Tensor:
    """``(B, H, Tq, Tk)`` attention probabilities -> ``(B, K, H)`` region features.

    ``query_weights`` ``(B, Tq)`` >= 0 selects the span (0 outside it; each row must have a
    positive sum), ``region_ids`` int64 ``(B, Tk)`` in ``[-1, K)`` (-1: not an image token).
    ``reduce="mean"`` divides by the region's size; an empty region gives 0.

    ``key_weights`` ``(B, Hw, Tk)`` float, ``Hw`` dividing ``H``, finite at image keys (the
    only ones read; other entries may hold anything): every attention
    weight to key t is multiplied by ``key_weights[b, h // (H // Hw), t]`` before the region
    sum (``Hw = H``: one factor per head; the key-value heads of grouped-query attention;
    1: shared by every head), e.g. value norms (:func:`headscope.hf.value_norms`). Any
    strides: a view of a longer buffer is read in place.
    """
    return torch.ops.headscope.region_pool(attn, query_weights, region_ids, num_regions,
                                           reduce, key_weights)


def region_pool_qk(q: Tensor, k: Tensor, query_weights: Tensor, region_ids: Tensor,
                   num_regions: int, scale: Optional[float] = None, causal: bool = True,
                   key_padding_mask: Optional[Tensor] = None, reduce: str = "sum",
                   window: Optional[int] = None, chunk: Optional[int] = None,
                   block_ids: Optional[Tensor] = None,
                   softcap: Optional[float] = None, window_bounds_blocks: bool = True,
                   key_weights: Optional[Tensor] = None,
                   chunk_origin: Optional[Tensor] = None) -> Tensor:
    """``region_pool(softmax(scale * q k^T))`` without storing the attention matrix.

    ``q`` ``(B, H, Tq, D)``, ``k`` ``(B, Hkv, Tk, D)`` with ``Hkv`` dividing ``H`` (grouped
    query attention: query head h reads kv head ``h // (H // Hkv)``). ``scale`` defaults
    to ``D ** -0.5``. ``causal`` masks bottom-right aligned: query i sees keys
    ``t <= i + Tk - Tq`` (a decode step with a key cache sees all keys).
    ``key_padding_mask`` ``(B, Tk)`` bool, True = padding (ignored), as in
    ``nn.MultiheadAttention``. A query row with no visible key contributes nothing.

    The attention pattern, as :func:`headscope.pattern_mask` materialises it (positions
    aligned as ``causal``): ``window`` (None or 0: none; the ``window`` most recent keys up
    to the query), ``chunk`` (None or 0: none; only keys of the query's chunk), ``block_ids``
    ``(B, Tk)`` int64 (a query whose position has block b >= 0 also sees every key of b),
    ``softcap`` (logits become ``softcap * tanh(logits / softcap)``),
    ``window_bounds_blocks`` (False: a query sees its whole block whatever the window and
    chunks, PaliGemma 2's composition; True: Gemma 3's), ``chunk_origin`` ``(B,)`` int64,
    only with ``chunk``: the key index where each row's chunk 0 starts (any integer;
    negative when the keys start past it, as a cache that dropped keys does; None: the
    row's leading padding keys).

    ``key_weights`` ``(B, Hw, Tk)``: per-key factors on the attention weights, as
    :func:`region_pool`'s (``Hw`` dividing ``H``, so ``Hkv`` is one choice).
    """
    return torch.ops.headscope.region_pool_qk(q, k, query_weights, region_ids, num_regions,
                                              scale, causal, key_padding_mask, reduce, window,
                                              chunk, block_ids, softcap, window_bounds_blocks,
                                              key_weights, chunk_origin)


def region_pool_qk_layers(q: Sequence[Tensor], k: Sequence[Tensor], query_weights: Tensor,
                          region_ids: Tensor, num_regions: int,
                          scale: Optional[Sequence[float]] = None, causal: bool = True,
                          key_padding_mask: Optional[Tensor] = None,
                          reduce: str = "sum",
                          window: Union[int, Sequence[Optional[int]], None] = None,
                          chunk: Union[int, Sequence[Optional[int]], None] = None,
                          block_ids: Optional[Tensor] = None,
                          softcap: Optional[float] = None,
                          window_bounds_blocks: bool = True,
                          key_weights: Optional[Sequence[Tensor]] = None,
                          chunk_origin: Optional[Tensor] = None) -> Tensor:
    """:func:`region_pool_qk` of every layer in one call: ``q[l]`` ``(B, H, Tq, D)`` and
    ``k[l]`` ``(B, Hkv, Tk, D)`` (every layer of the first one's sizes), ``scale`` one per
    layer (default ``D ** -0.5``) -> ``(B, K, L*H)``, column ``l*H + h``: the features of an
    :class:`AttributionHead`, as ``stack_layers`` orders them. One call per span for a
    streaming tracer; the CPU kernel pools every layer in one pass.

    ``window`` and ``chunk``: one length for every layer, or one per layer (None or 0: none
    in that layer; Gemma's sliding and global layers alternate). ``block_ids``,
    ``softcap``, ``window_bounds_blocks`` and ``chunk_origin`` (only when some layer has
    chunks) apply to every layer (:func:`region_pool_qk`).

    ``key_weights``: None, or one ``(B, Hw, Tk)`` tensor per layer (:func:`region_pool`'s
    factors; a list, so that per-layer value norms pass without being stacked).
    """
    def per_layer(v):
        if v is None:
            return None
        if isinstance(v, int):
            return [v] * len(q)
        return [0 if x is None else int(x) for x in v]

    return torch.ops.headscope.region_pool_qk_layers(list(q), list(k), query_weights,
                                                     region_ids, num_regions,
                                                     None if scale is None else list(scale),
                                                     causal, key_padding_mask, reduce,
                                                     per_layer(window), per_layer(chunk),
                                                     block_ids, softcap, window_bounds_blocks,
                                                     None if key_weights is None
                                                     else list(key_weights), chunk_origin)


def linear_attribution(features: Tensor, weight: Tensor, mean: Tensor, std: Tensor,
                       bias: Union[float, Tensor, None] = None) -> Tensor:
    """``(..., F)`` features -> ``(...)`` scores ``((f - mean) / std) . weight + bias``.

    ``bias`` is a 0-dim tensor or a number (None: 0). A ``std`` entry that is not finite
    and positive makes every score NaN."""
    if bias is not None and not isinstance(bias, Tensor):
        bias = features.new_full((), float(bias), dtype=weight.dtype)
    return torch.ops.headscope.linear_attribution(features, weight, mean, std, bias)


def spearman(pred: Tensor, target: Tensor, dim: int = -1) -> Tensor:
    """Spearman correlation along ``dim`` (average ranks for ties), as
    ``scipy.stats.spearmanr``: NaN for a constant slice or a slice holding NaN."""
    return torch.ops.headscope.spearman(pred, target, dim)


def pearson(pred: Tensor, target: Tensor, dim: int = -1) -> Tensor:
    """Pearson correlation along ``dim`` (NaN for a constant slice); differentiable."""
    return torch.ops.headscope.pearson(pred, target, dim)


def ward_regions(features: Tensor, height: int, width: int, num_regions: int) -> Tensor:
    """``(height*width, C)`` patch features (row-major grid) -> int64 labels ``(M,)``.

    Ward agglomerative clustering with 4-neighbour grid connectivity, as scikit-learn's
    ``AgglomerativeClustering(num_regions, linkage="ward", connectivity=grid_to_graph(h, w))``;
    labels numbered in order of first appearance.
    """
    return torch.ops.headscope.ward_regions(features, height, width, num_regions)


def stack_layers(per_layer) -> Tensor:
    """A list of L per-layer features ``(..., K, H)`` -> ``(..., K, L*H)``, layer-major."""
    return torch.stack(list(per_layer), dim=-2).flatten(-2)
