"""InternVL: each picture is a canvas of rows x cols square tiles (the optimal canvas for
its aspect ratio) plus a thumbnail of the whole picture when there is more than one tile,
each tile pixel-shuffled to ``image_seq_length`` tokens, between ``<img>`` and ``</img>``;
the canvas (which the processor drops) is read back from ``pixel_values``' tiles."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .base import Family, missing_input, register
from .layout import ImageTokens, canvas_and_thumbnail, image_positions, patches_per_side, runs

WHO = "headscope.hf.Tracer"


@register
class InternVL(Family):
    name = "internvl"
    titles = ("InternVL",)
    model_types = ("internvl",)
    layout = ("rows x cols tiles on the optimal canvas plus a thumbnail (more than one "
              "tile), each a square token grid after the pixel shuffle, between <img> and "
              "</img>")
    input_keys = ("pixel_values",)

    def side(self, config) -> int:
        """Tokens per side of a tile: its patches per side times the shuffle's ratio."""
        return int(patches_per_side(config.vision_config) * float(config.downsample_ratio))

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        side = self.side(config)
        per_tile = side * side
        pictures = []
        for row in image_positions(inputs["input_ids"], self.image_token_ids(config)):
            pictures.append([])
            for positions in runs(row):
                if len(positions) % per_tile:
                    raise ValueError(f"{WHO}: a picture of {len(positions)} image tokens is "
                                     f"not a whole number of tiles of {per_tile} tokens")
                pictures[-1].append((positions, len(positions) // per_tile))
        return tiled_pictures(config, pictures, side, inputs.get("pixel_values"))


def tiled_pictures(config, pictures: List[List[Tuple[torch.Tensor, int]]], side: int,
                   tiles: Optional[torch.Tensor]) -> List[List[ImageTokens]]:
    """Per batch row, its pictures of GotOcr2's tiles (``canvas_and_thumbnail``) from each
    picture's image positions and its count of tiles (the thumbnail among them), the
    canvases read from ``tiles`` (``pixel_values``, taken in order; None: only pictures of
    one tile can be read), checking that the counts add up."""
    out, used = [], 0
    for row in pictures:
        out.append([])
        for positions, count in row:
            if count > 1 and tiles is None:
                raise missing_input(config, "pixel_values",
                                    " (their tiles give each picture's canvas)")
            mine = tiles[used:used + count] if tiles is not None else None
            if mine is not None and len(mine) != count:
                raise ValueError(f"{WHO}: input_ids hold more tiles than pixel_values")
            used += count
            out[-1].append(canvas_and_thumbnail(positions, count, side, mine))
    if tiles is not None and used != len(tiles):
        raise ValueError(f"{WHO}: pixel_values hold {len(tiles)} tiles but input_ids {used}")
    return out
