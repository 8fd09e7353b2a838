"""Gemma 3: each picture is one square grid of ``mm_tokens_per_image`` tokens (the SigLIP
tower's patches average-pooled), between ``<start_of_image>`` and ``<end_of_image>``; the
picture is the processor's resize to the tower's square input. ``token_type_ids`` marks the
image tokens, each picture's tokens attend to each other both ways.

Pan-and-scan (``do_pan_and_scan=True``) cuts a picture whose sides differ enough into 2 or
more crops side by side along its longer side and shows the whole picture first, then each
crop, each resized to the same square grid and set in the text as a picture of its own.
The model inputs keep neither the crop counts nor the pictures' sizes, so the layout comes
from two inputs headscope reads and the model does not take: ``num_crops`` (per picture,
0 when not cut) and ``image_sizes`` (per picture, its ``(height, width)`` in pixels), which
:func:`pan_and_scan_inputs` adds to the processor's output. Without them every grid is read
as a picture of its own."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

from .base import Family, register
from .layout import (Box, ImageTokens, View, image_positions, image_runs, split_images,
                     square_pictures)

WHO = "headscope.hf.Tracer"


@register
class Gemma3(Family):
    name = "gemma3"
    titles = ("Gemma 3",)
    model_types = ("gemma3",)
    layout = ("one square grid per picture (pooled patches), bidirectional inside it; "
              "pan-and-scan: the whole picture, then its crops side by side along the longer "
              "side, one grid each")
    input_keys = layout_keys = ("num_crops", "image_sizes")

    def image_token_ids(self, config) -> Tuple[int, ...]:
        return (int(config.image_token_id),)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        side = math.isqrt(int(config.mm_tokens_per_image))
        ids = self.image_token_ids(config)
        if inputs.get("num_crops") is None:
            return square_pictures(WHO, inputs, ids, side)
        crops, sizes = pan_and_scan_layout(inputs)
        per_row = image_positions(inputs["input_ids"], ids)
        pictures = split_images(WHO, per_row, [(1 + n) * side * side for n in crops])
        layouts = iter(zip(crops, sizes))
        out = []
        for row in pictures:
            images = []
            for positions in row:
                count, (height, width) = next(layouts)
                whole, *cut = image_runs(WHO, positions, side)
                views = [View("global", whole, side, side)]
                views += [View("crop", run, side, side, box)
                          for run, box in zip(cut, crop_boxes(height, width, count))]
                images.append(ImageTokens(tuple(views)))
            out.append(images)
        return out

    def prompt_types(self, model, is_image: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"token_type_ids": is_image.to(torch.int64)}


def pan_and_scan_layout(inputs: Dict[str, Any]) -> Tuple[List[int], List[Tuple[int, int]]]:
    """Each picture's crop count and ``(height, width)``, from the inputs ``num_crops``
    ``(N,)`` and ``image_sizes`` ``(N, 2)``, checked."""
    crops, sizes = inputs["num_crops"], inputs.get("image_sizes")
    if sizes is None:
        raise ValueError(f"{WHO}: num_crops without image_sizes; a pan-and-scan prompt's crops "
                         f"lie where each picture's (height, width) puts them: pass both, as "
                         f"headscope.hf.families.gemma3.pan_and_scan_inputs gives them")
    crops = torch.as_tensor(crops).flatten().tolist()
    sizes = torch.as_tensor(sizes)
    if sizes.dim() != 2 or sizes.shape[1] != 2 or len(sizes) != len(crops):
        raise ValueError(f"{WHO}: image_sizes must be ({len(crops)}, 2), one (height, width) "
                         f"per picture as num_crops counts them, got {tuple(sizes.shape)}")
    if any(n < 0 for n in crops) or bool((sizes < 1).any()):
        raise ValueError(f"{WHO}: num_crops must be >= 0 and image_sizes >= 1, got {crops} "
                         f"and {sizes.tolist()}")
    return crops, [tuple(s) for s in sizes.tolist()]


def crop_boxes(height: int, width: int, count: int) -> List[Box]:
    """The boxes of a ``height x width`` picture's ``count`` pan-and-scan crops, as
    Gemma 3's image processor cuts them: side by side along the longer side (the width
    when the sides are equal), each ``ceil(side / count)`` pixels long but the last, which
    keeps what remains."""
    if count == 0:
        return []
    length = width if width >= height else height
    step = -(-length // count)
    boxes = []
    for i in range(count):
        start, end = i * step, min((i + 1) * step, length)
        if start >= end:
            raise ValueError(f"{WHO}: {count} pan-and-scan crops of a {height}x{width} picture "
                             f"leave crop {i} empty; num_crops or image_sizes does not match "
                             f"the processor's cut")
        lo, hi = start / length, end / length
        boxes.append((lo, 0.0, hi, 1.0) if width >= height else (0.0, lo, 1.0, hi))
    return boxes


def pan_and_scan_inputs(processor, images, text=None, **kwargs):
    """``processor(images=images, text=text, **kwargs)`` (a transformers
    ``Gemma3Processor``; ``do_pan_and_scan=True`` and its settings among ``kwargs``) with
    the two inputs the Tracer needs to place pan-and-scan crops on their picture and the
    processor drops: ``num_crops`` ``(N,)`` int64, each picture's crops as the processor
    set them in the text, and ``image_sizes`` ``(N, 2)`` int64, each picture's
    ``(height, width)``, the batch's N pictures in order. The model does not take them:
    the Tracer withholds them from ``model(**inputs)`` and ``tr.generate(**inputs)``
    (plain ``model.generate`` refuses them)."""
    from transformers.image_utils import get_image_size, make_flat_list_of_images, to_numpy_array
    inputs = processor(images=images, text=text, return_text_replacement_offsets=True, **kwargs)
    replaced = inputs.pop("text_replacement_offsets")
    crops = [r["replacement"].count(processor.boi_token) - 1
             for row in replaced for r in row if r["type"] == "image"]
    sizes = [get_image_size(to_numpy_array(image)) for image in make_flat_list_of_images(images)]
    inputs["num_crops"] = torch.tensor(crops, dtype=torch.int64)
    inputs["image_sizes"] = torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2)
    return inputs
