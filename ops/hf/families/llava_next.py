"""LLaVA-NeXT: per picture a base view (the picture squashed to the vision tower's square
input) and then the "anyres" tiles stitched into one grid, unpadded to the picture's aspect
ratio, with a newline feature after each of its rows; the newline features sit at
image-token positions of ``input_ids`` and belong to no view. ``image_sizes`` gives each
picture's original (height, width)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .base import Family, missing_input, register
from .layout import WHOLE, Box, ImageTokens, View, image_positions, patches_per_side, split_images

WHO = "headscope.hf.Tracer"

# (name, rows, cols, box, marker tokens after each row, marker tokens after the view)
Piece = Tuple[str, int, int, Box, int, int]


def anyres_tiles(config, height: int, width: int) -> Tuple[int, int, Box]:
    """``(rows, cols, box)`` of the stitched tile grid of a ``height x width`` picture
    after unpadding, as the model's ``get_anyres_image_grid_shape`` and ``unpad_image``
    (and the processor's ``_get_unpadded_features``) derive it; ``box`` is where those
    tokens' cells lie on the picture, from where the image processor put the picture on
    the padded canvas (resized to fit, centred), so an edge row or column that is partly
    padding reaches a little outside [0, 1]."""
    from transformers.image_processing_utils import select_best_resolution
    vision = config.vision_config
    tile = int(vision.image_size)
    side = patches_per_side(vision)
    canvas_h, canvas_w = select_best_resolution([height, width], config.image_grid_pinpoints)
    rows, cols = canvas_h // tile * side, canvas_w // tile * side
    top = left = 0
    # the same expressions as unpad_image, so the same rounding
    if width / height > cols / rows:
        new = int(round(height * (cols / width), 7))
        top = (rows - new) // 2
        rows -= 2 * top
    else:
        new = int(round(width * (rows / height), 7))
        left = (cols - new) // 2
        cols -= 2 * left
    # the picture on the canvas: get_patch_output_size, then _get_padding_size's centring
    if canvas_w / width < canvas_h / height:
        shown_w, shown_h = canvas_w, min(math.ceil(height * (canvas_w / width)), canvas_h)
    else:
        shown_h, shown_w = canvas_h, min(math.ceil(width * (canvas_h / height)), canvas_w)
    x, y = (canvas_w - shown_w) // 2, (canvas_h - shown_h) // 2
    cell = tile / side  # pixels of the canvas per token
    box = ((left * cell - x) / shown_w, (top * cell - y) / shown_h,
           ((left + cols) * cell - x) / shown_w, ((top + rows) * cell - y) / shown_h)
    return rows, cols, box


def token_count(pieces: Sequence[Piece]) -> int:
    """How many image-token positions ``pieces`` take, markers included."""
    return sum(rows * (cols + per_row) + after for _, rows, cols, _, per_row, after in pieces)


def lay_out(positions: torch.Tensor, pieces: Sequence[Piece]) -> ImageTokens:
    """The picture whose image tokens are at ``positions`` (in order): the views of
    ``pieces`` one after the other, each row followed by its marker tokens; the grid is
    the tiles view where there is one, else the first view."""
    views, taken, at = [], [], 0
    for name, rows, cols, box, per_row, after in pieces:
        index = (torch.arange(rows)[:, None] * (cols + per_row) + torch.arange(cols)).flatten()
        views.append(View(name, positions[index + at], rows, cols, box))
        taken.append(index + at)
        at += rows * (cols + per_row) + after
    is_marker = torch.ones(len(positions), dtype=torch.bool)
    is_marker[torch.cat(taken)] = False
    tiles = [v for v in views if v.name == "tiles"]
    return ImageTokens(tuple(views), tiles[0] if tiles else views[0], positions[is_marker])


@register
class LlavaNext(Family):
    name = "llava_next"
    titles = ("LLaVA-NeXT",)
    model_types = ("llava_next",)
    layout = ("base view (the picture squashed to the tower's square), then the anyres tiles "
              "stitched and unpadded to the picture's aspect ratio, a newline after each row")
    input_keys = ("image_sizes",)

    def pieces(self, config, inputs: Dict[str, Any], index: int, height: int, width: int
               ) -> List[Piece]:
        """Picture ``index``'s views and markers in sequence order (``pack_image_features``)."""
        side = patches_per_side(config.vision_config)
        rows, cols, box = anyres_tiles(config, height, width)
        return [("base", side, side, WHOLE, 0, 0), ("tiles", rows, cols, box, 1, 0)]

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        sizes = inputs.get("image_sizes")
        if sizes is None:
            raise missing_input(config, "image_sizes", " (each picture's original size)")
        pieces = [self.pieces(config, inputs, i, int(h), int(w))
                  for i, (h, w) in enumerate(sizes.tolist())]
        counts = [token_count(p) for p in pieces]
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = iter(pieces)
        return [[lay_out(positions, next(pictures)) for positions in row]
                for row in split_images(WHO, per_row, counts)]
