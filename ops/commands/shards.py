"""The folder ``collect`` writes: ``manifest.json`` (what was asked for, checked on
resumption, and the SHA-256 of each shard written) and shards ``shard-NNNNN.safetensors``,
shard s holding examples ``[s * shard_size, (s + 1) * shard_size)`` of the DATA file in
order. ``vas`` writes its folders with the same functions (a :class:`Layout` of its own:
another format and Parquet shards, ``vas_table.py``). Every file is written atomically (a temporary file in the folder, then a rename),
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
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

from ..features import FEATURE_SETS, feature_blocks
from ..io import atomic_path
from .errors import UsageError

FORMAT = "headscope.collect"
VERSION = 2  # 2: the manifest holds each shard's SHA-256
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Layout:
    """A kind of sharded folder: its manifest's format and version, its shards' file
    suffix, and the command that writes it (named in the errors)."""
    format: str
    version: int
    suffix: str
    command: str


COLLECTION = Layout(FORMAT, VERSION, ".safetensors", "collect")
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


def shard_path(folder: Path, index: int, layout: Layout = COLLECTION) -> Path:
    return folder / f"shard-{index:05d}{layout.suffix}"


def write_manifest(folder: Path, settings: Dict, layout: Layout = COLLECTION) -> None:
    """Writes the manifest, or checks that the one there asked for the same."""
    settings = {"format": layout.format, "version": layout.version, **settings}
    path = folder / MANIFEST
    if path.exists():
        old = read_manifest(folder, layout)
        old = {**DEFAULTS, **old}
        differ = sorted(k for k in settings if old.get(k) != settings[k])
        if differ:
            raise UsageError(f"{path}: this folder holds a collection with other settings "
                             f"({', '.join(f'{k}: {old.get(k)!r}, now {settings[k]!r}' for k in differ)}); "
                             f"use another --out, or the same settings to resume")
        return
    write_json(path, {**settings, "checksums": {}})


def write_json(path: Path, value) -> None:
    """``value`` as indented JSON in ``path``, written atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(value, indent=2) + "\n")


def read_manifest(folder: Path, layout: Layout = COLLECTION) -> Dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise UsageError(f"{folder}: not a folder written by `python -m headscope "
                         f"{layout.command}` (no {MANIFEST}; run it first)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a readable manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != layout.format \
            or manifest.get("version") != layout.version \
            or not isinstance(manifest.get("checksums"), dict):
        raise UsageError(f"{path}: not a {layout.format} manifest of version "
                         f"{layout.version} (written by another command or an older "
                         f"headscope: run `python -m headscope {layout.command}` again)")
    return manifest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _record_checksums(folder: Path, checksums: Dict[str, str], layout: Layout) -> None:
    """Adds shards' SHA-256 to the manifest. The folder is locked while the manifest is
    read and replaced: under torchrun every process records the shards it writes."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        manifest = read_manifest(folder, layout)
        manifest["checksums"].update(checksums)
        write_json(folder / MANIFEST, manifest)
    finally:
        os.close(fd)  # releases the lock


def record_missing_checksums(folder: Path, shards: int, layout: Layout = COLLECTION) -> None:
    """Records the SHA-256 of the complete shards that have none: a run stopped between
    writing a shard and recording it."""
    recorded = read_manifest(folder, layout)["checksums"]
    missing = {p.name: sha256(p) for p in (shard_path(folder, s, layout)
                                           for s in range(shards))
               if p.is_file() and p.name not in recorded}
    if missing:
        _record_checksums(folder, missing, layout)


def remove_temporaries(folder: Path) -> None:
    """Temporary files an interrupted run left behind (never a complete shard or
    manifest: those are renamed into place)."""
    for pattern in (".shard-*.tmp", f".{MANIFEST}.*.tmp"):
        for tmp in folder.glob(pattern):
            tmp.unlink(missing_ok=True)


def write_shard_bytes(folder: Path, index: int, data: bytes, layout: Layout) -> None:
    """Writes shard ``index`` (its file's bytes) and records their SHA-256."""
    path = shard_path(folder, index, layout)
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)
    _record_checksums(folder, {path.name: hashlib.sha256(data).hexdigest()}, layout)


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


def checked_shards(folder: Path, manifest: Dict, layout: Layout) -> List[Path]:
    """Every shard of the folder, in order, each checked against the SHA-256 its manifest
    recorded: a missing shard or a damaged file is an error naming it."""
    count = -(-int(manifest["examples"]) // int(manifest["shard_size"]))
    rerun = f"rerun `python -m headscope {layout.command}` with the same --out"
    paths = []
    for index in range(count):
        path = shard_path(folder, index, layout)
        if not path.is_file():
            raise UsageError(f"{path}: missing (the folder is incomplete: {rerun} to "
                             f"finish it)")
        recorded = manifest["checksums"].get(path.name)
        if recorded is None:
            raise UsageError(f"{path}: no SHA-256 recorded in {MANIFEST} ({rerun} to "
                             f"record it)")
        if sha256(path) != recorded:
            raise UsageError(f"{path}: damaged (its SHA-256 is not the one recorded when it "
                             f"was written); delete it and {rerun} to write it again")
        paths.append(path)
    return paths


def world() -> tuple:
    """(rank, world size, distributed module or None) under torchrun, else (0, 1, None)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return 0, 1, None
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), size, dist


def fill_shards(out: Path, layout: Layout, settings: Dict, count: int, shard_size: int,
                start: Callable[[], Callable[[int], Any]],
                write: Callable[[int, List[Any]], None], desc: str, unit: str) -> int:
    """Creates the folder ``out``, or resumes it (its manifest must hold the same
    ``settings``), and makes every shard missing there: shard s of items ``[s *
    shard_size, (s + 1) * shard_size)`` of ``count``, each item made by the function that
    ``start()`` returns (called once, and only when there is work: it loads the model),
    the shard written by ``write(s, items)``, with a progress bar. Under torchrun each
    process takes every world-size-th shard. Returns how many items were there before
    (on rank 0; 0 in the other processes)."""
    from tqdm.auto import tqdm
    shards = math.ceil(count / shard_size)

    def items(shard: int) -> range:
        return range(shard * shard_size, min((shard + 1) * shard_size, count))

    rank, size, dist = world()
    before = 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        remove_temporaries(out)
        write_manifest(out, {**settings, "examples": count, "shard_size": shard_size}, layout)
        record_missing_checksums(out, shards, layout)
        before = sum(len(items(s)) for s in range(shards)
                     if shard_path(out, s, layout).exists())
    if dist is not None:
        dist.barrier()
    todo = [s for s in range(rank, shards, size) if not shard_path(out, s, layout).exists()]
    if todo:
        make = start()
        with tqdm(total=sum(len(items(s)) for s in todo), unit=unit, position=rank,
                  desc=f"{desc} (rank {rank})" if size > 1 else desc) as bar:
            for s in todo:
                made = []
                for i in items(s):
                    made.append(make(i))
                    bar.update(1)
                write(s, made)
    if dist is not None:
        dist.barrier()
    return before


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
