"""A key mask applied inside every attention call of a text decoder: the ``"mask"``
ablation of :func:`~headscope.hf.region_effects`.

While :attr:`KeyMask.removed` is set, the keys it marks are taken out of every query's
view, in every layer, for every query (the marked positions' own queries included). No
mask tensor is built for it: q and k get extra head channels, ``[q, 1, 0...]`` and
``[k, b, 0...]`` with ``b = 0`` for a kept key and a large negative ``b`` for a removed
one, so that each score becomes ``q.k + b`` inside whichever implementation the model was
loaded with (sdpa, eager or a flash kernel); ``exp`` of a removed key's score is 0 in
the softmax. The values get zero channels too (flash kernels want one head size) and the
output is cut back. A soft cap would bound that offset too: with one, the removed keys go
into the additive mask the eager implementation adds after the cap.

The decoder runs alone there, from a 2-D mask: the bidirectional blocks (images, a prefix)
the VLM built its masks with are put back into the masks the decoder builds.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from transformers.masking_utils import causal_mask_function

from .backend import Binding
from .masks import Pattern, UnsupportedPattern, mask_function, read_pattern

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
        self.blocks: Dict[str, Pattern] = {}  # layer type -> the last mask with blocks

    def __enter__(self) -> "KeyMask":
        self.bind(self.config)
        return self

    def __exit__(self, *exc) -> None:
        self.unbind(self.config)

    def mask(self, *args, **kwargs):
        """The model's masks, with the bidirectional blocks the VLM gave its decoder put
        back: ``region_effects`` runs the decoder alone, from a 2-D mask, and the decoder
        then builds its layers' masks without the VLM's image or prefix blocks."""
        try:
            pattern = read_pattern(kwargs.get("mask_function", causal_mask_function))
        except UnsupportedPattern:
            return super().mask(*args, **kwargs)  # the attention call names what it is
        if pattern.blocks is not None:
            self.blocks[pattern.kind] = pattern
        elif pattern.kind in self.blocks:
            given = self.blocks[pattern.kind]
            pattern.blocks, pattern.window_bounds_blocks = given.blocks, given.window_bounds_blocks
            kwargs["mask_function"] = mask_function(pattern, int(kwargs["batch_size"]))
            kwargs["allow_is_causal_skip"] = False
        return super().mask(*args, **kwargs)

    def first_block_position(self) -> Optional[int]:
        """The first position in a bidirectional block of the masks seen (None: none)."""
        firsts = [int(p.blocks[0].ge(0).to(torch.int8).argmax()) for p in self.blocks.values()
                  if bool(p.blocks[0].ge(0).any())]
        return min(firsts, default=None)

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        if self.removed is None:
            return super().attention(module, query, key, value, attention_mask, **kwargs)
        if kwargs.get("s_aux") is not None:  # sinks would change what b does to a score
            raise NotImplementedError(f"{self.who}: ablation='mask' does not support "
                                      f"attention with sinks ('s_aux')")
        B, Hkv, Tk, D = key.shape
        if self.removed.shape[0] != B or self.removed.shape[1] < Tk:
            raise RuntimeError(f"{self.who}: the key mask covers {tuple(self.removed.shape)}, "
                               f"the attention call has batch {B} and {Tk} keys")
        if kwargs.get("softcap") is not None:
            return self._masked_after_softcap(module, query, key, value, attention_mask,
                                              **kwargs)
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

    def _masked_after_softcap(self, module, query, key, value, attention_mask, **kwargs):
        """A soft cap bounds every score, the extra channel's offset included: the removed
        keys go into the additive mask the eager implementation adds after the cap."""
        if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
                and attention_mask.is_floating_point()):
            raise NotImplementedError(f"{self.who}: ablation='mask' of attention with a soft cap "
                                      f"needs the model loaded with eager attention (an additive "
                                      f"4-D mask), got the mask "
                                      f"{type(attention_mask).__name__}")
        Tk = key.shape[2]
        removed = self.removed[:, None, None, :Tk]
        # the mask's own masked value: a query whose keys are all removed stays finite
        attention_mask = attention_mask.masked_fill(removed, torch.finfo(attention_mask.dtype).min)
        return super().attention(module, query, key, value, attention_mask, **kwargs)
