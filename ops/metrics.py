"""Faithfulness metrics of region scores against measured ablation effects: the paper's
LDS (:func:`lds`), per-span LDS averaged per image, pointing at a boxed object (with the exact expectation of pointing at a
uniformly random region), and bootstrap intervals of a mean; and the AUROC of a detector's
scores, overall and within strata (pairs of one stratum only), with bootstrap intervals.

What ``python -m headscope eval`` reports, and what ``headscope.shapes`` and
``python -m headscope synthetic`` measure with (``python -m headscope detector eval`` and
``headscope.shapes`` the AUROC); :func:`lds` (also :func:`headscope.lds`) is the paper's
metric on an ``(n_images, K)`` table (one span per image).
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .attribution import spearman

__all__ = ["LDS", "auroc", "auroc_interval", "auroc_within", "bootstrap_interval",
           "defined_mean", "in_box", "lds", "lds_per_image", "mean_with_interval", "per_image",
           "random_pointing", "region_centroids"]

WHO = "headscope.metrics"


class LDS(NamedTuple):
    overall: Tensor         # Spearman over every (image, region) pair, flattened
    per_image: Tensor       # (n_images,) Spearman across each image's K regions
    per_image_mean: Tensor  # mean of per_image over images with a defined value


def lds(pred: Tensor, actual: Tensor) -> LDS:
    """The paper's linear datamodeling score: Spearman correlation of predicted and
    actual ablation effects, per image across its regions (``(n_images, K)`` inputs, or
    ``(K,)`` for one image) and overall. Images whose predictions or effects are constant
    have an undefined (NaN) score and are left out of the mean."""
    if pred.shape != actual.shape:
        raise ValueError(f"headscope.lds: argument 'actual' must have the shape of 'pred' "
                         f"{tuple(pred.shape)}, got {tuple(actual.shape)}")
    if pred.dim() == 1:
        pred, actual = pred.unsqueeze(0), actual.unsqueeze(0)
    if pred.dim() != 2:
        raise ValueError(f"headscope.lds: argument 'pred' must be (K,) or (n_images, K), got "
                         f"shape {tuple(pred.shape)}")
    per_image = spearman(pred, actual, -1)
    overall = spearman(pred.flatten(), actual.flatten(), -1)
    return LDS(overall, per_image, per_image.nanmean())


def defined_mean(values: torch.Tensor) -> Optional[float]:
    """Mean over the defined (not NaN) values; None when there is none."""
    values = values[~torch.isnan(values)]
    return float(values.mean()) if values.numel() else None


def per_image(values: torch.Tensor, span_example: torch.Tensor, examples: int) -> torch.Tensor:
    """``(examples,)`` float64: the mean of each example's defined span ``values`` (one per
    span; ``span_example`` the example of each span), NaN for an example with none."""
    out = torch.full((examples,), math.nan, dtype=torch.float64)
    for e in range(examples):
        mean = defined_mean(values[span_example == e])
        if mean is not None:
            out[e] = mean
    return out


def lds_per_image(scores: torch.Tensor, effects: torch.Tensor, span_example: torch.Tensor,
                  examples: int) -> torch.Tensor:
    """Per image, the mean over its spans of the Spearman correlation of ``scores`` and
    ``effects`` (S, K) across regions (NaN for an image with none defined)."""
    return per_image(spearman(scores.double(), effects.double(), -1), span_example, examples)


def region_centroids(labels: torch.Tensor, rows: int, cols: int, K: int) -> torch.Tensor:
    """``(K, 2)`` centroid (x, y) of each region on the image, in [0, 1] of its width and
    height (NaN for an empty region); ``labels`` the ``(rows*cols,)`` row-major region of
    each token of the grid."""
    r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
    c = torch.arange(cols, dtype=torch.float64).repeat(rows)
    xy = torch.stack([(c + 0.5) / cols, (r + 0.5) / rows], 1)
    sums = torch.zeros(K, 2, dtype=torch.float64).index_add_(0, labels, xy)
    counts = torch.zeros(K, dtype=torch.float64).index_add_(0, labels,
                                                            torch.ones_like(r))
    return sums / counts.unsqueeze(1)


def in_box(x, y, box):
    """Whether the points (x, y) (numbers or tensors) lie in ``box`` = (x0, y0, x1, y1),
    edges included."""
    x0, y0, x1, y1 = box
    return (x0 <= x) & (x <= x1) & (y0 <= y) & (y <= y1)


def random_pointing(cases: List[tuple]) -> Optional[float]:
    """Expected pointing accuracy of a uniformly random region: per case ``(span,
    centroids (K, 2), box)``, the share of its (non-empty) regions whose centroid lies in
    the box, averaged over the cases; None without cases."""
    shares = []
    for _, centroids, box in cases:
        centroids = centroids[~torch.isnan(centroids).any(1)]
        shares.append(float(in_box(*centroids.unbind(1), box).double().mean()))
    return sum(shares) / len(shares) if shares else None


def bootstrap_interval(values: torch.Tensor, resamples: int = 10_000, level: float = 0.95,
                       seed: int = 0) -> Tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (1-D): the central
    ``level`` share of the means of ``resamples`` resamples with replacement (seeded: the
    same values give the same interval)."""
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    if values.numel() < 2:
        raise ValueError(f"{WHO}.bootstrap_interval: a bootstrap interval needs at least 2 "
                         f"values, got {values.numel()}")
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(values.numel(), (resamples, values.numel()), generator=generator)
    means = values[picks].mean(1)
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return float(low), float(high)


