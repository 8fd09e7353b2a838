"""Shapes-world scenes as a DATA folder for ``python -m headscope collect|eval``: PNG images
and ``data.jsonl``, one line per image with the prompt and each object's box keyed by its
sentence (a span that says "A red circle at the top left." holds that key)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..io import atomic_path
from .figures import save_png
from .world import PROMPT, scene

FILE = "data.jsonl"


def write_dataset(out: Path, first_seed: int, count: int, noise: Optional[float] = None) -> Path:
    """Writes scenes ``first_seed + k`` (``1 + k % 4`` objects) for k < ``count`` into
    ``out``. Returns the folder."""
    if count < 1:
        raise ValueError(f"headscope.shapes.write_dataset: argument 'count' must be >= 1, "
                         f"got {count}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for k in range(count):
        seed = first_seed + k
        image, objects = scene(seed, 1 + k % 4, noise=noise)
        name = f"scene{seed}.png"
        save_png(image, out / name)
        lines.append(json.dumps({"image": name, "prompt": PROMPT,
                                 "boxes": {o.sentence: list(o.box) for o in objects}}))
    with atomic_path(out / FILE) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n")
    return out
