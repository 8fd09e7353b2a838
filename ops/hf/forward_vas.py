"""The VAS of the forward running now (:class:`ForwardVAS`), gathered layer by layer from
the traced attention calls into a :class:`headscope.VASAccumulator`: each layer's
attention weights (or q and k, with its mask's pattern) and what each head writes.

What a head writes into the residual stream is its block of the output projection's
input, whatever the attention module does between its attention call and that projection
(Qwen3.5's sigmoid output gate, per head and channel; docs/hf.md lists each family's). So
each layer's call waits for its output projection's input, read by a forward pre-hook
that lives only as long as the forward that computes VAS. What a head writes is then a
choice (:data:`WRITES`): that input, split per head, or the same entering the residual
stream through the head's block of the output projection."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..vas import VASAccumulator
from .masks import MaskCall
from .value_norm import LayerFactors


def _head_inputs(vas: "ForwardVAS", layer: int, module, heads: torch.Tensor) -> torch.Tensor:
    """Each head's block of the output projection's input."""
    return heads


def _residual_writes(vas: "ForwardVAS", layer: int, module, heads: torch.Tensor
                     ) -> torch.Tensor:
    """Each head's write into the residual stream, up to a rotation: with W_O^h = Q R,
    (O_h R^T)(O_h R^T)^T = O_h W_O^h^T W_O^h O_h^T."""
    return torch.matmul(heads.float(), vas.residual_factor(layer, module))


# what a head writes, by the Tracer's ``writes``: (the ForwardVAS, traced layer, attention
# module, its output projection's input per head (B, H, T, Dh)) -> (B, H, T, Dh')
WRITES: Dict[str, Callable] = {"heads": _head_inputs, "residual": _residual_writes}


class ForwardVAS:
    """Per-head VAS statistics of one forward: :meth:`start` as a forward without a key
    cache begins (with ``capture`` where it computes VAS), :meth:`add` per traced layer's
    attention call, :attr:`head_stats` once every layer has run (:attr:`complete`).
    ``writes``: a key of :data:`WRITES`; ``factors``: the layers' value norm factors (the
    residual writes read them); ``projections``: each traced layer's output projection."""

    def __init__(self, num_layers: int, num_heads: int, writes: str, factors: LayerFactors,
                 projections: Sequence[torch.nn.Module]):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.writes = WRITES[writes]
        self.factors = factors
        self.projections = list(projections)
        self._residual: Dict[int, torch.Tensor] = {}  # layer -> R^T per head
        self._pending: Dict[int, tuple] = {}  # layer -> its call, waiting for its writes
        self._hooks: List = []
        self.accumulator: Optional[VASAccumulator] = None  # this forward's

    def start(self, capture: bool) -> None:
        """A forward without a key cache begins; ``capture``: it computes VAS, so each
        layer's output projection input is read (hooks removed after the last layer's)."""
        self.stop()
        self.accumulator = None
        if capture:
            self._hooks = [projection.register_forward_pre_hook(
                functools.partial(self._written, layer))
                for layer, projection in enumerate(self.projections)]

    def stop(self) -> None:
        """Removes the hooks (the forward's last layer has run, or it was interrupted)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._pending.clear()

    def add(self, layer: int, module, q: torch.Tensor, k: torch.Tensor,
            weights: Optional[torch.Tensor], mask: MaskCall, scale: float,
            softcap: Optional[float]) -> None:
        """Traced layer ``layer``'s call: q (after rotary) and the key cache ``k``, its
        attention ``weights`` where the implementation formed them, and the mask of its
        type (a whole sequence's); accumulated when its output projection reads what the
        heads write."""
        self._pending[layer] = (module, q, k, weights, mask, scale, softcap)

    def _written(self, layer: int, projection, args) -> None:
        """The output projection of traced layer ``layer`` is called with ``args[0]``
        ``(B, T, H * Dh)``: each head's write."""
        call = self._pending.pop(layer, None)
        if layer == self.num_layers - 1:
            self.stop()
        if call is None:  # the layer's call computed nothing (a mask that hides rows)
            return
        module, q, k, weights, mask, scale, softcap = call
        x = args[0]
        heads = x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        writes = self.writes(self, layer, module, heads)
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
