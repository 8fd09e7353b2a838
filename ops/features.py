"""The feature-set vocabulary: what a span's feature columns hold (:data:`FEATURE_SETS`),
each set's blocks of ``L*H`` columns (:data:`FEATURE_BLOCKS`), and taking one set's
columns out of another's (:func:`feature_columns`). Shared by the tracer, the collection
commands and :class:`~headscope.AttributionHead`."""
from typing import Iterable

import torch
from torch import Tensor

__all__ = ["FEATURE_BLOCKS", "FEATURE_SETS", "check_feature_set", "feature_blocks",
           "feature_columns", "feature_set_holding"]

# What the columns hold: the attention mass on a region, that mass with each key weighted by
# its value norm ||v_j W_O^h|| (key_weights), or both ([attention | attention*value_norm]).
# Heads and collections without the field hold "attention".
FEATURE_SETS = ("attention", "attention*value_norm", "both")
# Each set's blocks of L*H columns, in column order.
FEATURE_BLOCKS = {"attention": ("attention",), "attention*value_norm": ("attention*value_norm",),
                  "both": ("attention", "attention*value_norm")}


def check_feature_set(where: str, feature_set: str) -> None:
    if feature_set not in FEATURE_SETS:
        raise ValueError(f"{where}: feature_set must be one of "
                         f"{', '.join(map(repr, FEATURE_SETS))}, got {feature_set!r}")


def feature_blocks(feature_set: str) -> int:
    """Blocks of L*H columns of a feature set: 2 for "both", else 1."""
    return len(FEATURE_BLOCKS[feature_set])


def feature_set_holding(sets: Iterable[str]) -> str:
    """The feature set whose columns hold every set of ``sets``: their common set, else
    "both" (e.g. a head's set and the attention block of a raw-attention baseline)."""
    sets = set(sets)
    for feature_set in sets:
        check_feature_set("feature_set_holding", feature_set)
    return sets.pop() if len(sets) == 1 else "both"


def feature_columns(features: Tensor, feature_set: str, wanted: str) -> Tensor:
    """The columns of feature set ``wanted`` out of ``features`` ``(..., F)`` of
    ``feature_set``: its blocks of L*H columns in its order (e.g. the attention block of
    "both", or a single block's raw baseline input). Every block of ``wanted`` must be one
    of ``feature_set``'s."""
    check_feature_set("feature_columns", feature_set)
    check_feature_set("feature_columns", wanted)
    have, want = FEATURE_BLOCKS[feature_set], FEATURE_BLOCKS[wanted]
    missing = [b for b in want if b not in have]
    if missing:
        raise ValueError(f"feature_columns: features of set {feature_set!r} (blocks "
                         f"{list(have)}) have no {missing[0]!r} block, which set {wanted!r} "
                         f"needs; collect or trace with features={wanted!r} or 'both'")
    if features.shape[-1] % len(have):
        raise ValueError(f"feature_columns: {features.shape[-1]} columns do not split into "
                         f"the {len(have)} blocks of feature set {feature_set!r}")
    if have == want:
        return features
    width = features.shape[-1] // len(have)
    return torch.cat([features[..., have.index(b) * width:(have.index(b) + 1) * width]
                      for b in want], -1)
