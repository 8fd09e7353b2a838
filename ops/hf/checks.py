"""The argument checks that ``region_effects`` and its baselines (``gradient_scores``,
``attnlrp_scores``) share: one prompt's inputs and the sequence generated from them, the
answer's spans, the prompt's region ids. ``who`` names the caller in each message."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Tuple

import torch


def describe(x) -> str:
    """A value as an error message shows it: a tensor's dtype and shape, else its type."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def check_sequence(inputs, sequences, who: str) -> Tuple[int, int]:
    """(P, N): the prompt's and the answer's lengths, after checking ``sequences``
    continues the one prompt of ``inputs``."""
    if not isinstance(inputs, Mapping):  # a dict, or a processor's BatchFeature
        raise ValueError(f"{who}: argument 'inputs' must be a mapping of model inputs (what a "
                         f"processor returns), got {type(inputs).__name__}")
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"{who}: argument 'inputs' must hold the input_ids of one prompt "
                         f"(1, P), got {describe(ids)}")
    P = ids.shape[1]
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 \
            or sequences.shape[0] != 1 or sequences.shape[1] <= P:
        raise ValueError(f"{who}: argument 'sequences' must be generate's output (1, P + N) "
                         f"with P = {P} and N >= 1, got {describe(sequences)}")
    if not torch.equal(sequences[0, :P].to(ids.device), ids[0]):
        raise ValueError(f"{who}: argument 'sequences' must start with the prompt's input_ids")
    return P, sequences.shape[1] - P


def span_bounds(spans, N: int, who: str) -> torch.Tensor:
    """(S, 2) int64 [start, end) of each span (objects with start and end, or pairs),
    checked against the answer's N tokens."""
    bounds = []
    for i, span in enumerate(spans):
        if hasattr(span, "start") and hasattr(span, "end"):
            start, end = span.start, span.end
        else:
            try:
                start, end = span
            except (TypeError, ValueError):
                raise ValueError(f"{who}: argument 'spans'[{i}] must have start and end or be "
                                 f"a (start, end) pair, got {span!r:.80}") from None
        if not (0 <= int(start) < int(end) <= N):
            raise ValueError(f"{who}: argument 'spans'[{i}] = [{start}, {end}) must satisfy "
                             f"0 <= start < end <= {N} (the answer's tokens)")
        bounds.append((int(start), int(end)))
    if not bounds:
        raise ValueError(f"{who}: argument 'spans' is empty")
    return torch.tensor(bounds, dtype=torch.int64)


def check_region_ids(region_ids, P: int, who: str) -> torch.Tensor:
    """The prompt's (P,) region ids on the CPU, checked: -1 off the image, at least one
    region."""
    if not isinstance(region_ids, torch.Tensor) or region_ids.dtype != torch.int64 \
            or region_ids.numel() != P or region_ids.dim() not in (1, 2) \
            or (region_ids.dim() == 2 and region_ids.shape[0] != 1):
        raise ValueError(f"{who}: argument 'region_ids' must be an int64 tensor (1, {P}) or "
                         f"({P},), got {describe(region_ids)}")
    rid = region_ids.reshape(-1).cpu()
    if int(rid.min()) < -1 or int(rid.max()) < 0:
        raise ValueError(f"{who}: argument 'region_ids' must hold -1 (not an image token) or "
                         f"regions >= 0, and at least one region")
    return rid
