"""VAS (value-attention similarity) features: Python wrappers over ``torch.ops.headscope``.

Per layer and head, the attention matrix is compared with the Gram matrix of the head's
row-normalised writes (d: normalised mismatch, c: CKA, r: row KL); the per-head numbers
are aggregated over heads (mean, std, max, min) and then over layers (mean, std, max)
into 36 features per sequence. Reference: docs/vas.md; "the reference implementation"
below is ``extract_vas`` in ``vas_reference.py``, which docs/vas.md says where to find.

- :func:`vas_head_stats` / :func:`vas_head_stats_qk`: one layer -> ``(B, H, 3)``.
- :func:`vas_aggregate`: ``(B, L, H, 3)`` -> ``(B, 36)``.
- :func:`vas_features`: drop-in for the reference implementation's ``extract_vas`` on
  per-layer lists.
- :class:`VASAccumulator`: feed one layer at a time from forward hooks.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["VAS_COLUMNS", "VASAccumulator", "vas_aggregate", "vas_features", "vas_head_stats",
           "vas_head_stats_qk", "lengths_and_offsets"]


def _columns() -> list:
    return [f"vas_{q}_{hagg}_{lstat}" for q in ("d", "c", "r")
            for hagg in ("mean", "std", "max", "min") for lstat in ("mean", "std", "max")]


#: The 36 feature names, in the order of :func:`vas_aggregate`'s columns (the reference
#: implementation's order).
VAS_COLUMNS = _columns()


def vas_head_stats(attn: torch.Tensor, head_writes: torch.Tensor, lengths: torch.Tensor,
                   offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(d, c, r) per head of one layer: ``(B, H, 3)`` float32.

    attn (B, H, T, T) and head_writes (B, H, T, Dh) in float32/float16/bfloat16, any
    strides; lengths int64 (B,) valid tokens per sequence. Without offsets the window is
    the first ``max(min(lengths[b], T), 4)`` positions (the reference implementation's
    rule, right padding);
    with offsets (int64 (B,), the first valid position) it starts there (left padding).
    """
    return torch.ops.headscope.vas_head_stats(attn, head_writes, lengths, offsets)


def vas_head_stats_qk(q: torch.Tensor, k: torch.Tensor, head_writes: torch.Tensor,
                      lengths: torch.Tensor, scale: Optional[float] = None, causal: bool = True,
                      offsets: Optional[torch.Tensor] = None,
                      key_padding_mask: Optional[torch.Tensor] = None,
                      window: Optional[int] = None, chunk: Optional[int] = None,
                      block_ids: Optional[torch.Tensor] = None,
                      softcap: Optional[float] = None,
                      window_bounds_blocks: bool = True,
                      chunk_origin: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`vas_head_stats` of ``softmax(q k^T * scale + causal mask)``, recomputed tile by
    tile from q (B, H, T, D) and k (B, Hkv, T, D) (Hkv divides H). scale defaults to
    ``D ** -0.5``. ``key_padding_mask`` (B, T) bool, True = padding: those keys are left out
    of the softmax, as the model's attention mask leaves them out.

    The attention pattern (:func:`headscope.pattern_mask` materialises it): ``window`` (a
    query sees its ``window`` most recent keys), ``chunk`` (only keys of its chunk),
    ``block_ids`` (B, T) int64 (a query in block b >= 0 also sees the later keys of b) and
    ``softcap`` (logits become ``softcap * tanh(logits / softcap)``);
    ``window_bounds_blocks=False``: a query sees its whole block whatever the window and
    chunks (PaliGemma 2; True: Gemma 3); ``chunk_origin`` (B,) int64, only with ``chunk``:
    the key index where each row's chunk 0 starts (None: the row's leading padding keys)."""
    return torch.ops.headscope.vas_head_stats_qk(q, k, head_writes, lengths, scale, causal,
                                                 offsets, key_padding_mask, window, chunk,
                                                 block_ids, softcap, window_bounds_blocks,
                                                 chunk_origin)


def vas_aggregate(head_stats: torch.Tensor) -> torch.Tensor:
    """``(B, L, H, 3)`` per-layer per-head stats -> ``(B, 36)`` features (columns
    :data:`VAS_COLUMNS`)."""
    return torch.ops.headscope.vas_aggregate(head_stats)


def lengths_and_offsets(attention_mask: torch.Tensor, left_padding: bool = False
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """lengths = ``attention_mask.sum(-1)`` (int64), and with ``left_padding`` the offsets:
    the index of each row's first nonzero mask entry (0 for an all-zero row)."""
    mask = attention_mask != 0
    lengths = mask.sum(-1).to(torch.int64)
    if not left_padding:
        return lengths, None
    offsets = torch.where(lengths > 0, mask.to(torch.int8).argmax(-1),
                          torch.zeros_like(lengths)).to(torch.int64)
    return lengths, offsets


