"""``python -m headscope eval``: how faithful a fitted head is on a data set, against the raw
features of each block of the feature set as baselines (each region's feature mean over the
L*H layers and heads of the block: raw attention, raw value-norm-weighted attention, or
both for the feature set "both"). The collection must hold the head's feature set: the
same set, or "both" (the head then reads its own block, and both blocks are baselines).

DATA is collected first (``collect``, into ``--work``, resumable; ``--features`` defaults to
the head's feature set) unless it already is a collection. Reported for both scorers: LDS per image and its mean (Spearman across
regions, per span, averaged over an image's spans), the pooled LDS over every
span-region pair, Pearson, the subset-level LDS (predicted joint effect of each random
region set = the sum of its regions' scores) and pointing accuracy (spans whose text holds
a boxed phrase: is the top-scored region's centroid inside the box), beside the pointing
accuracy a uniformly random region has in expectation (per span, the share of regions
whose centroid is inside the box). A collection made with ``--attnlrp`` adds AttnLRP's
scores as a baseline, with its milliseconds per span.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from ..features import FEATURE_BLOCKS, feature_columns, feature_set_holding
from ..head import AttributionHead
from ..io import write_json
from . import collect as _collect
from .errors import UsageError, check_output, given, option, refuse_ignored
from .collection import check_feature_columns, feature_set, read_collection, read_manifest
from .metrics import random_baseline, score
from .models import load_config, model_folder, text_sizes
from .shards import MANIFEST
from .torchrun import rank

ROWS = (("lds", "LDS (mean over images)"), ("lds_pooled", "LDS (pooled)"),
        ("pearson", "Pearson"), ("subset_lds", "subset LDS"), ("pointing", "pointing accuracy"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a transformers model folder, or "
                        "a hub id in the local Hugging Face cache")
    parser.add_argument("--head", required=True, help="a head written by `train`")
    parser.add_argument("--data", required=True,
                        help="DATA (folder with images and a .jsonl file) or a collection")
    parser.add_argument("--report", default="eval_report.json",
                        help="the JSON report (default eval_report.json)")
    parser.add_argument("--work", default=None,
                        help="where DATA is collected (default: <report>.collect/; reused "
                             "and resumed when it exists; not with a collection as --data)")
    parser.set_defaults(collect_options=_collect.add_arguments(parser))


def _head(path: str, num_layers: int, num_heads: int, features: Optional[str]) -> AttributionHead:
    if not Path(path).is_file():
        raise UsageError(f"--head {path}: no such file; allowed: a head written by "
                         f"`python -m headscope train`")
    try:
        return AttributionHead.load(path, num_layers=num_layers, num_heads=num_heads,
                                    feature_set=features)
    except ValueError as e:
        raise UsageError(f"--head {path}: {e}") from e


def _head_on(path: str, num_layers: int, num_heads: int, collected: str) -> AttributionHead:
    """The head, which must read columns the collection's feature set holds."""
    head = _head(path, num_layers, num_heads, None)
    if feature_set_holding([head.feature_set, collected]) != collected:
        _head(path, num_layers, num_heads, collected)  # raises the mismatch, named
    return head


def _regions(regions: int, grid) -> str:
    return f"--regions {regions}" if grid is None else f"--grid {grid}"


def check_collection_options(args, folder: Path, manifest) -> None:
    """With a collection as DATA, the collection options would have no effect: each one
    given must say what the collection was made with, and --model must be its model."""
    refuse_ignored(args, ["work"], "when --data is a collection (nothing is collected)")
    _collect.check_arguments(args)
    if str(Path(args.model).resolve()) != manifest["model"]:
        raise UsageError(f"--model {args.model}: the collection {folder} was made with the "
                         f"model {manifest['model']}; allowed: that model, or DATA (images and "
                         f"a .jsonl file) to collect with this one")
    for name in sorted(given(args) & set(args.collect_options)):
        if name in ("regions", "grid"):
            ours, theirs = (_regions(args.regions, args.grid),
                            _regions(manifest["regions"], manifest["grid"]))
        elif name == "features":  # recorded as the manifest's feature_set
            ours, theirs = f"--features {args.features}", f"--features {feature_set(manifest)}"
        else:
            ours = f"{option(name)} {getattr(args, name)}"
            theirs = f"{option(name)} {manifest[name]}" if name in manifest else None
        if ours != theirs:
            made = "" if theirs is None else f" (it was made with {theirs})"
            raise UsageError(f"{ours}: has no effect when --data is a collection{made}; "
                             f"allowed: leave it out, or give DATA to collect again")


