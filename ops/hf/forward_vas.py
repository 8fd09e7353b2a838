"""The VAS of the forward running now (:class:`ForwardVAS`), gathered layer by layer from
the traced attention calls into a :class:`headscope.VASAccumulator`: each layer's
attention weights (or q and k, with its mask's pattern) and what each head writes. What a
head writes is a choice (:data:`WRITES`): its attention output, or that output as it
enters the residual stream through the head's block of the output projection."""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from ..vas import VASAccumulator
from .masks import MaskCall
from .value_norm import LayerFactors


def _head_outputs(vas: "ForwardVAS", layer: int, module, out: torch.Tensor) -> torch.Tensor:
    """Each head's attention output (the o_proj input)."""
    return out.transpose(1, 2)


def _residual_writes(vas: "ForwardVAS", layer: int, module, out: torch.Tensor
                     ) -> torch.Tensor:
    """Each head's write into the residual stream, up to a rotation: with W_O^h = Q R,
    (O_h R^T)(O_h R^T)^T = O_h W_O^h^T W_O^h O_h^T."""
    return torch.matmul(out.transpose(1, 2).float(), vas.residual_factor(layer, module))


# what a head writes, by the Tracer's ``writes``: (the ForwardVAS, traced layer, attention
# module, its output (B, T, H, Dh)) -> (B, H, T, Dh)
WRITES: Dict[str, Callable] = {"heads": _head_outputs, "residual": _residual_writes}


class ForwardVAS:
    """Per-head VAS statistics of one forward: :meth:`start` as a forward without a key
    cache begins, :meth:`add` per traced layer's attention call, :attr:`head_stats` once
    every layer has run (:attr:`complete`). ``writes``: a key of :data:`WRITES`;
    ``factors``: the layers' value norm factors (the residual writes read them)."""

    def __init__(self, num_layers: int, writes: str, factors: LayerFactors):
        self.num_layers = num_layers
        self.writes = WRITES[writes]
        self.factors = factors
        self._residual: Dict[int, torch.Tensor] = {}  # layer -> R^T per head
        self.accumulator: Optional[VASAccumulator] = None  # this forward's

    def start(self) -> None:
        self.accumulator = None

    def add(self, layer: int, module, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor,
            weights: Optional[torch.Tensor], mask: MaskCall, scale: float,
            softcap: Optional[float]) -> None:
        """Traced layer ``layer``'s call: q (after rotary) and the key cache ``k``, its
        output ``out`` ``(B, T, H, Dh)``, its attention ``weights`` where the
        implementation formed them, and the mask of its type (a whole sequence's)."""
        writes = self.writes(self, layer, module, out)
        if self.accumulator is None:  # the rows' VAS windows, from the forward's mask
            lengths, offsets = mask.window(q.shape[0], q.device)
            self.accumulator = VASAccumulator(self.num_layers, lengths=lengths, offsets=offsets)
        if weights is not None:
            self.accumulator.update(layer, weights, writes)
        else:
            self.accumulator.update(layer, (q, k), writes, scale=scale, causal=True,
                                    key_padding_mask=mask.padding, **mask.op_pattern(softcap))

    @property
    def complete(self) -> bool:
        """Whether every traced layer of the last forward has run."""
        return self.accumulator is not None and self.accumulator.complete

    @property
    def head_stats(self) -> torch.Tensor:
        """(B, L, H, 3) per-head (d, c, r)."""
        return self.accumulator.head_stats

    def residual_factor(self, layer: int, module) -> torch.Tensor:
        """R^T per head (1, H, Dh, Dh), where W_O^h = Q R."""
        if layer not in self._residual:
            R = self.factors.of(layer, module).float()  # (H, Dh, Dh)
            self._residual[layer] = R.transpose(-1, -2).unsqueeze(0)
        return self._residual[layer]