def mean_with_interval(values: torch.Tensor) -> Dict[str, Optional[float]]:
    """``{"mean", "se", "interval95", "n"}``: mean, standard error and bootstrap 95%
    interval of ``values`` (1-D); None where there are too few values (no mean without
    values, no spread with one)."""
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    n = int(values.numel())
    if n < 2:
        return {"mean": float(values.mean()) if n else None, "se": None,
                "interval95": None, "n": n}
    return {"mean": float(values.mean()),
            "se": float(values.std(unbiased=True) / math.sqrt(n)),
            "interval95": list(bootstrap_interval(values)), "n": n}


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> Optional[float]:
    """Area under the ROC curve of ``scores`` for ``labels`` (None with one class)."""
    from sklearn.metrics import roc_auc_score
    if labels.all() or not labels.any():
        return None
    return float(roc_auc_score(labels.numpy(), scores.double().numpy()))


def auroc_within(scores: torch.Tensor, labels: torch.Tensor,
                 strata: torch.Tensor) -> Optional[float]:
    """AUROC over the pairs of a positive and a negative of the same stratum only: the
    probability that a positive scores above a negative of its stratum (ties count half),
    e.g. a hallucinated answer against a faithful one to a scene of the same object count.
    None without such a pair."""
    above = pairs = 0.0
    scores, labels = scores.double(), labels.bool()
    for value in strata.unique():
        same = strata == value
        pos, neg = scores[same & labels], scores[same & ~labels]
        if len(pos) and len(neg):
            diff = pos[:, None] - neg[None, :]
            above += float((diff > 0).sum()) + 0.5 * float((diff == 0).sum())
            pairs += len(pos) * len(neg)
    return above / pairs if pairs else None


def auroc_interval(scores: torch.Tensor, labels: torch.Tensor, rounds: int = 1000,
                   seed: int = 0, strata: Optional[torch.Tensor] = None) -> Optional[list]:
    """The 2.5% and 97.5% quantiles of the AUROC (within ``strata`` when given:
    :func:`auroc_within`) over ``rounds`` resamples with replacement (seeded; resamples
    without a pair to compare are skipped); None when there is no pair to compare."""
    def metric(pick):
        if strata is None:
            return auroc(scores[pick], labels[pick])
        return auroc_within(scores[pick], labels[pick], strata[pick])

    if metric(torch.arange(len(labels))) is None:
        return None
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(rounds):
        pick = torch.randint(len(labels), (len(labels),), generator=generator)
        value = metric(pick)
        if value is not None:
            values.append(value)
    low, high = torch.tensor(values, dtype=torch.float64).quantile(
        torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [low, high]
