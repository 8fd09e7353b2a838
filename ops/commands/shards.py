"""A resumable folder of shards, as ``collect`` and ``vas`` write them: ``manifest.json``
(what was asked for, checked on resumption, and the SHA-256 of each shard written) and
shards ``shard-NNNNN<suffix>``, shard s holding items ``[s * shard_size, (s + 1) *
shard_size)`` of the command's input in order. A :class:`Layout` names the folder's kind
(``collection.py``: ``collect``'s safetensors shards; ``vas_table.py``: ``vas``'s Parquet
shards). Every file is written atomically (a temporary file in the folder, then a rename),
so a shard is either complete or absent: an interrupted run loses at most the shard it was
writing. Reading checks each shard against its recorded SHA-256, so bytes damaged after the
write are an error naming the shard. Under ``torchrun`` each process makes every
world-size-th shard (``torchrun.py``).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping

from ..io import atomic_path, write_json
from .errors import UsageError
from .torchrun import world

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Layout:
    """A kind of sharded folder: its manifest's format and version, its shards' file
    suffix, the command that writes it (named in the errors), and the manifest fields
    added after folders were written, with the value an older manifest means."""
    format: str
    version: int
    suffix: str
    command: str
    defaults: Mapping[str, Any] = field(default_factory=dict)


def shard_path(folder: Path, index: int, layout: Layout) -> Path:
    return folder / f"shard-{index:05d}{layout.suffix}"


def write_manifest(folder: Path, settings: Dict, layout: Layout) -> None:
    """Writes the manifest, or checks that the one there asked for the same."""
    settings = {"format": layout.format, "version": layout.version, **settings}
    path = folder / MANIFEST
    if path.exists():
        old = read_manifest(folder, layout)
        old = {**layout.defaults, **old}
        differ = sorted(k for k in settings if old.get(k) != settings[k])
        if differ:
            raise UsageError(f"{path}: this folder holds a collection with other settings "
                             f"({', '.join(f'{k}: {old.get(k)!r}, now {settings[k]!r}' for k in differ)}); "
                             f"use another --out, or the same settings to resume")
        return
    write_json(path, {**settings, "checksums": {}})


def read_manifest(folder: Path, layout: Layout) -> Dict:
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


def record_missing_checksums(folder: Path, shards: int, layout: Layout) -> None:
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
