"""Deletion and insertion curves of region scores on a model: each span's regions are
taken in heat order (score per image token, hottest first), and the effect of removing
each first part of them (deletion), or everything but it (insertion), is measured with
:func:`~headscope.hf.region_effects`, every set of every scorer and span batched in one
call. The AUCs are :func:`headscope.metrics.deletion_auc` and
:func:`~headscope.metrics.insertion_auc`: x the share of image tokens removed (kept), y the
share of the effect of removing every image token; higher is better for both."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..metrics import curve_sets, deletion_auc, heat_order, insertion_auc, per_token
from .checks import check_region_ids, check_sequence
from .effects import region_effects

WHO = "headscope.hf.heat_curves"
TRUE_ORDER = "effects"  # the references: the true single-region effects' heat order
RANDOM_ORDER = "random"  # and uniformly random orders


def region_tokens(region_ids: torch.Tensor, regions: Optional[int] = None) -> torch.Tensor:
    """``(K,)`` int64: the image tokens of each region of the prompt's ``region_ids`` (-1:
    no region); K is ``regions`` where given (regions without tokens count 0), else one
    past the largest id."""
    rid = region_ids.reshape(-1).cpu()
    K = regions if regions is not None else int(rid.max()) + 1
    return torch.bincount(rid[rid >= 0], minlength=K)


def random_orders(spans: int, regions: int, count: int, seed: int) -> torch.Tensor:
    """``(count, spans, regions)`` int64: uniformly random orders of the regions, drawn
    from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(regions, generator=generator) for _ in range(count * spans)]
    return torch.stack(orders).reshape(count, spans, regions) if orders else \
        torch.zeros(count, spans, regions, dtype=torch.int64)


def heat_curves(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                spans: Sequence, region_ids: torch.Tensor, scores: Mapping[str, torch.Tensor],
                *, effects: Optional[torch.Tensor] = None, random: int = 2, seed: int = 0,
                ablation: str = "mask", batch_size: int = 16, progress: bool = False
                ) -> Tuple[Dict[str, Dict[str, torch.Tensor]], torch.Tensor]:
    """Per span, the deletion and insertion AUC of each scorer's heat order.

    Arguments as for :func:`~headscope.hf.region_effects`; ``scores``: each scorer's
    ``(num_spans, K)`` region scores (totals over the region's tokens: the order takes
    them per image token); ``effects``: the spans' ``(num_spans, K)`` single-region effects
    when already measured (else measured here). Beside the scorers, the result holds the
    references: ``"effects"``, the order of the true effects per image token, and
    ``"random"``, the mean over ``random`` uniformly random orders (drawn from ``seed``).

    Returns ``({name: {"deletion": (S,), "insertion": (S,)}}, total)``: the AUCs, float64
    (NaN for a span where removing every image token has no positive effect), and ``(S,)``
    the effect of removing every image token, in nats."""
    P, _ = check_sequence(inputs, sequences, WHO)
    rid = check_region_ids(region_ids, P, WHO)
    tokens = region_tokens(rid)
    K = tokens.numel()
    if effects is None:
        effects = region_effects(model, inputs, sequences, spans, rid, ablation=ablation,
                                 batch_size=batch_size, progress=progress)
    S = effects.shape[0]
    for name, value in scores.items():
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (S, K):
            raise ValueError(f"{WHO}: scores[{name!r}] must be a ({S}, {K}) tensor (spans, "
                             f"regions), got {getattr(value, 'shape', type(value).__name__)}")
    orders = {name: heat_order(per_token(value.detach().cpu(), tokens))
              for name, value in scores.items()}
    orders[TRUE_ORDER] = heat_order(per_token(effects.cpu(), tokens))
    shuffled = random_orders(S, K, random, seed)
    for r in range(random):
        orders[f"{RANDOM_ORDER}{r}"] = shuffled[r]

    # every set any curve removes, each measured once: its row in ``sets``
    index: Dict[bytes, int] = {}
    sets = []
    rows = {}  # (name, span) -> (deletion rows, insertion rows) into sets
    for name, order in orders.items():
        for s in range(S):
            both = []
            for curve in curve_sets(order[s]):
                picks = []
                for removed in curve:
                    key = removed.numpy().tobytes()
                    if key not in index:
                        index[key] = len(sets)
                        sets.append(removed)
                    picks.append(index[key])
                both.append(picks)
            rows[name, s] = both
    _, joint = region_effects(model, inputs, sequences, spans, rid, subsets=torch.stack(sets),
                              ablation=ablation, batch_size=batch_size, progress=progress)
    joint = joint.double()
    everything = index[torch.ones(K, dtype=torch.bool).numpy().tobytes()]
    total = joint[:, everything]
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, order in orders.items():
        deletion = torch.stack([joint[s, rows[name, s][0]] for s in range(S)])
        insertion = torch.stack([joint[s, rows[name, s][1]] for s in range(S)])
        out[name] = {"deletion": deletion_auc(order, tokens, deletion),
                     "insertion": insertion_auc(order, tokens, insertion, total)}
    if random:
        picked = [out.pop(f"{RANDOM_ORDER}{r}") for r in range(random)]
        out[RANDOM_ORDER] = {curve: torch.stack([p[curve] for p in picked]).mean(0)
                             for curve in ("deletion", "insertion")}
    return out, total
