"""Shapes-world scenes as a DATA folder for ``python -m headscope collect|eval``: PNG images
and ``data.jsonl``, one line per image with the prompt and each object's box keyed by its
sentence (a span that says "A red circle at the top left." holds that key); and the shapes
model's answers to held-out scenes, labelled by the world's parser, as a DATA folder for
``python -m headscope vas``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

from ..io import write_text
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
    return _write_lines(out, lines)


def write_answers(out: Path, count: int, start: int = 0, objects: Tuple[int, int] = (1, 4),
                  model_dir=None, progress: bool = True) -> Path:
    """Writes the images of ``count`` held-out scenes of the hallucination measurement
    (:func:`~headscope.shapes.hallucination.described_scenes`: seeds ``1_002_000_000 +
    start + k``, ``objects = (lo, hi)`` objects in turn; 5 to 9 are the hard scenes) and
    one line per scene: the prompt, the model's greedy ``answer``, ``ended`` (false when the
    token limit cut it before its end token), ``hallucinated`` (the answer names something
    the image does not hold, by the world's parser), the scene's ``objects`` count and
    ``seed``. Returns the folder."""
    from .hallucination import described_scenes
    from .model import load
    from .world import hallucinated
    if count < 1:
        raise ValueError(f"headscope.shapes.write_answers: argument 'count' must be >= 1, "
                         f"got {count}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor, _ = load(model_dir, head=False)
    lines = []
    for seed, num_objects, image, truth, inputs, sequences in described_scenes(
            model, processor, count, start, objects, progress=progress):
        tokens = sequences[0, inputs["input_ids"].shape[1]:]
        answer = processor.tokenizer.decode(tokens, skip_special_tokens=True)
        ended = bool(tokens.numel()) and int(tokens[-1]) == processor.tokenizer.eos_token_id
        name = f"scene{seed}.png"
        save_png(image, out / name)
        lines.append(json.dumps({"image": name, "prompt": PROMPT, "answer": answer,
                                 "ended": ended, "hallucinated": hallucinated(answer, truth),
                                 "objects": num_objects, "seed": seed}))
    return _write_lines(out, lines)


def _write_lines(out: Path, lines) -> Path:
    write_text(out / FILE, "\n".join(lines) + "\n")
    return out
