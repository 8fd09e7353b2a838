"""Ground-truth region ablation effects: how much each generated span's log-likelihood
drops when an image region is ablated, teacher-forced on the generated sequence (the
targets the vStream head is fitted to). The ablations run in
:class:`~headscope.hf.ablation.AblationRunner`.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from .ablation import AblationRunner
from .checks import check_region_ids, check_sequence, describe, span_bounds
from .families import family_of
from .keymask import KeyMask
from .structure import other_mixers

ABLATIONS = ("mask", "mean", "zero")
WHO = "headscope.hf.region_effects"


def region_effects(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                   spans: Sequence, region_ids: torch.Tensor,
                   subsets: Optional[torch.Tensor] = None, ablation: str = "mask",
                   batch_size: int = 8, progress: bool = True
                   ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The effect of ablating each image region on each span of a generated answer.

    ``inputs``: one prompt's model inputs (batch 1, as the processor returns them);
    ``sequences`` ``(1, P + N)``: what ``generate`` returned for them; ``spans``: objects
    with ``start`` and ``end`` (such as :class:`~headscope.hf.Span`) or ``(start, end)``
    pairs of generated-token indices; ``region_ids`` ``(1, P)`` or ``(P,)`` int64, the
    region of each prompt position (-1: not an image token), K = max + 1.

    The effect of region k on span S is ``sum_{t in S} log p(y_t | x, y_<t) -
    log p(y_t | ablate(x, R_k), y_<t)`` (natural log). ``ablation``: ``"mask"`` removes
    the region's tokens from every query's attention in every decoder layer; ``"zero"``
    and ``"mean"`` replace their input embeddings with zeros or with the mean embedding of
    the prompt's image tokens (Qwen3-VL: its deepstack features likewise). Returns a
    ``(num_spans, K)`` float32 tensor; with ``subsets`` (an ``(M, K)`` bool tensor of
    region sets) a pair of it and the ``(num_spans, M)`` effects of ablating each set.
    ``batch_size`` ablations run per forward; ``progress`` shows a tqdm bar.
    """
    if ablation not in ABLATIONS:
        raise ValueError(f"{WHO}: argument 'ablation' must be one of {ABLATIONS}, got "
                         f"{ablation!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{WHO}: argument 'batch_size' must be an int >= 1, got {batch_size!r}")
    P, N = check_sequence(inputs, sequences, WHO)
    bounds = span_bounds(spans, N, WHO)
    rid = check_region_ids(region_ids, P, WHO)
    K = int(rid.max()) + 1
    if subsets is not None:
        if not isinstance(subsets, torch.Tensor) or subsets.dtype != torch.bool \
                or subsets.dim() != 2 or subsets.shape[1] != K:
            raise ValueError(f"{WHO}: argument 'subsets' must be a bool tensor (M, K = {K}), "
                             f"got {describe(subsets)}")
    ablated = torch.eye(K, dtype=torch.bool)
    if subsets is not None:
        ablated = torch.cat([ablated, subsets.cpu()])
    # row 0 keeps every region: the reference runs in the same batches, the same way
    ablated = torch.cat([torch.zeros(1, K, dtype=torch.bool), ablated])
    in_region = rid.unsqueeze(0) == torch.arange(K).unsqueeze(1)  # (K, P)
    removed = (ablated.to(torch.int64) @ in_region.to(torch.int64)) > 0  # (A, P)

    decoder = family_of(model, WHO).decoder(model)
    if ablation == "mask":
        check_all_softmax(decoder)
    with torch.no_grad(), KeyMask(decoder.config) as keymask:
        runner = AblationRunner(model, keymask, inputs, sequences, rid, ablation, P, N,
                                WHO)
        logp = runner.log_probs(removed, batch_size, progress)  # (A, N) float64
    drop = logp[:1] - logp[1:]
    cum = torch.nn.functional.pad(drop.cumsum(1), (1, 0))
    per_span = (cum[:, bounds[:, 1]] - cum[:, bounds[:, 0]]).T.to(torch.float32)  # (S, A-1)
    effects = per_span[:, :K].contiguous()
    if subsets is None:
        return effects
    return effects, per_span[:, K:].contiguous()


def check_all_softmax(decoder) -> None:
    """Raises for a hybrid decoder: the "mask" ablation takes the region's keys out of
    softmax attention, and its other mixers would still carry the region on."""
    others = other_mixers(decoder)
    if others:
        raise NotImplementedError(
            f"{WHO}: ablation='mask' removes a region's keys from softmax attention, but "
            f"decoder layers {others} of {type(decoder).__name__} mix tokens otherwise "
            f"(a gated delta net, a short convolution or linear attention) and would still "
            f"carry the region on; use ablation='zero' or 'mean'")
