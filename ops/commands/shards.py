"""The folder ``collect`` writes: ``manifest.json`` (what was asked for, checked on
resumption, and the SHA-256 of each shard written) and shards ``shard-NNNNN.safetensors``,
shard s holding examples ``[s * shard_size, (s + 1) * shard_size)`` of the DATA file in
order. Every file is written atomically (a temporary file in the folder, then a rename),
so a shard is either complete or absent: an interrupted collection loses at most the shard
it was writing. Reading a collection checks each shard against its recorded SHA-256, so
bytes damaged after the write are an error naming the shard.

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

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import torch

from ..features import FEATURE_SETS, feature_blocks
from ..io import atomic_path
from .errors import UsageError

FORMAT = "headscope.collect"
VERSION = 2  # 2: the manifest holds each shard's SHA-256
MANIFEST = "manifest.json"
TENSORS = ("line", "span_example", "span_bounds", "features", "effects", "subsets",
           "subset_effects", "grid", "labels", "image_size", "seconds")
# absent from shards written before they were added (special_only) or without --attnlrp
OPTIONAL_TENSORS = ("special_only", "attnlrp", "attnlrp_seconds")


# manifest fields added after collections were written, with the value an older one means
DEFAULTS = {"feature_set": "attention", "attnlrp": False}


def feature_set(manifest: Dict) -> str:
    """The collection's feature set (``"attention"`` for a manifest without one)."""
    value = manifest.get("feature_set", DEFAULTS["feature_set"])
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


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.safetensors"


def write_manifest(folder: Path, settings: Dict) -> None:
    """Writes the manifest, or checks that the one there asked for the same."""
    settings = {"format": FORMAT, "version": VERSION, **settings}
    path = folder / MANIFEST
    if path.exists():
        old = read_manifest(folder)
        old = {**DEFAULTS, **old}
        differ = sorted(k for k in settings if old.get(k) != settings[k])
        if differ:
            raise UsageError(f"{path}: this folder holds a collection with other settings "
                             f"({', '.join(f'{k}: {old.get(k)!r}, now {settings[k]!r}' for k in differ)}); "
                             f"use another --out, or the same settings to resume")
        return
    _write_json(path, {**settings, "checksums": {}})


def _write_json(path: Path, value) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(value, indent=2) + "\n")


def read_manifest(folder: Path) -> Dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise UsageError(f"{folder}: not a collection (no {MANIFEST}; run "
                         f"`python -m headscope collect` first)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a readable manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("version") != VERSION \
            or not isinstance(manifest.get("checksums"), dict):
        raise UsageError(f"{path}: not a {FORMAT} manifest of version {VERSION} (a "
                         f"collection of an older headscope: collect it again)")
    return manifest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _record_checksums(folder: Path, checksums: Dict[str, str]) -> None:
    """Adds shards' SHA-256 to the manifest. The folder is locked while the manifest is
    read and replaced: under torchrun every process records the shards it writes."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        manifest = read_manifest(folder)
        manifest["checksums"].update(checksums)
        _write_json(folder / MANIFEST, manifest)
    finally:
        os.close(fd)  # releases the lock


def record_missing_checksums(folder: Path, shards: int) -> None:
    """Records the SHA-256 of the complete shards that have none: a run stopped between
    writing a shard and recording it."""
    recorded = read_manifest(folder)["checksums"]
    missing = {p.name: sha256(p) for p in (shard_path(folder, s) for s in range(shards))
               if p.is_file() and p.name not in recorded}
    if missing:
        _record_checksums(folder, missing)


def remove_temporaries(folder: Path) -> None:
    """Temporary files an interrupted run left behind (never a complete shard or
    manifest: those are renamed into place)."""
    for pattern in (".shard-*.tmp", f".{MANIFEST}.*.tmp"):
        for tmp in folder.glob(pattern):
            tmp.unlink(missing_ok=True)


def write_shard(folder: Path, index: int, tensors: Dict[str, torch.Tensor],
                texts: List[str], boxes: List[Dict]) -> None:
    """Writes shard ``index`` and records the SHA-256 of the bytes written."""
    from safetensors.torch import save
    data = save({k: tensors[k].contiguous() for k in TENSORS + OPTIONAL_TENSORS
                 if k in TENSORS or k in tensors},
                metadata={"format": FORMAT, "texts": json.dumps(texts),
                          "boxes": json.dumps(boxes)})
    with atomic_path(shard_path(folder, index)) as tmp:
        Path(tmp).write_bytes(data)
    _record_checksums(folder, {shard_path(folder, index).name: hashlib.sha256(data).hexdigest()})


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
    count = -(-int(manifest["examples"]) // int(manifest["shard_size"]))
    parts: Dict[str, List[torch.Tensor]] = {k: [] for k in TENSORS + OPTIONAL_TENSORS}
    texts, boxes = [], []
    examples = 0
    for index in range(count):
        path = shard_path(folder, index)
        if not path.is_file():
            raise UsageError(f"{path}: missing (the collection is incomplete: rerun "
                             f"`python -m headscope collect` with the same --out to finish it)")
        recorded = manifest["checksums"].get(path.name)
        if recorded is None:
            raise UsageError(f"{path}: no SHA-256 recorded in {MANIFEST} (rerun `python -m "
                             f"headscope collect` with the same --out to record it)")
        if sha256(path) != recorded:
            raise UsageError(f"{path}: damaged (its SHA-256 is not the one recorded when it "
                             f"was written); delete it and rerun `python -m headscope collect` "
                             f"with the same --out to collect it again")
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
    tensors = {k: torch.cat(v) for k, v in parts.items() if len(v) == count}
    return Collection(manifest, tensors, texts, boxes)
