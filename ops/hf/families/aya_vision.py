"""Aya Vision: GotOcr2's tiles, as InternVL's: each picture is a canvas of rows x cols
square tiles (the optimal canvas for its aspect ratio) plus a thumbnail of the whole
picture when there is more than one tile, each tile's SigLIP patches pixel-shuffled
``downsample_factor`` squared to one token (row-major). Its prompt
(``AyaVisionProcessor.replace_image_token``)::

    <|START_OF_IMG|> (TILE_k tile) per tile  TILE_GLOBAL thumbnail <|END_OF_IMG|>

with ``<|IMG_PATCH|>`` (the image token) for every token of a tile; a picture of one tile
is ``TILE_GLOBAL`` and that tile alone. Each tile is thus one run of image tokens, and a
picture's last run follows ``TILE_GLOBAL`` (one token, as the models' tokenizer keeps it);
the canvas, which the processor drops, is read back from ``pixel_values``' tiles."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from .base import Family, register
from .internvl import tiled_pictures
from .layout import ImageTokens, image_positions, image_runs, patches_per_side

WHO = "headscope.hf.Tracer"


def tile_side(config) -> int:
    """Tokens along each side of one tile (and of the thumbnail)."""
    return patches_per_side(config.vision_config) // int(config.downsample_factor)


@register
class AyaVision(Family):
    name = "aya_vision"
    titles = ("Aya Vision",)
    model_types = ("aya_vision",)
    layout = ("rows x cols tiles on the optimal canvas plus a thumbnail (more than one "
              "tile), each a square token grid after the pixel shuffle, TILE_k before each "
              "tile, TILE_GLOBAL before the thumbnail")
    input_keys = ("pixel_values",)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        side = tile_side(config)
        ids = inputs["input_ids"].cpu()
        per_row = image_positions(ids, self.image_token_ids(config))
        pictures = [[(torch.cat(runs), len(runs)) for runs in _pictures(ids[b], positions, side)]
                    for b, positions in enumerate(per_row)]
        return tiled_pictures(config, pictures, side, inputs.get("pixel_values"))


def _pictures(ids: torch.Tensor, positions: torch.Tensor, side: int
              ) -> List[List[torch.Tensor]]:
    """One row's pictures, each its tiles' runs of positions in order (the thumbnail
    last): every run is one tile, and a picture ends with the run after ``TILE_GLOBAL``,
    the token before the row's last run."""
    if not len(positions):
        return []
    found = image_runs(WHO, positions, side)
    global_marker = int(ids[int(found[-1][0]) - 1])
    pictures, current = [], []
    for run in found:
        current.append(run)
        if int(ids[int(run[0]) - 1]) == global_marker:
            pictures.append(current)
            current = []
    return pictures
