"""HunYuan-VL (``hunyuan_vl``): each picture is one grid of tokens (the image processor's
patches row-major, merged ``spatial_merge_size`` squared to one token by the patch
merger's convolution), written row by row with a newline feature after each row, between
a begin and an end feature: ``rows * (cols + 1) + 2`` placeholders, all under the image
token id, between the text tokens ``<image_start>`` and ``<image_end>``. The begin, end
and newline slots hold no piece of the picture (markers, region -1). ``image_grid_thw``
gives each picture's patch grid; the 4-axis rope numbers the tokens by the same grid and
a batch's pictures in order on its last axis (so a row's picture in a batch is numbered
otherwise than alone)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from .base import Family, register
from .layout import ImageTokens, View, image_positions, split_images
from .qwen_vl import WHO, merged_grids


@register
class HunYuanVL(Family):
    name = "hunyuan_vl"
    titles = ("HunYuan-VL",)
    model_types = ("hunyuan_vl",)
    layout = ("one grid per picture (patches merged 2x2), a newline slot after each row and "
              "begin and end slots, all placeholders")
    input_keys = ("image_grid_thw",)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        grids = merged_grids(config, inputs)
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = split_images(WHO, per_row, [r * (c + 1) + 2 for r, c in grids])
        grid = iter(grids)
        out = []
        for row in pictures:
            images = []
            for positions in row:
                rows, cols = next(grid)
                lines = positions[1:-1].reshape(rows, cols + 1)
                markers = torch.cat([positions[:1], lines[:, cols], positions[-1:]])
                images.append(ImageTokens((View("base", lines[:, :cols].flatten(), rows, cols),),
                                          markers=markers))
            out.append(images)
        return out
