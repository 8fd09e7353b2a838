"""The shapes world: images of coloured shapes on a 3 x 3 grid of places, each with its
true description and boxes, deterministic in a seed.

Every object sits in its own cell of the grid (so its place words are unambiguous), its
centre jittered inside the cell and its size drawn at random, so that neighbours can
overlap. The description names the objects in reading order (cell by cell, top left
first), one sentence each: "A red circle at the top left. A blue square in the centre."
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

IMAGE_SIZE = 96
SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {"red": (220, 40, 40), "green": (40, 165, 60), "blue": (45, 85, 225),
           "yellow": (235, 200, 30), "purple": (145, 60, 195), "orange": (245, 135, 30)}
# Cell (row, col) of the 3 x 3 grid -> its place words and the phrase a sentence uses.
PLACES = {(0, 0): ("top left", "at the top left"), (0, 1): ("top", "at the top"),
          (0, 2): ("top right", "at the top right"), (1, 0): ("left", "on the left"),
          (1, 1): ("centre", "in the centre"), (1, 2): ("right", "on the right"),
          (2, 0): ("bottom left", "at the bottom left"), (2, 1): ("bottom", "at the bottom"),
          (2, 2): ("bottom right", "at the bottom right")}
MAX_OBJECTS = len(PLACES)
PROMPT = "Describe the image."

_CELL = IMAGE_SIZE / 3
_SIZE_RANGE = (18, 29)   # shape extent in pixels (diameter, side)
_JITTER = 6              # centre offset from the cell's centre, pixels
_OUTLINE = (25, 25, 25)
_PHRASE_TO_PLACE = {phrase: words for words, phrase in PLACES.values()}
_SENTENCE = re.compile(r"^An? (\w+) (\w+) ((?:at|on|in) the [\w ]+)$")


@dataclass(frozen=True)
class SceneObject:
    """One object: its shape and colour names, place words (e.g. "top left", "centre")
    and box ``(x0, y0, x1, y1)`` in pixels (inclusive-exclusive)."""
    shape: str
    colour: str
    position: str
    box: Tuple[int, int, int, int]

    @property
    def sentence(self) -> str:
        phrase = next(p for words, p in PLACES.values() if words == self.position)
        article = "An" if self.colour[0] in "aeiou" else "A"
        return f"{article} {self.colour} {self.shape} {phrase}."


def _star(cx: float, cy: float, radius: float) -> List[Tuple[float, float]]:
    points = []
    for i in range(10):
        r = radius if i % 2 == 0 else radius * 0.45
        angle = -np.pi / 2 + i * np.pi / 5
        points.append((cx + r * np.cos(angle), cy + r * np.sin(angle)))
    return points


def draw_shape(draw, shape: str, cx: float, cy: float, size: int,
               fill) -> Tuple[int, int, int, int]:
    """Draws ``shape`` of ``size`` pixels centred at ``(cx, cy)`` with ``draw`` (a PIL
    ``ImageDraw``) and returns its box ``(x0, y0, x1, y1)``, clipped to the image."""
    # A dark outline makes the silhouette the same pixels whatever the colour, which the
    # vision tower's linear patch embedding can pick up directly.
    h = size / 2
    style = dict(fill=fill, outline=_OUTLINE, width=2)
    if shape == "circle":
        draw.ellipse([cx - h, cy - h, cx + h, cy + h], **style)
    elif shape == "square":
        draw.rectangle([cx - h, cy - h, cx + h, cy + h], **style)
    elif shape == "triangle":
        draw.polygon([(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)], **style)
    else:
        draw.polygon(_star(cx, cy, h * 1.15), **style)
        h *= 1.15
    x0, y0 = max(0, int(np.floor(cx - h))), max(0, int(np.floor(cy - h)))
    x1 = min(IMAGE_SIZE, int(np.ceil(cx + h)) + 1)
    y1 = min(IMAGE_SIZE, int(np.ceil(cy + h)) + 1)
    return x0, y0, x1, y1


def background_style(rng) -> Tuple[int, float]:
    """A background's grey level and noise (standard deviation, 0-255 scale) drawn from
    ``rng``: half the backgrounds plain, half with noise up to 12."""
    grey = int(rng.integers(200, 246))
    return grey, float(rng.uniform(0, 12)) if rng.random() < 0.5 else 0.0


def background(rng, grey: int, noise: float):
    """A PIL image (``IMAGE_SIZE`` square, RGB) of plain ``grey`` with Gaussian noise of
    standard deviation ``noise`` drawn from ``rng``."""
    from PIL import Image

    pixels = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), grey, dtype=np.float32)
    if noise > 0:
        pixels += rng.normal(0, noise, pixels.shape).astype(np.float32)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def scene(seed: int, num_objects: int, noise: Optional[float] = None):
    """A PIL image (``IMAGE_SIZE`` square, RGB) of ``num_objects`` shapes and the list of
    its :class:`SceneObject` in description order, deterministic in ``seed``.

    ``noise``: standard deviation (0-255 scale) of Gaussian noise on the background;
    None draws it from the seed (half the images plain, half with noise up to 12)."""
    from PIL import ImageDraw

    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"headscope.shapes.scene: argument 'seed' must be an int >= 0, "
                         f"got {seed!r}")
    if not isinstance(num_objects, (int, np.integer)) or not 1 <= num_objects <= MAX_OBJECTS:
        raise ValueError(f"headscope.shapes.scene: argument 'num_objects' must be an int in "
                         f"[1, {MAX_OBJECTS}], got {num_objects!r}")
    rng = np.random.default_rng([int(seed), int(num_objects)])
    grey, drawn_noise = background_style(rng)
    image = background(rng, grey, drawn_noise if noise is None else float(noise))
    draw = ImageDraw.Draw(image)
    cells = sorted(PLACES)
    chosen = sorted(cells[i] for i in rng.choice(len(cells), num_objects, replace=False))
    objects = []
    for row, col in chosen:
        shape = SHAPES[rng.integers(len(SHAPES))]
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        size = int(rng.integers(*_SIZE_RANGE))
        cx = (col + 0.5) * _CELL + rng.uniform(-_JITTER, _JITTER)
        cy = (row + 0.5) * _CELL + rng.uniform(-_JITTER, _JITTER)
        box = draw_shape(draw, shape, cx, cy, size, COLOURS[colour])
        objects.append(SceneObject(shape, colour, PLACES[(row, col)][0], box))
    return image, objects


def describe(objects) -> str:
    """The true description of a scene's objects: one sentence each, in order."""
    return " ".join(o.sentence for o in objects)


