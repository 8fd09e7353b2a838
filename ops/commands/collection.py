"""The folder ``collect`` writes, a collection: a folder of shards (``shards.py``) whose
shards ``shard-NNNNN.safetensors`` hold examples ``[s * shard_size, (s + 1) * shard_size)``
of the DATA file in order.

The manifest's ``feature_set`` says what the feature columns hold (``AttributionHead``'s
feature sets: ``"attention"``, ``"attention*value_norm"``, F = L*H; ``"both"``, F = 2*L*H);
a manifest without it holds ``"attention"``. One collection holds one feature set: resuming
with another is refused like any other changed setting.

A shard's tensors (E examples, S spans, K regions, F features, M subsets):

| name | shape | what |
| --- | --- | --- |
| ``line`` | (E,) int64 | the example's line in the JSON Lines file |
| ``span_example`` | (S,) int64 | the span's example, an index into ``line`` |
| ``span_bounds`` | (S, 2) int64 | the span's generated tokens ``[start, end)`` |
| ``features`` | (S, K, F) float32 | ``Span.features``: per layer and head, of the feature set |
| ``effects`` | (S, K) float32 | ``region_effects`` of each region on the span |
| ``subsets`` | (E, M, K) bool | the example's random region sets |
| ``subset_effects`` | (S, M) float32 | ``region_effects`` of each set on the span |
| ``grid`` | (E, 2) int64 | the image's token grid (rows, columns) |
| ``labels`` | (sum rows*cols,) int64 | each image token's region, row-major, examples in order |
| ``image_size`` | (E, 2) int64 | the image's width and height in pixels |
| ``seconds`` | (E, 2) float64 | time of generation (with features) and of the ablations |
| ``special_only`` | (S,) bool | the span is only special tokens (the end-of-text span) |
| ``attnlrp`` | (S, K) float32 | ``attnlrp_scores`` of each region for the span (``--attnlrp``) |
| ``attnlrp_seconds`` | (E,) float64 | the time AttnLRP took for the example (``--attnlrp``) |

``special_only`` is absent from shards of collections made before it was recorded, the
``attnlrp`` tensors from collections made without ``--attnlrp``; a collection reads an
optional tensor only when every shard holds it.

Metadata ``texts`` (JSON list of the spans' text) and ``boxes`` (JSON list of each
example's boxes).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import torch

from ..features import FEATURE_SETS, feature_blocks
from . import shards
from .errors import UsageError
from .shards import Layout, checked_shards, write_shard_bytes

FORMAT = "headscope.collect"
VERSION = 2  # 2: the manifest holds each shard's SHA-256
# manifest fields added after collections were written, with the value an older one means
COLLECTION = Layout(FORMAT, VERSION, ".safetensors", "collect",
                    {"feature_set": "attention", "attnlrp": False})
TENSORS = ("line", "span_example", "span_bounds", "features", "effects", "subsets",
           "subset_effects", "grid", "labels", "image_size", "seconds")
# absent from shards written before they were added (special_only) or without --attnlrp
OPTIONAL_TENSORS = ("special_only", "attnlrp", "attnlrp_seconds")

# the folder functions of shards.py, for a collection
shard_path = functools.partial(shards.shard_path, layout=COLLECTION)
write_manifest = functools.partial(shards.write_manifest, layout=COLLECTION)
read_manifest = functools.partial(shards.read_manifest, layout=COLLECTION)


def feature_set(manifest: Dict) -> str:
    """The collection's feature set (``"attention"`` for a manifest without one)."""
    value = manifest.get("feature_set", COLLECTION.defaults["feature_set"])
    if value not in FEATURE_SETS:
        raise UsageError(f"manifest: feature_set must be one of "
                         f"{', '.join(map(repr, FEATURE_SETS))}, got {value!r}")
    return value


def check_feature_columns(manifest: Dict, columns: int, where: str) -> None:
    """The feature columns agree with the manifest's layers, heads and feature set."""
    L, H, fs = int(manifest["num_layers"]), int(manifest["num_heads"]), feature_set(manifest)
    want = feature_blocks(fs) * L * H
    if columns != want:
        raise UsageError(f"{where}: features have {columns} columns; the manifest's "
                         f"{L} layers x {H} heads of feature set {fs!r} make {want}")


def write_shard(folder: Path, index: int, tensors: Dict[str, torch.Tensor],
                texts: List[str], boxes: List[Dict]) -> None:
    """Writes shard ``index`` of a collection and records the SHA-256 of the bytes
    written."""
    from safetensors.torch import save
    data = save({k: tensors[k].contiguous() for k in TENSORS + OPTIONAL_TENSORS
                 if k in TENSORS or k in tensors},
                metadata={"format": FORMAT, "texts": json.dumps(texts),
                          "boxes": json.dumps(boxes)})
    write_shard_bytes(folder, index, data, COLLECTION)


@dataclass
class Collection:
    """Every shard of a collection, joined (spans of all examples, in DATA order)."""
    manifest: Dict
    tensors: Dict[str, torch.Tensor]  # as in a shard; span_example indexes the joined line;
    # an optional tensor only when every shard has it
    texts: List[str]
    boxes: List[Dict]

    @property
    def num_spans(self) -> int:
        return self.tensors["span_example"].shape[0]


def read_collection(folder: Path) -> Collection:
    """Joins the shards of ``folder``; a missing shard or a damaged file (its SHA-256 not
    the recorded one) is an error naming it."""
    from safetensors import safe_open
    manifest = read_manifest(folder)
    paths = checked_shards(folder, manifest, COLLECTION)
    parts: Dict[str, List[torch.Tensor]] = {k: [] for k in TENSORS + OPTIONAL_TENSORS}
    texts, boxes = [], []
    examples = 0
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                shard = {k: f.get_tensor(k) for k in TENSORS + OPTIONAL_TENSORS
                         if k in TENSORS or k in f.keys()}
            shard_texts, shard_boxes = json.loads(meta["texts"]), json.loads(meta["boxes"])
        except Exception as e:  # safetensors raises several types for damaged files
            raise UsageError(f"{path}: not a readable shard (truncated or damaged?): "
                             f"{e}") from e
        shard["span_example"] = shard["span_example"] + examples
        examples += shard["line"].shape[0]
        for k in shard:
            parts[k].append(shard[k])
        texts += shard_texts
        boxes += shard_boxes
    tensors = {k: torch.cat(v) for k, v in parts.items() if len(v) == len(paths)}
    return Collection(manifest, tensors, texts, boxes)