def vas_features(attn_weights: Sequence[torch.Tensor], head_writes: Sequence[torch.Tensor],
                 attention_mask: torch.Tensor, left_padding: bool = False
                 ) -> Tuple[torch.Tensor, list]:
    """The reference implementation's ``extract_vas`` on per-layer lists: returns
    ``(features (B, 36) float32, VAS_COLUMNS)``. features is a tensor on the inputs' device
    (``.cpu().numpy()`` gives the reference implementation's array). With no head writes
    it returns zeros, like the reference implementation.

    ``left_padding=True`` takes each sequence's window from its first valid position (see
    :func:`lengths_and_offsets`) instead of the reference implementation's first-positions
    rule.
    """
    B = attention_mask.shape[0]
    if head_writes is None or len(head_writes) == 0:
        return torch.zeros(B, 36, dtype=torch.float32, device=attention_mask.device), list(VAS_COLUMNS)
    if len(attn_weights) != len(head_writes):
        raise ValueError(f"headscope.vas_features: argument 'head_writes' must have one tensor per "
                         f"layer of 'attn_weights' ({len(attn_weights)}), got {len(head_writes)}")
    lengths, offsets = lengths_and_offsets(attention_mask.to(attn_weights[0].device), left_padding)
    stats = torch.stack([vas_head_stats(a, v, lengths, offsets)
                         for a, v in zip(attn_weights, head_writes)], dim=1)
    return vas_aggregate(stats), list(VAS_COLUMNS)


class VASAccumulator:
    """Collects one layer at a time and gives the 36 features at the end, so a hooked
    forward keeps only ``(B, L, H, 3)`` numbers and no layer's attention.

        acc = VASAccumulator(num_layers, attention_mask)
        # in layer l's hook, with materialised attention:
        acc.update(l, attn, head_writes)
        # or with SDPA/flash layers (q (B, H, T, D), k (B, Hkv, T, D)):
        acc.update(l, (q, k), head_writes)           # causal, scale D ** -0.5 by default
        features = acc.features()                    # (B, 36)

    With an ``attention_mask``, the ``(q, k)`` updates leave its padding keys (mask 0) out of
    the softmax, as the model's attention did.
    """

    def __init__(self, num_layers: int, attention_mask: Optional[torch.Tensor] = None, *,
                 lengths: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None,
                 left_padding: bool = False, causal: bool = True, scale: Optional[float] = None):
        if num_layers < 1:
            raise ValueError(f"headscope.VASAccumulator: argument 'num_layers' must be >= 1, got {num_layers}")
        if lengths is None:
            if attention_mask is None:
                raise ValueError("headscope.VASAccumulator: give 'attention_mask' or 'lengths'")
            lengths, mask_offsets = lengths_and_offsets(attention_mask, left_padding)
            offsets = mask_offsets if offsets is None else offsets
        padding = None if attention_mask is None else attention_mask == 0
        self.key_padding_mask = padding if padding is not None and bool(padding.any()) else None
        self.num_layers = num_layers
        self.lengths = lengths.to(torch.int64)
        self.offsets = offsets
        self.causal = causal
        self.scale = scale
        self._stats: Optional[torch.Tensor] = None
        self._seen = [False] * num_layers

    def update(self, layer_idx: int, attn: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
               head_writes: torch.Tensor, *, causal: Optional[bool] = None,
               scale: Optional[float] = None,
               key_padding_mask: Optional[torch.Tensor] = None, **pattern) -> torch.Tensor:
        """Adds layer ``layer_idx`` from its attention (B, H, T, T) or its ``(q, k)``; returns
        that layer's (B, H, 3) stats. With ``(q, k)``: ``key_padding_mask`` (B, T), this
        layer's padding keys (default: the ``attention_mask``'s), and the layer's attention
        pattern, :func:`vas_head_stats_qk`'s ``window``, ``chunk``, ``block_ids``,
        ``softcap``, ``window_bounds_blocks`` and ``chunk_origin``."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"headscope.VASAccumulator.update: argument 'layer_idx' must be in "
                             f"[0, {self.num_layers}), got {layer_idx}")
        device = head_writes.device
        lengths = self.lengths.to(device)
        offsets = None if self.offsets is None else self.offsets.to(device)
        if isinstance(attn, (tuple, list)):
            q, k = attn
            kpm = self.key_padding_mask if key_padding_mask is None else key_padding_mask
            kpm = None if kpm is None else kpm.to(device)
            stats = vas_head_stats_qk(q, k, head_writes, lengths,
                                      self.scale if scale is None else scale,
                                      self.causal if causal is None else causal, offsets, kpm,
                                      **pattern)
        else:
            stats = vas_head_stats(attn, head_writes, lengths, offsets)
        if self._stats is None:
            B, H = stats.shape[:2]
            self._stats = stats.new_zeros(B, self.num_layers, H, 3)
        self._stats[:, layer_idx] = stats
        self._seen[layer_idx] = True
        return stats

    @property
    def complete(self) -> bool:
        """Whether every layer has been added."""
        return all(self._seen)

    @property
    def head_stats(self) -> torch.Tensor:
        """(B, L, H, 3) stats gathered so far (zeros for layers not yet added)."""
        if self._stats is None:
            raise RuntimeError("headscope.VASAccumulator: no layer has been added yet")
        return self._stats

    def features(self) -> torch.Tensor:
        """(B, 36) float32 features; every layer must have been added."""
        missing = [i for i, s in enumerate(self._seen) if not s]
        if missing:
            raise RuntimeError(f"headscope.VASAccumulator.features: layers {missing} were never added")
        return vas_aggregate(self.head_stats)
