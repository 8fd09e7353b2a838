"""Value norms ``||v_j W_O^h||`` (Kobayashi et al. 2020, "Attention is not only a weight"):
how much key j's value can move the output of head h, the per-key factor that
``region_pool_qk(..., key_weights=...)`` multiplies each attention weight by.

Head h writes ``W_O^h v`` to the residual stream, ``W_O^h`` the ``(hidden, Dh)`` columns
``h*Dh:(h+1)*Dh`` of ``o_proj.weight``. Its norm needs no ``hidden``-wide product per key:
with ``W_O^h = Q_h R_h`` (QR, ``R_h`` ``(Dh, Dh)``), ``||W_O^h v|| = ||R_h v||``. So a layer's
factors come once from its weight (:func:`value_norm_factors`, to be cached by the caller)
and each key costs one ``Dh x Dh`` product per head (:func:`value_norms`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .structure import output_projection

__all__ = ["LayerFactors", "value_norm_factors", "value_norms"]


def value_norm_factors(o_proj_weight: Tensor, num_heads: int) -> Tensor:
    """``o_proj.weight`` ``(hidden, H*Dh)`` -> ``(H, r, Dh)`` factors ``R_h`` with
    ``R_h^T R_h = W_O^h^T W_O^h`` (``r = min(hidden, Dh)``), float32 (float64 for a float64
    weight). Compute once per layer and keep: the weight does not change between prompts."""
    if o_proj_weight.dim() != 2:
        raise ValueError(f"value_norm_factors: o_proj_weight must be (hidden, num_heads * "
                         f"head_dim), got shape {tuple(o_proj_weight.shape)}")
    hidden, width = o_proj_weight.shape
    if num_heads < 1 or width % num_heads:
        raise ValueError(f"value_norm_factors: num_heads ({num_heads}) must be >= 1 and divide "
                         f"o_proj_weight's {width} input columns")
    dtype = torch.float64 if o_proj_weight.dtype == torch.float64 else torch.float32
    head_dim = width // num_heads
    per_head = o_proj_weight.to(dtype).reshape(hidden, num_heads, head_dim).transpose(0, 1)
    return torch.linalg.qr(per_head, mode="r").R  # (H, min(hidden, Dh), Dh)


def value_norms(values: Tensor, factors: Tensor) -> Tensor:
    """One layer's value cache ``(B, Hkv, Tk, Dh)`` -> ``(B, H, Tk)`` norms
    ``||v_j W_O^h||`` for each query head h, ``factors`` from :func:`value_norm_factors`.

    Grouped-query attention: ``Hkv`` divides ``H`` and head h reads value head
    ``h // (H // Hkv)``, as the ops read ``k``. The result has the factors' dtype (float32,
    float64 for float64 factors) and device; pass it (or its image keys) as ``key_weights``.
    """
    if values.dim() != 4:
        raise ValueError(f"value_norms: values must be (B, Hkv, Tk, head_dim), got shape "
                         f"{tuple(values.shape)}")
    if factors.dim() != 3:
        raise ValueError(f"value_norms: factors must be value_norm_factors' (H, r, head_dim), "
                         f"got shape {tuple(factors.shape)}")
    B, Hkv, Tk, head_dim = values.shape
    H = factors.shape[0]
    if factors.shape[2] != head_dim:
        raise ValueError(f"value_norms: values have head_dim {head_dim}, the factors "
                         f"{factors.shape[2]} (o_proj of another layer or model?)")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"value_norms: the {Hkv} value heads must divide the {H} heads of "
                         f"the factors")
    G = H // Hkv
    v = values.to(factors.dtype).unsqueeze(2)                     # (B, Hkv, 1, Tk, Dh)
    R = factors.reshape(Hkv, G, factors.shape[1], head_dim)       # head h = hk * G + g
    return torch.linalg.vector_norm(v @ R.transpose(-1, -2), dim=-1).reshape(B, H, Tk)


class LayerFactors:
    """Each traced layer's :func:`value_norm_factors` of its attention module's output
    projection, computed on first use and kept (the weights do not change between
    prompts): the query rows' value norms and the residual writes of VAS read them."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self._factors: dict = {}  # traced layer -> (H, min(hidden, Dh), Dh)

    def of(self, layer: int, module: torch.nn.Module) -> Tensor:
        if layer not in self._factors:
            self._factors[layer] = value_norm_factors(
                output_projection(module).weight.detach(), self.num_heads)
        return self._factors[layer]
