"""Llama 4: a picture is resized without distortion to fit a canvas of R x C tiles
(``image_size`` pixels square; the picture fills the canvas's top-left, the rest is
padding), cut into those tiles and, when R x C > 1, followed by a global image (the whole
picture squashed to one tile). Each tile and the global image is a square grid of
``(image_size / patch_size) * pixel_shuffle_ratio`` tokens a side (patches pixel-shuffled
2 x 2 to one token, row-major). Its prompt (``Llama4Processor._prompt_split_image``)::

    <|image_start|> (tile <|tile_x_separator|> ... tile <|tile_y_separator|>) per row
    <|image|> global <|image_end|>

with ``<|patch|>`` (the image token) for every token of a tile. The processor drops the
canvas shape (``aspect_ratios``); it is read back from ``input_ids``: runs of image tokens
one marker apart are tiles of one row, a row ends with ``<|tile_y_separator|>`` (the token
two before the global image, whose ``<|image|>`` marker sits right before it), and a
picture of one tile is that tile alone. The padding (the processor pads with black:
pixels of -1 after its normalisation with mean and std 0.5) is read from ``pixel_values``:
tokens wholly in the padding are markers (region -1) and tiles' boxes are on the picture,
so a picture whose right or bottom edge is pure black reads that edge as padding."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .base import Family, missing_input, register
from .layout import WHOLE, ImageTokens, View, image_positions, image_runs, patches_per_side, stitch

WHO = "headscope.hf.Tracer"
PADDING = -1.0  # black after the Llama 4 image processor's normalisation (mean, std 0.5)


def tile_side(config) -> int:
    """Tokens along each side of one tile (and of the global image)."""
    vision = config.vision_config
    return int(patches_per_side(vision) * float(vision.pixel_shuffle_ratio))


@register
class Llama4(Family):
    name = "llama4"
    titles = ("Llama 4",)
    model_types = ("llama4",)
    layout = ("R x C tiles of a canvas the picture fills without distortion (padding "
              "right and bottom) plus a global image, each a square token grid (pixel "
              "shuffle), with tile x / y separators and <|image|> before the global image")
    input_keys = ("pixel_values",)

    def decoder(self, model) -> torch.nn.Module:
        # get_decoder gives the causal LM around the text model, which holds the layers
        return model.language_model.model

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        pixels = inputs.get("pixel_values")
        if pixels is None:
            raise missing_input(config, "pixel_values", " (its padding)")
        side = tile_side(config)
        ids = inputs["input_ids"].cpu()
        per_row = image_positions(ids, self.image_token_ids(config))
        tiles = iter(pixels.detach().cpu())
        out = []
        for b, positions in enumerate(per_row):
            pictures = []
            for rows, whole in _pictures(ids[b], positions, side, int(config.boi_token_index)):
                cols = len(rows[0]) if rows else 1
                count = len(rows) * cols + 1 if rows else 1  # tiles and the global image
                taken = [next(tiles, None) for _ in range(count)]
                if any(t is None for t in taken):
                    raise ValueError(f"{WHO}: input_ids hold more tiles than pixel_values "
                                     f"({len(pixels)})")
                canvas = [taken[i:i + cols] for i in range(0, max(count - 1, 1), cols)]
                pictures.append(_picture(rows, whole, canvas, side))
            out.append(pictures)
        if next(tiles, None) is not None:
            raise ValueError(f"{WHO}: pixel_values hold {len(pixels)} tiles, more than "
                             f"input_ids lay out")
        return out


def _pictures(ids: torch.Tensor, positions: torch.Tensor, side: int, begin: int):
    """Each picture of one row of ``input_ids`` as (its tiles' runs of positions by row,
    its global image's run); a picture of one tile: ([], that tile's run). Pictures start
    at ``begin`` (``<|image_start|>``)."""
    if not len(positions):
        return []
    runs = image_runs(WHO, positions, side)
    starts = (ids == begin).nonzero().flatten()
    which = torch.searchsorted(starts, torch.stack([run[0] for run in runs]), right=True) - 1
    if bool((which < 0).any()):
        raise ValueError(f"{WHO}: image tokens at position {int(runs[0][0])} before any "
                         f"<|image_start|> (token {begin})")
    out = []
    for k in which.unique_consecutive().tolist():
        mine = [run for run, w in zip(runs, which.tolist()) if w == k]
        *tiles, whole = mine
        if not tiles:
            out.append(([], whole))
            continue
        gaps = [int(b[0]) - int(a[-1]) - 1 for a, b in zip(mine[:-1], mine[1:])]
        if any(g != 1 for g in gaps[:-1]) or gaps[-1] != 2:
            raise ValueError(f"{WHO}: the picture at position {int(starts[k])} is not laid "
                             f"out as tiles one separator apart and <|tile_y_separator|>"
                             f"<|image|> before its global image (gaps {gaps})")
        out.append((_rows(ids, tiles, int(ids[int(whole[0]) - 2])), whole))
    return out


def _rows(ids: torch.Tensor, runs: List[torch.Tensor], y_separator: int
          ) -> List[List[torch.Tensor]]:
    """The tiles' runs cut into rows after each ``<|tile_y_separator|>``; a grid of >= 2
    tiles."""
    rows = [[runs[0]]]
    for run in runs[1:]:
        if int(ids[int(run[0]) - 1]) == y_separator:
            rows.append([run])
        else:
            rows[-1].append(run)
    if len({len(r) for r in rows}) != 1 or len(runs) < 2:
        raise ValueError(f"{WHO}: the tiles at positions {int(runs[0][0])}.. do not form a "
                         f"grid of rows x cols >= 2 tiles (tiles per row: "
                         f"{[len(r) for r in rows]})")
    return rows


def content_size(canvas: torch.Tensor) -> Tuple[int, int]:
    """(height, width) in pixels of the picture on a ``(C, H, W)`` canvas: the rows and
    columns up to the last that is not all padding."""
    is_picture = (canvas.float() != PADDING).any(0)  # (H, W)
    rows = is_picture.any(1).nonzero()
    cols = is_picture.any(0).nonzero()
    if not len(rows):
        return canvas.shape[1], canvas.shape[2]  # an all-black picture: no padding known
    return int(rows[-1]) + 1, int(cols[-1]) + 1


def _picture(rows: List[List[torch.Tensor]], whole: torch.Tensor,
             canvas: List[List[torch.Tensor]], side: int) -> ImageTokens:
    """One picture's views from its tiles' runs (by row; none for a picture of one tile),
    its global image's run (the one tile's, for a picture of one tile) and its tiles'
    pixels (by row)."""
    one_tile = not rows
    if one_tile:
        rows = [[whole]]
    R = len(rows)
    pixels = torch.cat([torch.cat(row, 2) for row in canvas], 1)  # (channels, R*T, C*T)
    T = pixels.shape[1] // R
    h, w = content_size(pixels)
    cell = T / side  # pixels per token side
    shown_rows, shown_cols = int(-(-h // cell)), int(-(-w // cell))  # tokens on the picture
    views, markers = [], []
    for i, row in enumerate(rows):
        for j, run in enumerate(row):
            r = min(max(shown_rows - i * side, 0), side)
            c = min(max(shown_cols - j * side, 0), side)
            grid = run.reshape(side, side)
            markers.append(torch.cat([grid[r:].flatten(), grid[:r, c:].flatten()]))
            if r and c:
                box = (j * T / w, i * T / h, min((j * T + c * cell) / w, 1.0),
                       min((i * T + r * cell) / h, 1.0))
                views.append(View("global" if one_tile else "tile", grid[:r, :c].flatten(),
                                  r, c, box))
    markers = torch.cat(markers).sort().values
    if one_tile:
        return ImageTokens(tuple(views), markers=markers)
    stitched = stitch(torch.stack([torch.stack(row) for row in rows]))
    grid = View("tiles", stitched[:shown_rows, :shown_cols].flatten(), shown_rows, shown_cols)
    return ImageTokens(tuple(views) + (View("global", whole, side, side, WHOLE),), grid, markers)
