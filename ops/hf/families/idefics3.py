"""Idefics3 and SmolVLM: a picture is rows x cols tiles plus a global image (the whole
picture downscaled to one tile), each a square grid of ``image_seq_len`` tokens (patches
pixel-shuffled ``scale_factor`` squared to one token), with ``<fake_token_around_image>
<row_i_col_j>`` before each tile, a newline after each row of tiles and
``<fake_token_around_image><global-img>`` before the global image (only the global image
when the picture is not split; each frame of a SmolVLM video is such a picture).

The processor drops each picture's rows and cols; they are read back from the layout of
its prompt string (``get_image_prompt_string``): each tile or global image is one run of
``image_seq_len`` image tokens, two tiles of one row are two marker tokens apart, a new
row of tiles follows a newline, and every picture ends with its global image, whose
``<global-img>`` marker is the token before the last run of image tokens in a row. This
needs a tokenizer that keeps each marker one token and gives the newline a token, as the
models' own tokenizers do; a prompt that does not fit raises."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from .base import Family, register
from .layout import (WHOLE, ImageTokens, View, image_positions, image_runs, patches_per_side,
                     stitch, tile_boxes)

WHO = "headscope.hf.Tracer"


def tile_side(config) -> int:
    """Tokens along each side of one tile (and of the global image)."""
    return patches_per_side(config.vision_config) // int(config.scale_factor)


@register
class Idefics3(Family):
    name = "idefics3"
    titles = ("Idefics3", "SmolVLM")
    model_types = ("idefics3", "smolvlm")
    layout = ("rows x cols tiles plus a global image, each a square token grid (pixel "
              "shuffle), with <row_i_col_j>, newline and <global-img> markers")

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        side = tile_side(config)
        ids = inputs["input_ids"].cpu()
        per_row = image_positions(ids, self.image_token_ids(config))
        return [self._row(ids[b], positions, side) for b, positions in enumerate(per_row)]

    def _row(self, ids: torch.Tensor, positions: torch.Tensor, side: int
             ) -> List[ImageTokens]:
        if not len(positions):
            return []
        runs = image_runs(WHO, positions, side)
        global_marker = int(ids[runs[-1][0] - 1])  # every picture ends with its global image
        pictures, rows = [], []
        for run in runs:
            start = int(run[0])
            if int(ids[start - 1]) == global_marker:
                pictures.append(_picture(rows, run, side, start))
                rows = []
            elif rows and start - int(rows[-1][-1][-1]) == 3:  # <fake><row_i_col_j> apart
                rows[-1].append(run)
            else:
                rows.append([run])
        if rows:
            raise ValueError(f"{WHO}: tiles at positions {int(rows[0][0][0])}.. are not "
                             f"followed by their picture's global image")
        return pictures


def _picture(rows: List[List[torch.Tensor]], global_run: torch.Tensor, side: int,
             start: int) -> ImageTokens:
    """One picture from its tiles' runs (by row) and its global image's run."""
    whole = View("global", global_run, side, side, WHOLE)
    if not rows:
        return ImageTokens((whole,))
    R, C = len(rows), len(rows[0])
    if any(len(r) != C for r in rows) or R * C < 2:
        raise ValueError(f"{WHO}: the tiles before the global image at position {start} do "
                         f"not form a grid of rows x cols >= 2 tiles (tiles per row: "
                         f"{[len(r) for r in rows]})")
    if start - int(rows[-1][-1][-1]) <= 3:
        raise ValueError(f"{WHO}: no newline token between the last tile and the global "
                         f"image at position {start}: the rows of tiles cannot be told apart "
                         f"(a tokenizer that drops newlines?)")
    tiles = tuple(View("tile", run, side, side, box)
                  for run, box in zip([run for row in rows for run in row], tile_boxes(R, C)))
    stitched = stitch(torch.stack([torch.stack(row) for row in rows])).flatten()
    return ImageTokens(tiles + (whole,), View("tiles", stitched, R * side, C * side, WHOLE))