def parse_sentence(sentence: str) -> Optional[Tuple[str, str, str]]:
    """``(colour, shape, position words)`` of one sentence such as "A red circle at the
    top left.", or None when it does not describe an object of the shapes world."""
    m = _SENTENCE.match(sentence.strip().rstrip(".").strip())
    if not m or m.group(1) not in COLOURS or m.group(2) not in SHAPES:
        return None
    position = _PHRASE_TO_PLACE.get(m.group(3))
    return None if position is None else (m.group(1), m.group(2), position)


def parse_description(text: str) -> List[Optional[Tuple[str, str, str]]]:
    """Each sentence of a description parsed with :func:`parse_sentence`, in order."""
    sentences = [s for s in re.split(r"(?<=\.)\s*", text.strip()) if s]
    return [parse_sentence(s) for s in sentences]


def hallucinated(text: str, objects) -> bool:
    """Whether a description names something the image does not hold: it does not parse,
    or one of its sentences names no object of ``objects``."""
    parsed = parse_description(text)
    return not parsed or any(match_object(p, objects) is None for p in parsed)


def match_object(parsed: Optional[Tuple[str, str, str]], objects) -> Optional[SceneObject]:
    """The scene object a parsed sentence names (same colour, shape and place), or None:
    a sentence that names no object of the image is a hallucination."""
    if parsed is None:
        return None
    for o in objects:
        if (o.colour, o.shape, o.position) == parsed:
            return o
    return None