def table(results: dict) -> str:
    """The head, the raw baseline of each feature block and random, one column each."""
    names = ["head", *results["baselines"]]
    scorers = [results[name] for name in names]
    random = results["random"]
    widths = [max(10, len(name) + 2) for name in names]

    def cell(v) -> str:
        return "n/a" if v is None else f"{v:.4f}"
    lines = [f"{'':24}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths)) + f"{'random':>9}"]
    for key, label in ROWS:
        lines.append(f"{label:24}" + "".join(f"{cell(s[key]):>{w}}"
                                             for s, w in zip(scorers, widths))
                     + f"{cell(random[key]) if key in random else '':>9}")
    lines.append(f"{'(pointing spans)':24}" + "".join(f"{s['pointing_spans']:>{w}}"
                                                      for s, w in zip(scorers, widths))
                 + f"{random['pointing_spans']:>9}")
    for name in names:
        if "ms_per_span" in results[name]:
            lines.append(f"{name}: {results[name]['ms_per_span']:.1f} ms per span")
    lines.append(f"LDS per image (line: {' / '.join(names)}):")
    for i, line in enumerate(results["lines"]):
        lines.append(f"  {line:>6}: " + " / ".join(cell(s["lds_per_image"][i]) for s in scorers))
    return "\n".join(lines)


def run(args) -> int:
    check_output(args.report, "--report")
    args.model = str(model_folder(args.model))
    folder = Path(args.data)
    is_collection = (folder / MANIFEST).is_file()
    if is_collection:
        manifest = read_manifest(folder)
        check_collection_options(args, folder, manifest)
        sizes = int(manifest["num_layers"]), int(manifest["num_heads"])
        data_feature_set = feature_set(manifest)
        head = _head_on(args.head, *sizes, data_feature_set)
    else:
        args.out = args.work or str(Path(args.report).with_suffix("")) + ".collect"
        check_output(args.out, "--work", folder=True)
        sizes = text_sizes(load_config(args.model))
        # collect the head's feature set unless told otherwise (then it must hold it)
        if "features" in given(args):
            head = _head_on(args.head, *sizes, args.features)
        else:
            head = _head(args.head, *sizes, None)
            args.features = head.feature_set
    if not is_collection:
        folder, _ = _collect.collect(args)
    if rank() != 0:
        return 0
    data = read_collection(folder)
    features = data.tensors["features"]
    check_feature_columns(data.manifest, features.shape[-1], "eval")
    # a raw baseline per block of L*H columns: its mean over layers and heads
    collected = feature_set(data.manifest)
    raw = FEATURE_BLOCKS[collected]
    posthoc = {}
    if "attnlrp" in data.tensors:
        posthoc["attnlrp"] = score(data, data.tensors["attnlrp"])
        posthoc["attnlrp"]["ms_per_span"] = \
            1e3 * float(data.tensors["attnlrp_seconds"].sum()) / data.num_spans
    with torch.no_grad():
        results = {"head": score(data, head(feature_columns(features, collected,
                                                            head.feature_set))),
                   **{name: score(data, feature_columns(features, collected, name).mean(-1))
                      for name in raw},
                   **posthoc,
                   "baselines": [*raw, *posthoc],
                   "random": random_baseline(data),
                   "lines": data.tensors["line"].tolist(),
                   "spans": data.num_spans, "collection": str(folder),
                   "head_file": str(args.head), "manifest": data.manifest}
    print(table(results))
    write_json(args.report, results)
    print(f"report written to {args.report}")
    return 0
