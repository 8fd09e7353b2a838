"""Kimi K2.5 (``kimi_k25``): a DeepSeek-V3 text decoder (MLA attention, traced on its
latent keys; a mixture of experts) under a MoonViT vision tower. The image processor
shrinks a picture to fit its patch budget (never enlarging it), pads it with black on
the right and bottom to a multiple of ``patch_size * merge_size`` pixels and cuts the
canvas into patches row-major; the tower pools each ``merge_kernel_size`` block of
patches into one token, row-major over the merged grid: one run of ``<|media_pad|>``
tokens per picture, between ``<|media_begin|>``/``<|media_content|>`` and
``<|media_end|>`` text tokens. ``image_grid_thw`` gives the canvas's patch grid; the
picture's own size (which the processor drops) is read back from ``pixel_values``: the
padding is black after normalisation and narrower than one token, so the grid reaches
past the picture by less than one token on the right and bottom."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .base import Family, missing_input, register
from .layout import ImageTokens, View, image_positions, split_images
from .llama4 import content_size
from .qwen_vl import WHO, merged_grids


@register
class KimiK25(Family):
    name = "kimi_k25"
    titles = ("Kimi K2.5",)
    model_types = ("kimi_k25",)
    layout = ("one grid per picture (patches pooled 2x2) over the picture padded right and "
              "bottom, between <|media_begin|> and <|media_end|>")
    input_keys = ("image_grid_thw", "pixel_values")

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        merge = tuple(int(k) for k in config.vision_config.merge_kernel_size)
        grids = merged_grids(config, inputs, merge)
        pixels = inputs.get("pixel_values")
        if pixels is None:
            raise missing_input(config, "pixel_values", " (its padding)")
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = split_images(WHO, per_row, [r * c for r, c in grids])
        boxes = iter(_boxes(pixels.detach().cpu(), inputs["image_grid_thw"].tolist(), merge))
        grid = iter(grids)
        views = [[View("base", p, *next(grid), next(boxes)) for p in row] for row in pictures]
        # the grid reaches past the picture: it is the grid regions cluster on all the same
        return [[ImageTokens((view,), grid=view) for view in row] for row in views]


def _boxes(pixels: torch.Tensor, thw: List[List[int]], merge: Tuple[int, int]) -> List[tuple]:
    """Per picture, the box its token grid covers on the picture: the padded canvas read
    back from ``pixel_values`` ``(patches, C, p, p)`` (each picture's patches row-major),
    the picture its part up to the last row and column that is not all black. The
    processor pads by less than ``merge`` patches, so a picture whose own edge is black
    reads at most that much of it as padding."""
    boxes, start = [], 0
    for _, h, w in thw:
        patches = pixels[start:start + h * w]
        start += h * w
        C, p = patches.shape[1], patches.shape[-1]
        canvas = patches.reshape(h, w, C, p, p).permute(2, 0, 3, 1, 4).reshape(C, h * p, w * p)
        content_h, content_w = content_size(canvas)
        content_h = max(content_h, (h - merge[0]) * p + 1)
        content_w = max(content_w, (w - merge[1]) * p + 1)
        boxes.append((0.0, 0.0, w * p / content_w, h * p / content_h))
    return boxes
