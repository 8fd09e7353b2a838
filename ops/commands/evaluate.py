"""``python -m headscope eval``: how faithful a fitted head is on a data set, against raw
attention (each region's feature mean over the L*H layers and heads) as the baseline.

DATA is collected first (``collect``, into ``--work``, resumable) unless it already is a
collection. Reported for both scorers: LDS per image and its mean (Spearman across
regions, per span, averaged over an image's spans), the pooled LDS over every
span-region pair, Pearson, the subset-level LDS (predicted joint effect of each random
region set = the sum of its regions' scores) and pointing accuracy (spans whose text holds
a boxed phrase: is the top-scored region's centroid inside the box), beside the pointing
accuracy a uniformly random region has in expectation (per span, the share of regions
whose centroid is inside the box).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from ..attribution import AttributionHead, atomic_path
from . import collect as _collect
from .errors import UsageError
from .metrics import random_baseline, score
from .shards import MANIFEST, read_collection

ROWS = (("lds", "LDS (mean over images)"), ("lds_pooled", "LDS (pooled)"),
        ("pearson", "Pearson"), ("subset_lds", "subset LDS"), ("pointing", "pointing accuracy"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local transformers model folder")
    parser.add_argument("--head", required=True, help="a head written by `train`")
    parser.add_argument("--data", required=True,
                        help="DATA (folder with images and a .jsonl file) or a collection")
    parser.add_argument("--report", default="eval_report.json",
                        help="the JSON report (default eval_report.json)")
    parser.add_argument("--work", default=None,
                        help="where DATA is collected (default: <report>.collect/; reused "
                             "and resumed when it exists)")
    _collect.add_arguments(parser)


def _head(path: str, manifest) -> AttributionHead:
    if not Path(path).is_file():
        raise UsageError(f"--head {path}: no such file")
    try:
        return AttributionHead.load(path, num_layers=int(manifest["num_layers"]),
                                    num_heads=int(manifest["num_heads"]))
    except ValueError as e:
        raise UsageError(str(e)) from e


def table(results: dict) -> str:
    head, attention, random = results["head"], results["attention"], results["random"]

    def cell(v) -> str:
        return "n/a" if v is None else f"{v:.4f}"
    lines = [f"{'':24}{'head':>10}{'attention':>11}{'random':>9}"]
    for key, label in ROWS:
        lines.append(f"{label:24}{cell(head[key]):>10}{cell(attention[key]):>11}"
                     f"{cell(random[key]) if key in random else '':>9}")
    lines.append(f"{'(pointing spans)':24}{head['pointing_spans']:>10}"
                 f"{attention['pointing_spans']:>11}{random['pointing_spans']:>9}")
    lines.append("LDS per image (line: head / attention):")
    for line, h, a in zip(results["lines"], head["lds_per_image"],
                          attention["lds_per_image"]):
        lines.append(f"  {line:>6}: {cell(h)} / {cell(a)}")
    return "\n".join(lines)


def run(args) -> int:
    data_path = Path(args.data)
    if (data_path / MANIFEST).is_file():
        folder = data_path
    else:
        args.out = args.work or str(Path(args.report).with_suffix("")) + ".collect"
        folder = _collect.collect(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    data = read_collection(folder)
    head = _head(args.head, data.manifest)
    features = data.tensors["features"]
    with torch.no_grad():
        results = {"head": score(data, head(features)),
                   "attention": score(data, features.mean(-1)),
                   "random": random_baseline(data),
                   "lines": data.tensors["line"].tolist(),
                   "spans": data.num_spans, "collection": str(folder),
                   "head_file": str(args.head), "manifest": data.manifest}
    print(table(results))
    with atomic_path(args.report) as tmp:
        Path(tmp).write_text(json.dumps(results, indent=2) + "\n")
    print(f"report written to {args.report}")
    return 0
