"""What makes a tiny model folder load like a real checkpoint, offline: a real processor
for each family (image processor, a small word-level tokenizer, a chat template, the
image special tokens at the tiny vocabulary's ids, all from the family's ``TinyFamily``:
its ``spec`` and ``processor``), so that :func:`~headscope.hf.testing.tiny_checkpoint` saves
a folder that ``AutoProcessor.from_pretrained(folder)`` and
``AutoModelForImageTextToText.from_pretrained(folder)`` load without a hub; and a DATA
folder of synthetic images (``tiny_dataset``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Union

from ..families import supported_model_types
from ..tokenizer import word_level_tokenizer
from .families import tiny_of
from .tokens import EOS, VOCAB

# Words of the tiny vocabulary, ids 2.. in this order (0 = padding, 1 = unknown); the
# remaining ids up to the special tokens are filler words w<id>.
WORDS = ("user assistant system . , ! ? : a an the this that is are was of and or to in "
         "on at with what where which who how describe image picture photo shows show see "
         "there it its left right top bottom middle center red green blue yellow black white "
         "big small cat dog car tree house person ball box sky road water one two three "
         "color shape near next above below behind front").split()


def _tiny(family: str, who: str):
    """The tests' side (``headscope.hf.testing.families``) of the family of model type
    ``family``; a clear error for any name no family module registers."""
    if family not in supported_model_types():
        raise ValueError(f"headscope.hf.testing.{who}: family must be one of "
                         f"{supported_model_types()}, got {family!r}")
    return tiny_of(family)


def special_tokens(family: str) -> Dict[int, str]:
    """The special tokens of ``family``'s tiny vocabulary, by id (the ids
    :mod:`headscope.hf.testing`'s models use): its family's ``TinySpec.tokens``."""
    return _tiny(family, "special_tokens").spec.by_id()


def tiny_tokenizer(family: str = "qwen2_vl", vocab: int = VOCAB):
    """A word-level tokenizer (:func:`word_level_tokenizer`) of ``vocab`` ids for
    ``family``: padding 0, unknown 1, :data:`WORDS`, filler words, and the family's
    special tokens at the ids of :func:`special_tokens`, its processor's named special
    tokens (``TinySpec.tokenizer_extras``) among them."""
    spec = _tiny(family, "tiny_tokenizer").spec
    special = spec.by_id()
    words = ["<pad>", "<unk>", *WORDS]
    names = [special.get(i, words[i] if i < len(words) else f"w{i}") for i in range(vocab)]
    if len(set(names)) != vocab or max(special) >= vocab:
        raise ValueError(f"headscope.hf.testing.tiny_tokenizer: vocab must be > {max(special)}, "
                         f"got {vocab}")
    return word_level_tokenizer(names, list(special.values()), special[EOS],
                                extra_special_tokens=dict(spec.tokenizer_extras))


def tiny_processor(family: str = "qwen2_vl", *, min_pixels: int = 16 * 16,
                   max_pixels: int = 48 * 48, longest_edge: int = 64, max_tiles: int = 6):
    """The processor of a tiny ``family`` model (:func:`~headscope.hf.testing.tiny_model`'s
    vision sizes), offline: the family's ``TinyFamily.processor`` (its transformers image
    processor, sized to the tiny vision tower), :func:`tiny_tokenizer` and the family's
    chat template. The size options reach the families whose image processors have them:
    Qwen-VL and GLM-4.1V resize pictures to between ``min_pixels`` and ``max_pixels``,
    Mistral 3 to a longest edge of ``longest_edge`` pixels, InternVL and Llama 4 cut them
    into up to ``max_tiles`` tiles. All but LLaVA need torchvision (their processors do in
    transformers 5)."""
    return _tiny(family, "tiny_processor").processor(
        family, tiny_tokenizer(family), min_pixels=min_pixels, max_pixels=max_pixels,
        longest_edge=longest_edge, max_tiles=max_tiles)


def tiny_dataset(path: Union[str, Path], count: int = 4, *, size: tuple = (48, 40),
                 prompt: str = "describe the image .", seed: int = 0) -> Path:
    """Writes a DATA folder for ``python -m headscope collect|eval`` into ``path``:
    ``count`` PNG images of ``size`` (width, height), each a noisy background with one
    coloured rectangle, and ``data.jsonl`` with one line per image
    (``{"image", "prompt", "boxes": {"box": [x0, y0, x1, y1]}}``). Returns the folder."""
    import json

    import numpy as np
    from PIL import Image

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width, height = size
    lines = []
    for i in range(count):
        pixels = rng.integers(0, 80, (height, width, 3), dtype=np.uint8)
        x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        x1, y1 = x0 + width // 3, y0 + height // 3
        pixels[y0:y1, x0:x1] = rng.integers(128, 256, 3, dtype=np.uint8)
        Image.fromarray(pixels).save(path / f"image{i}.png")
        lines.append(json.dumps({"image": f"image{i}.png", "prompt": prompt,
                                 "boxes": {"box": [x0, y0, x1, y1]}}))
    (path / "data.jsonl").write_text("\n".join(lines) + "\n")
    return path
