"""A key mask applied inside every attention call of a text decoder: the ``"mask"``
ablation of :func:`~headscope.hf.region_effects`.

While :attr:`KeyMask.removed` is set, the keys it marks are taken out of every query's
view, in every layer, for every query (the marked positions' own queries included). No
mask tensor is built for it: q and k get extra head channels, ``[q, 1, 0...]`` and
``[k, b, 0...]`` with ``b = 0`` for a kept key and a large negative ``b`` for a removed
one, so that each score becomes ``q.k + b`` inside whichever implementation the model was
loaded with (sdpa, eager or a flash kernel); ``exp`` of a removed key's score is 0 in
the softmax. The values get zero channels too (flash kernels want one head size) and the
output is cut back.
"""
from __future__ import annotations

from typing import Optional

import torch

from .backend import Binding

_EXTRA = 8  # extra head channels: keeps the head size a multiple of 8 for fused kernels


def removed_score(dtype: torch.dtype) -> float:
    """The score offset of a removed key: far below any real score, yet finite, so that
    a query whose keys are all removed (an image token at position 0) stays finite instead
    of turning into NaN and spreading through the next layer's keys."""
    return torch.finfo(dtype).min / 8


class KeyMask(Binding):
    """Binds to a text decoder's config; ``removed`` ``(B, T)`` bool, True = the key at
    that sequence position is removed for row b (None: attention runs unchanged)."""

    who = "headscope.hf.region_effects"

    def __init__(self, config):
        self.config = config
        self.removed: Optional[torch.Tensor] = None

    def __enter__(self) -> "KeyMask":
        self.bind(self.config)
        return self

    def __exit__(self, *exc) -> None:
        self.unbind(self.config)

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        if self.removed is None:
            return super().attention(module, query, key, value, attention_mask, **kwargs)
        for name in ("softcap", "s_aux"):  # both would change what b does to a score
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"{self.who}: ablation='mask' does not support "
                                          f"attention with {name!r}")
        B, Hkv, Tk, D = key.shape
        if self.removed.shape[0] != B or self.removed.shape[1] < Tk:
            raise RuntimeError(f"{self.who}: the key mask covers {tuple(self.removed.shape)}, "
                               f"the attention call has batch {B} and {Tk} keys")
        scaling = kwargs.pop("scaling", None)
        scaling = D ** -0.5 if scaling is None else scaling
        q_extra = query.new_zeros(*query.shape[:-1], _EXTRA)
        q_extra[..., 0] = 1
        k_extra = key.new_zeros(B, Hkv, Tk, _EXTRA)
        k_extra[..., 0] = (self.removed[:, None, :Tk].to(key.dtype)
                           * removed_score(key.dtype))
        v_extra = value.new_zeros(*value.shape[:-1], _EXTRA)
        out, weights = self.base_attention(module)(
            module, torch.cat([query, q_extra], -1), torch.cat([key, k_extra], -1),
            torch.cat([value, v_extra], -1), attention_mask, scaling=scaling, **kwargs)
        return out[..., :value.shape[-1]], weights
