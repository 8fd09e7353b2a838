"""Caption accuracy of a shapes model on held-out scenes."""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .processor import IMAGE_TEXT
from .world import MAX_OBJECTS, PROMPT, describe, match_object, parse_description, scene

# Scene seeds at or above this are never used in training (training uses 0, 1, 2, ...).
HELD_OUT_SEED = 1_000_000_000


def held_out_scenes(count: int, start: int = 0, noise=None,
                    objects: Tuple[int, int] = (1, 4)) -> List[tuple]:
    """``count`` held-out scenes ``(seed, image, objects)``: seeds ``HELD_OUT_SEED +
    start + k`` with ``lo + k % (hi - lo + 1)`` objects for ``objects = (lo, hi)``
    (default 1 to 4, the scenes of the head's measurements)."""
    lo, hi = objects
    if not 1 <= lo <= hi <= MAX_OBJECTS:
        raise ValueError(f"headscope.shapes.held_out_scenes: argument 'objects' must be "
                         f"(lo, hi) with 1 <= lo <= hi <= {MAX_OBJECTS}, got {objects!r}")
    out = []
    for k in range(start, start + count):
        seed = HELD_OUT_SEED + k
        image, objects = scene(seed, lo + k % (hi - lo + 1), noise=noise)
        out.append((seed, image, objects))
    return out


@torch.no_grad()
def describe_images(model, processor, images, max_new_tokens: int = 48,
                    batch_size: int = 32) -> List[str]:
    """The model's greedy descriptions of ``images`` (batched, left padding)."""
    texts = []
    for i in range(0, len(images), batch_size):
        chunk = images[i:i + batch_size]
        inputs = processor(text=[IMAGE_TEXT + PROMPT] * len(chunk), images=list(chunk),
                           return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        texts += processor.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:],
                                                  skip_special_tokens=True)
    return texts


def wilson_interval(successes: int, count: int, z: float = 1.96) -> Tuple[float, float]:
    """Wilson score interval (95% for the default ``z``) of a share ``successes / count``."""
    if count < 1:
        raise ValueError(f"headscope.shapes.wilson_interval: count must be >= 1, got {count}")
    share = successes / count
    centre = (share + z * z / (2 * count)) / (1 + z * z / count)
    half = z * math.sqrt(share * (1 - share) / count + z * z / (4 * count * count)) / \
        (1 + z * z / count)
    return max(0.0, centre - half), min(1.0, centre + half)


def exact_descriptions(scenes: Sequence[tuple], texts: Sequence[str]) -> List[bool]:
    """Per scene ``(seed, image, objects)``: whether its text is the true description."""
    return [text.strip() == describe(objects) for (_, _, objects), text in zip(scenes, texts)]


def caption_accuracy(model, processor, scenes: Iterable[tuple],
                     texts: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """On ``scenes`` ``(seed, image, objects)``: ``exact`` (share of descriptions equal to
    the truth; ``exact_interval95`` its Wilson interval), ``precision`` (share of generated
    sentences naming an object of the image: colour, shape and place), ``recall`` (share of objects named), ``count``, and
    ``colour``/``shape``/``position``: the share of sentences whose attribute equals that
    of the object in the same place of the description order (descriptions with the
    right number of sentences). ``texts``: the model's descriptions, when already made."""
    scenes = list(scenes)
    if texts is None:
        texts = describe_images(model, processor, [image for _, image, _ in scenes])
    exact = sum(exact_descriptions(scenes, texts))
    named = sentences = found = total = 0
    same = {"colour": 0, "shape": 0, "position": 0}
    pairs = 0
    for (_, _, objects), text in zip(scenes, texts):
        parsed = parse_description(text)
        matched = {match_object(p, objects) for p in parsed} - {None}
        sentences += len(parsed)
        named += sum(match_object(p, objects) is not None for p in parsed)
        found += len(matched)
        total += len(objects)
        if len(parsed) == len(objects):
            for p, o in zip(parsed, objects):
                pairs += 1
                for i, key in enumerate(same):
                    same[key] += p is not None and p[i] == getattr(o, key)
    return {"count": len(scenes), "exact": exact / len(scenes),
            "exact_interval95": list(wilson_interval(exact, len(scenes))),
            "precision": named / max(sentences, 1), "recall": found / total,
            **{key: value / max(pairs, 1) for key, value in same.items()}}
