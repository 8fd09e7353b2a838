"""The shapes world in time: clips of ``FRAMES`` frames in which shapes stay, appear,
disappear or move, each with its true description and, per sentence, the object's box on
every frame and the frames where the named event happens; deterministic in a seed.

A clip is ``QUARTERS`` quarters of ``FRAMES_PER_QUARTER`` frames: exactly the frame pairs
that Qwen2-VL's video processor merges into one temporal patch (``temporal_patch_size``
2), so a quarter is the finest time the model can tell apart, and every event happens
inside one quarter:

- **stays**: the object is there on every frame ("A red circle at the top left.");
- **appears**: absent before the quarter's second frame, there from it on ("A blue square
  appears at the bottom right in the third quarter.");
- **disappears**: there up to the quarter's first frame, absent after it ("A green star
  disappears from the centre in the first quarter.");
- **moves**: in its first cell before the quarter, halfway to a neighbouring cell on the
  quarter's first frame, in that cell from its second frame on ("A red circle moves from
  the top left to the centre in the second quarter.").

So each change happens between a quarter's two frames.

Every object keeps the cells it is ever in (its first, and for a move its last) to itself;
the description names the objects in reading order of their first cells, one sentence each.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

from .world import COLOURS, IMAGE_SIZE, PLACES, SHAPES, background, background_style, \
    draw_shape, parse_sentence

FRAMES = 8
FPS = 4  # frames per second of the clip's timeline: a clip lasts 2 s, a quarter 0.5 s
QUARTERS = 4
FRAMES_PER_QUARTER = FRAMES // QUARTERS
EVENTS = ("stays", "appears", "disappears", "moves")
QUARTER_WORDS = ("first", "second", "third", "fourth")
MAX_CLIP_OBJECTS = 4
CLIP_PROMPT = "Describe the video."
# Mixed into the seed, so that clip(seed, n) draws from another stream than scene(seed, n).
_STREAM = 2
_CELL = IMAGE_SIZE / 3
_SIZE_RANGE = (18, 29)
_JITTER = 6
_WORDS_TO_CELL = {words: cell for cell, (words, _) in PLACES.items()}
_PHRASE_OF = {words: phrase for words, phrase in PLACES.values()}
_PHRASE_TO_WORDS = {phrase: words for words, phrase in PLACES.values()}
_QUARTER = r"in the (\w+) quarter"
_SENTENCES = {
    "appears": re.compile(rf"^An? (\w+) (\w+) appears ((?:at|on|in) the [\w ]+?) {_QUARTER}$"),
    "disappears": re.compile(rf"^An? (\w+) (\w+) disappears from the ([\w ]+?) {_QUARTER}$"),
    "moves": re.compile(rf"^An? (\w+) (\w+) moves from the ([\w ]+?) to the ([\w ]+?) "
                        rf"{_QUARTER}$"),
}

Box = Tuple[int, int, int, int]


class ClipSentence(NamedTuple):
    """What one sentence of a clip's description says: the object's colour and shape, the
    event (one of ``EVENTS``), the place words of its first cell and of its last (the same
    but for "moves") and the quarter of the event (None for "stays")."""
    colour: str
    shape: str
    event: str
    position: str
    to_position: str
    quarter: Optional[int]


@dataclass(frozen=True)
class ClipObject:
    """One object of a clip: what its sentence says (see :class:`ClipSentence`) and its box
    ``(x0, y0, x1, y1)`` in pixels on every frame (None on the frames it is not on)."""
    shape: str
    colour: str
    event: str
    position: str
    to_position: str
    quarter: Optional[int]
    boxes: Tuple[Optional[Box], ...]

    @property
    def said(self) -> ClipSentence:
        return ClipSentence(self.colour, self.shape, self.event, self.position,
                            self.to_position, self.quarter)

    @property
    def sentence(self) -> str:
        article = "An" if self.colour[0] in "aeiou" else "A"
        subject = f"{article} {self.colour} {self.shape}"
        if self.event == "stays":
            return f"{subject} {_PHRASE_OF[self.position]}."
        when = f"in the {QUARTER_WORDS[self.quarter]} quarter"
        if self.event == "appears":
            return f"{subject} appears {_PHRASE_OF[self.position]} {when}."
        if self.event == "disappears":
            return f"{subject} disappears from the {self.position} {when}."
        return f"{subject} moves from the {self.position} to the {self.to_position} {when}."

    @property
    def frames(self) -> Tuple[int, ...]:
        """The frames the object is on."""
        return tuple(f for f, box in enumerate(self.boxes) if box is not None)

    @property
    def event_frames(self) -> Tuple[int, ...]:
        """The frames where the sentence's event happens: its quarter's frames (every frame
        for "stays")."""
        if self.quarter is None:
            return tuple(range(FRAMES))
        first = self.quarter * FRAMES_PER_QUARTER
        return tuple(range(first, first + FRAMES_PER_QUARTER))

    def record(self) -> dict:
        """The object as JSON: its sentence, what the sentence says, the event's frames and
        the box on every frame (null where it is not on the frame)."""
        return {"sentence": self.sentence, **self.said._asdict(),
                "event_frames": list(self.event_frames),
                "boxes": [None if b is None else list(b) for b in self.boxes]}


def _neighbours(cell: Tuple[int, int]) -> List[Tuple[int, int]]:
    row, col = cell
    return [(r, c) for r in range(row - 1, row + 2) for c in range(col - 1, col + 2)
            if (r, c) != cell and 0 <= r < 3 and 0 <= c < 3]


def _centre(cell: Tuple[int, int], rng) -> np.ndarray:
    row, col = cell
    return np.array([(col + 0.5) * _CELL + rng.uniform(-_JITTER, _JITTER),
                     (row + 0.5) * _CELL + rng.uniform(-_JITTER, _JITTER)])


def _centre_on(frame: int, event: str, quarter: Optional[int], start, end):
    """The object's centre on ``frame`` (None: not on it)."""
    if event == "stays":
        return start
    first = quarter * FRAMES_PER_QUARTER
    if event == "appears":
        return start if frame > first else None
    if event == "disappears":
        return start if frame <= first else None
    if frame < first:
        return start
    return (start + end) / 2 if frame == first else end


