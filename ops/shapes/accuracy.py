"""Caption accuracy of a shapes model on held-out scenes, and of the video model on held-out
clips."""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .clips import (CLIP_PROMPT, MAX_CLIP_OBJECTS, ClipSentence, clip, describe_clip,
                    match_clip_object, parse_clip_description)
from .processor import IMAGE_TEXT, VIDEO_TEXT
from .world import MAX_OBJECTS, PROMPT, describe, match_object, parse_description, scene

# Scene seeds at or above this are never used in training (training uses 0, 1, 2, ...).
HELD_OUT_SEED = 1_000_000_000
# Held-out clip seeds, fixed before any video model was measured on them: one range of a
# million seeds per use, disjoint from each other and from every scene range (which all
# lie below HELD_OUT_SEED + 10_000_000). "accuracy": the video model's exact descriptions;
# "dev": developing and choosing attribution settings on clips; "reported": the reported
# attribution numbers, never used to choose anything; "demo": clips shown in demos.
CLIP_SEED_RANGES = {"accuracy": HELD_OUT_SEED + 10_000_000,
                    "dev": HELD_OUT_SEED + 11_000_000,
                    "reported": HELD_OUT_SEED + 12_000_000,
                    "demo": HELD_OUT_SEED + 13_000_000}
CLIP_RANGE_SIZE = 1_000_000
CLIP_OBJECTS = (1, 3)  # objects per held-out clip, cycling: 1, 2, 3, 1, ...


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


def held_out_clips(count: int, start: int = 0, seeds: str = "accuracy", noise=None,
                   objects: Tuple[int, int] = CLIP_OBJECTS) -> List[tuple]:
    """``count`` held-out clips ``(seed, frames, objects)``: seeds ``CLIP_SEED_RANGES[seeds]
    + start + k`` with ``lo + k % (hi - lo + 1)`` objects for ``objects = (lo, hi)``
    (default 1 to 3)."""
    lo, hi = objects
    if seeds not in CLIP_SEED_RANGES:
        raise ValueError(f"headscope.shapes.held_out_clips: argument 'seeds' must be one of "
                         f"{sorted(CLIP_SEED_RANGES)}, got {seeds!r}")
    if not 1 <= lo <= hi <= MAX_CLIP_OBJECTS:
        raise ValueError(f"headscope.shapes.held_out_clips: argument 'objects' must be "
                         f"(lo, hi) with 1 <= lo <= hi <= {MAX_CLIP_OBJECTS}, got {objects!r}")
    if start < 0 or start + count > CLIP_RANGE_SIZE:
        raise ValueError(f"headscope.shapes.held_out_clips: clips {start} .. "
                         f"{start + count - 1} leave the range of {CLIP_RANGE_SIZE} seeds")
    out = []
    for k in range(start, start + count):
        seed = CLIP_SEED_RANGES[seeds] + k
        frames, truth = clip(seed, lo + k % (hi - lo + 1), noise=noise)
        out.append((seed, frames, truth))
    return out


@torch.no_grad()
def describe_images(model, processor, images, max_new_tokens: int = 48,
                    batch_size: int = 32) -> List[str]:
    """The model's greedy descriptions of ``images`` (batched, left padding)."""
    return _describe(model, processor, images, max_new_tokens, batch_size, video=False)


@torch.no_grad()
def describe_clips(model, processor, clips, max_new_tokens: int = 72,
                   batch_size: int = 16) -> List[str]:
    """The video model's greedy descriptions of ``clips`` (each a list of frames; batched,
    left padding)."""
    return _describe(model, processor, clips, max_new_tokens, batch_size, video=True)


def _describe(model, processor, visuals, max_new_tokens: int, batch_size: int,
              video: bool) -> List[str]:
    from .model import _videos
    request = VIDEO_TEXT + CLIP_PROMPT if video else IMAGE_TEXT + PROMPT
    texts = []
    for i in range(0, len(visuals), batch_size):
        chunk = visuals[i:i + batch_size]
        media = _videos(chunk) if video else {"images": list(chunk)}
        inputs = processor(text=[request] * len(chunk), **media, return_tensors="pt",
                           padding=True, padding_side="left")
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


def exact_descriptions(scenes: Sequence[tuple], texts: Sequence[str],
                       truth=describe) -> List[bool]:
    """Per scene ``(seed, image, objects)`` (or clip, with ``truth`` its world's true
    description, :func:`~headscope.shapes.describe_clip`): whether its text is the true
    description."""
    return [text.strip() == truth(objects) for (_, _, objects), text in zip(scenes, texts)]


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
    return _accuracy(scenes, texts, describe, parse_description, match_object,
                     ("colour", "shape", "position"))


def clip_accuracy(model, processor, clips: Iterable[tuple],
                  texts: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """:func:`caption_accuracy` of the video model on ``clips`` ``(seed, frames, objects)``:
    a sentence names an object when everything it says is true of it (colour, shape,
    event, places and quarter), and the attributes compared in description order are
    those of :class:`~headscope.shapes.clips.ClipSentence`."""
    clips = list(clips)
    if texts is None:
        texts = describe_clips(model, processor, [frames for _, frames, _ in clips])
    return _accuracy(clips, texts, describe_clip, parse_clip_description, match_clip_object,
                     ClipSentence._fields)


def _accuracy(items: List[tuple], texts: Sequence[str], truth, parse, match,
              fields: Sequence[str]) -> Dict[str, float]:
    """The scores of :func:`caption_accuracy` of ``texts`` against ``items`` ``(seed,
    visual, objects)``, with the world's ``truth`` (the true description), ``parse`` and
    ``match``; ``fields``: the attributes a parsed sentence holds, in its order."""
    exact = sum(exact_descriptions(items, texts, truth))
    named = sentences = found = total = 0
    same = dict.fromkeys(fields, 0)
    pairs = 0
    for (_, _, objects), text in zip(items, texts):
        parsed = parse(text)
        matched = [match(p, objects) for p in parsed]
        sentences += len(parsed)
        named += sum(o is not None for o in matched)
        found += len(set(matched) - {None})
        total += len(objects)
        if len(parsed) == len(objects):
            for p, o in zip(parsed, objects):
                pairs += 1
                for i, key in enumerate(fields):
                    same[key] += p is not None and p[i] == getattr(o, key)
    return {"count": len(items), "exact": exact / len(items),
            "exact_interval95": list(wilson_interval(exact, len(items))),
            "precision": named / max(sentences, 1), "recall": found / total,
            **{key: value / max(pairs, 1) for key, value in same.items()}}
