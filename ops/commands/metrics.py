"""Faithfulness of a collection's region scores against its measured ablation effects, per
span and per image: LDS (Spearman across regions), Pearson, subset-level LDS and pointing
accuracy (with the exact expectation of pointing at a uniformly random region as its
baseline), built on :mod:`headscope.metrics`."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from ..attribution import pearson, spearman
from ..metrics import (defined_mean, in_box, lds_per_image, per_image, random_pointing,
                       region_centroids)
from .collection import Collection


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