def clip(seed: int, num_objects: int, noise: Optional[float] = None):
    """``(frames, objects)``: a list of ``FRAMES`` PIL images (``IMAGE_SIZE`` square, RGB) of
    ``num_objects`` shapes that stay, appear, disappear or move, and the list of their
    :class:`ClipObject` in description order, deterministic in ``seed`` and
    ``num_objects``. Each event is equally likely, and its quarter; a move goes to a
    neighbouring cell (diagonals included) that no other object uses, and an object with
    no such cell left draws another event.

    ``noise``: standard deviation (0-255 scale) of the background's Gaussian noise, drawn
    afresh on every frame; None draws it from the seed (half the clips plain, half with
    noise up to 12). The objects do not depend on it."""
    from PIL import ImageDraw

    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"headscope.shapes.clip: argument 'seed' must be an int >= 0, "
                         f"got {seed!r}")
    if not isinstance(num_objects, (int, np.integer)) or not 1 <= num_objects <= \
            MAX_CLIP_OBJECTS:
        raise ValueError(f"headscope.shapes.clip: argument 'num_objects' must be an int in "
                         f"[1, {MAX_CLIP_OBJECTS}], got {num_objects!r}")
    rng = np.random.default_rng([int(seed), int(num_objects), _STREAM])
    grey, drawn_noise = background_style(rng)
    cells = sorted(PLACES)
    starts = sorted(cells[i] for i in rng.choice(len(cells), num_objects, replace=False))
    taken = set(starts)
    drawn = []  # (shape, colour, size, event, quarter, first cell, last cell, centres)
    for start in starts:
        shape = SHAPES[rng.integers(len(SHAPES))]
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        size = int(rng.integers(*_SIZE_RANGE))
        event = EVENTS[rng.integers(len(EVENTS))]
        quarter = int(rng.integers(QUARTERS))
        end = start
        if event == "moves":
            free = [c for c in _neighbours(start) if c not in taken]
            if free:
                end = free[rng.integers(len(free))]
                taken.add(end)
            else:
                event = EVENTS[rng.integers(len(EVENTS) - 1)]  # any event but a move
        a, b = _centre(start, rng), _centre(end, rng)
        drawn.append((shape, colour, size, event, None if event == "stays" else quarter,
                      start, end, a, b))
    noise = drawn_noise if noise is None else float(noise)
    frames, boxes = [], [[] for _ in drawn]
    for f in range(FRAMES):
        image = background(rng, grey, noise)
        draw = ImageDraw.Draw(image)
        for i, (shape, colour, size, event, quarter, _, _, a, b) in enumerate(drawn):
            centre = _centre_on(f, event, quarter, a, b)
            boxes[i].append(None if centre is None else
                            draw_shape(draw, shape, *centre, size, COLOURS[colour]))
        frames.append(image)
    objects = [ClipObject(shape, colour, event, PLACES[start][0], PLACES[end][0], quarter,
                          tuple(boxes[i]))
               for i, (shape, colour, _, event, quarter, start, end, _, _) in enumerate(drawn)]
    return frames, objects


def describe_clip(objects) -> str:
    """The true description of a clip's objects: one sentence each, in order."""
    return " ".join(o.sentence for o in objects)


def parse_clip_sentence(sentence: str) -> Optional[ClipSentence]:
    """What one sentence such as "A red circle moves from the top left to the centre in the
    second quarter." says (a :class:`ClipSentence`), or None when it does not describe an
    object of a clip."""
    text = sentence.strip().rstrip(".").strip()
    still = parse_sentence(text)
    if still is not None:
        colour, shape, position = still
        return ClipSentence(colour, shape, "stays", position, position, None)
    for event, pattern in _SENTENCES.items():
        m = pattern.match(text)
        if m is None:
            continue
        colour, shape, *places, quarter = m.groups()
        if event == "appears":  # "at the top left": the phrase a still sentence uses
            places = [_PHRASE_TO_WORDS.get(places[0])]
        first, last = places[0], places[-1]
        if colour not in COLOURS or shape not in SHAPES or quarter not in QUARTER_WORDS or \
                first not in _WORDS_TO_CELL or last not in _WORDS_TO_CELL:
            return None
        return ClipSentence(colour, shape, event, first, last, QUARTER_WORDS.index(quarter))
    return None


def parse_clip_description(text: str) -> List[Optional[ClipSentence]]:
    """Each sentence of a clip's description parsed with :func:`parse_clip_sentence`, in
    order."""
    sentences = [s for s in re.split(r"(?<=\.)\s*", text.strip()) if s]
    return [parse_clip_sentence(s) for s in sentences]


def match_clip_object(parsed: Optional[ClipSentence], objects) -> Optional[ClipObject]:
    """The clip object a parsed sentence names (colour, shape, event, places and quarter
    all equal), or None: a sentence that is true of no object of the clip."""
    if parsed is None:
        return None
    return next((o for o in objects if o.said == parsed), None)


def clip_words() -> List[str]:
    """The words that clip descriptions and the clip prompt add to the picture world's."""
    return ["appears", "disappears", "moves", "from", "to", *QUARTER_WORDS, "quarter",
            "video"]
