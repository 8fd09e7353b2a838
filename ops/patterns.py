"""The attention patterns of the q/k ops, materialised: :func:`pattern_mask` builds the
``(B, Tq, Tk)`` boolean mask that ``vas_head_stats_qk``, ``region_pool_qk`` and
``region_pool_qk_layers`` apply without ever forming it. It is the definition the ops are
tested against and the eager baselines of the benchmark; it costs ``B * Tq * Tk`` bytes, so
it is for references, not for long sequences.

The composition is transformers' ``masking_utils`` for Gemma 3,
``window AND chunk AND (causal OR same block)``, or with ``window_bounds_blocks=False``
PaliGemma 2's, ``(window AND chunk AND causal) OR same block``; then padding.
"""
from typing import Optional

import torch
from torch import Tensor

__all__ = ["pattern_mask", "softcap_logits"]


def pattern_mask(Tq: int, Tk: int, *, batch: int = 1, causal: bool = True,
                 window: Optional[int] = None, chunk: Optional[int] = None,
                 block_ids: Optional[Tensor] = None,
                 key_padding_mask: Optional[Tensor] = None,
                 window_bounds_blocks: bool = True, chunk_origin: Optional[Tensor] = None,
                 device=None) -> Tensor:
    """``(B, Tq, Tk)`` bool, True where query ``i`` sees key ``j``.

    Query ``i`` sits at key position ``p = Tk - Tq + i`` (bottom-right, as the ops align
    queries with the key cache). ``causal``: ``j <= p``. ``window`` (None or 0: none):
    ``j > p - window``, the ``window`` most recent keys up to the query (transformers'
    ``sliding_window_overlay``). ``chunk`` (None or 0: none): ``j`` and ``p`` in the same
    chunk, ``floor((j - o) / chunk) == floor((p - o) / chunk)`` with ``o`` the row's
    ``chunk_origin`` ``(B,)`` int64 (where chunk 0 starts, any integer; None: the row's
    leading padding keys, so that chunks count from the first real token:
    ``chunked_overlay`` with ``left_padding``, ``o = left_padding - kv_offset`` over a key
    cache starting at ``kv_offset``). ``block_ids`` ``(B, Tk)`` int64: a query whose own position has
    block ``b >= 0`` also sees every key of block ``b``, later ones included
    (``blockwise_overlay``, OR-ed with causal; the window and chunks still bound it, as
    Gemma 3's masks do, unless ``window_bounds_blocks`` is False: then the block is OR-ed
    after them, as PaliGemma 2's sliding masks do). ``key_padding_mask`` ``(B, Tk)`` bool,
    True = padding: never seen."""
    B = batch
    if block_ids is not None:
        B = block_ids.shape[0]
        device = block_ids.device
    if key_padding_mask is not None:
        B = key_padding_mask.shape[0]
        device = key_padding_mask.device
    p = (torch.arange(Tq, device=device) + (Tk - Tq))[:, None]      # query positions
    j = torch.arange(Tk, device=device)[None, :]
    keep = (j <= p) if causal else torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    keep = keep.expand(B, Tq, Tk)
    same_block = torch.zeros((), dtype=torch.bool, device=device)
    if causal and block_ids is not None:
        ids = block_ids.to(device)
        valid = (p >= 0) & (p < Tk)
        qb = torch.where(valid, ids[:, p.clamp(0, Tk - 1).squeeze(1)][:, :, None],
                         torch.full((), -1, dtype=ids.dtype, device=device))
        same_block = (qb == ids[:, None, :]) & (qb >= 0)
        if window_bounds_blocks:
            keep = keep | same_block
    if window:
        keep = keep & (j > p - window)
    if chunk:
        if chunk_origin is not None:
            origin = chunk_origin.to(device, torch.int64).reshape(-1, 1, 1)
        elif key_padding_mask is not None:
            origin = (key_padding_mask.to(torch.int64).cumprod(-1)).sum(-1)[:, None, None]
        else:
            origin = torch.zeros(B, 1, 1, dtype=torch.int64, device=device)
        keep = keep & (torch.div(j - origin, chunk, rounding_mode="floor")
                       == torch.div(p - origin, chunk, rounding_mode="floor"))
    if not window_bounds_blocks:
        keep = keep | same_block
    if key_padding_mask is not None:
        keep = keep & ~key_padding_mask[:, None, :]
    return keep


def softcap_logits(logits: Tensor, softcap: Optional[float]) -> Tensor:
    """Gemma 2's logit soft-capping, ``softcap * tanh(logits / softcap)`` (None: unchanged)."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)
