"""Faithfulness of region scores against measured ablation effects, per span and per
image: LDS (Spearman across regions), Pearson, subset-level LDS and pointing accuracy (with
the exact expectation of pointing at a uniformly random region as its baseline)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from ..attribution import pearson, spearman
from .shards import Collection


def defined_mean(values: torch.Tensor) -> Optional[float]:
    """Mean over the defined (not NaN) values; None when there is none."""
    values = values[~torch.isnan(values)]
    return float(values.mean()) if values.numel() else None


def lds_per_image(scores: torch.Tensor, effects: torch.Tensor, span_example: torch.Tensor,
                  examples: int) -> torch.Tensor:
    """Per image, the mean over its spans of the Spearman correlation of ``scores`` and
    ``effects`` (S, K) across regions (NaN for an image with none defined)."""
    return per_image(spearman(scores.double(), effects.double(), -1), span_example, examples)


def per_image(values: torch.Tensor, span_example: torch.Tensor, examples: int) -> torch.Tensor:
    """Mean of each example's defined span values, NaN for an example with none."""
    out = torch.full((examples,), math.nan, dtype=torch.float64)
    for e in range(examples):
        mine = values[span_example == e]
        mean = defined_mean(mine)
        if mean is not None:
            out[e] = mean
    return out


def region_centroids(labels: torch.Tensor, rows: int, cols: int, K: int) -> torch.Tensor:
    """(K, 2) centroid (x, y) of each region on the image, in [0, 1] of its width and
    height (NaN for an empty region)."""
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
    """Expected pointing accuracy of a uniformly random region: per case, the share of its
    (non-empty) regions whose centroid lies in the box, averaged over the cases."""
    shares = []
    for _, centroids, box in cases:
        centroids = centroids[~torch.isnan(centroids).any(1)]
        shares.append(float(in_box(*centroids.unbind(1), box).double().mean()))
    return sum(shares) / len(shares) if shares else None


def pointing_cases(data: Collection) -> List[tuple]:
    """(span, centroids (K, 2), normalised box) for every span whose text holds a phrase
    of its example's boxes (case-insensitive)."""
    t = data.tensors
    K = t["effects"].shape[1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64),
                         (t["grid"][:, 0] * t["grid"][:, 1]).cumsum(0)])
    cases = []
    for span in range(data.num_spans):
        e = int(t["span_example"][span])
        text = (data.texts[span] or "").lower()
        for phrase, box in data.boxes[e].items():
            if phrase.lower() in text:
                rows, cols = t["grid"][e].tolist()
                width, height = t["image_size"][e].tolist()
                labels = t["labels"][offsets[e]:offsets[e + 1]]
                cases.append((span, region_centroids(labels, rows, cols, K),
                              (box[0] / width, box[1] / height, box[2] / width,
                               box[3] / height)))
                break
    return cases


def score(data: Collection, scores: torch.Tensor) -> Dict:
    """Every metric of region ``scores`` (S, K) against the collection's effects."""
    t = data.tensors
    effects = t["effects"].double()
    scores = scores.double()
    examples = t["line"].shape[0]
    span_example = t["span_example"]
    lds_image = lds_per_image(scores, effects, span_example, examples)
    out = {"lds": defined_mean(lds_image),
           "lds_per_image": [None if math.isnan(v) else v for v in lds_image.tolist()],
           "lds_pooled": float(spearman(scores.flatten(), effects.flatten(), -1)),
           "pearson": defined_mean(per_image(pearson(scores, effects, -1), span_example,
                                             examples))}
    subsets = t["subsets"][span_example].double()  # (S, M, K)
    if subsets.shape[1] >= 2:
        predicted = torch.einsum("sk,smk->sm", scores, subsets)
        out["subset_lds"] = defined_mean(lds_per_image(predicted, t["subset_effects"],
                                                       span_example, examples))
    else:
        out["subset_lds"] = None
    cases = pointing_cases(data)
    hits = []
    for span, centroids, box in cases:
        hits.append(bool(in_box(*centroids[int(scores[span].argmax())].tolist(), box)))
    out["pointing"] = sum(hits) / len(hits) if hits else None
    out["pointing_spans"] = len(hits)
    return out


def random_baseline(data: Collection) -> Dict:
    """Pointing of a uniformly random region (its expectation, no sampling)."""
    cases = pointing_cases(data)
    return {"pointing": random_pointing(cases), "pointing_spans": len(cases)}
