"""The DATA format of ``collect`` and ``eval``: a folder with images and one JSON Lines
file, one example a line::

    {"image": "a.png", "prompt": "Describe the image.", "boxes": {"cat": [x0, y0, x1, y1]}}

``image`` is a path relative to the JSON Lines file's folder; ``boxes`` (optional) gives
an object's box in the image's pixels for a phrase: the spans whose text holds the
phrase are scored for pointing. Blank lines are skipped; an example is known by its line
number, so the file must not be reordered between a collection and its resumption.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

from ..pictures import PictureError, check_picture, read_picture
from .errors import UsageError

Box = Tuple[float, float, float, float]


@dataclass
class Example:
    line: int              # 1-based line of the JSON Lines file: the example's key
    image: Path
    prompt: str
    boxes: Dict[str, Box] = field(default_factory=dict)


def jsonl_file(data: Path) -> Path:
    """The JSON Lines file of DATA: DATA itself, or the one ``*.jsonl`` in the folder."""
    if data.is_file():
        return data
    if not data.is_dir():
        raise UsageError(f"--data {data}: no such file or folder")
    found = sorted(data.glob("*.jsonl"))
    if len(found) != 1:
        raise UsageError(f"--data {data}: the folder must hold exactly one .jsonl file, found "
                         f"{[p.name for p in found] or 'none'}")
    return found[0]


def json_records(path: Path) -> Iterator[Tuple[int, Dict, str]]:
    """``(line number, JSON object, "file:line")`` of each non-blank line of the JSON Lines
    file ``path``; a line that is no JSON object is an error naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot be read: {e}") from e
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(record, dict):
            raise UsageError(f"{where}: must be a JSON object, got {type(record).__name__}")
        yield number, record, where


def non_empty_string(record: Dict, key: str, where: str) -> str:
    if not isinstance(record.get(key), str) or not record[key]:
        raise UsageError(f"{where}: {key!r} must be a non-empty string")
    return record[key]


def image_file(path: Path, name: str, where: str) -> Path:
    """The image ``name`` of a line of the JSON Lines file ``path`` (relative to its
    folder), which must exist."""
    image = path.parent / name
    if not image.is_file():
        raise UsageError(f"{where}: image {name!r} not found ({image})")
    return image


def read_examples(data: Path) -> List[Example]:
    """Every example of DATA, checked: the error names the file and the line."""
    path = jsonl_file(data)
    examples = []
    for number, record, where in json_records(path):
        image, prompt = (non_empty_string(record, key, where) for key in ("image", "prompt"))
        unknown = sorted(set(record) - {"image", "prompt", "boxes"})
        if unknown:
            raise UsageError(f"{where}: unknown keys {unknown} (expected image, prompt, boxes)")
        examples.append(Example(number, image_file(path, image, where), prompt,
                                _boxes(record.get("boxes", {}), where)))
    if not examples:
        raise UsageError(f"{path}: holds no example")
    return examples


def _boxes(boxes, where: str) -> Dict[str, Box]:
    if not isinstance(boxes, dict):
        raise UsageError(f"{where}: 'boxes' must be an object of phrase: [x0, y0, x1, y1]")
    out = {}
    for phrase, box in boxes.items():
        if not (isinstance(box, list) and len(box) == 4
                and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v) for v in box)
                and box[0] < box[2] and box[1] < box[3]):
            raise UsageError(f"{where}: box of {phrase!r} must be [x0, y0, x1, y1] with "
                             f"x0 < x1 and y0 < y1, got {box!r}")
        out[phrase] = tuple(float(v) for v in box)
    return out


def read_image(path: Path, line: int):
    """The picture ``path`` (of the DATA file's ``line``) as it is seen, upright in RGB
    (``headscope.pictures.read_picture``); an unreadable one is a UsageError naming it."""
    try:
        return read_picture(path)
    except PictureError as e:
        raise UsageError(f"{e.path} (line {line}): {e.reason}") from e


def checked_image_size(path: Path, line: int) -> tuple:
    """(width, height) of the picture ``path`` (of the DATA file's ``line``) as it is seen,
    from its header, the file checked (``headscope.pictures.check_picture``)."""
    try:
        return check_picture(path)
    except PictureError as e:
        raise UsageError(f"{e.path} (line {line}): {e.reason}") from e


def load_image(example: Example):
    """The example's picture, upright in RGB (PIL)."""
    return read_image(example.image, example.line)


def image_size(example: Example) -> tuple:
    """(width, height) of the example's picture as it is seen (checks that it reads)."""
    return checked_image_size(example.image, example.line)
