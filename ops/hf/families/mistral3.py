"""Mistral 3 (Pixtral vision tower): one grid per picture, resized to multiples of
``patch_size * spatial_merge_size`` keeping its aspect ratio, laid out row by row with an
``[IMG_BREAK]`` after each row and ``[IMG_END]`` after the last (markers, not image
tokens); ``image_sizes`` gives each picture's processed size."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .base import Family, missing_input, register
from .layout import ImageTokens, View, image_positions, runs, split_images

WHO = "headscope.hf.Tracer"


@register
class Mistral3(Family):
    name = "mistral3"
    titles = ("Mistral 3",)
    model_types = ("mistral3",)
    layout = ("one grid per picture (its processed size / (patch x merge)), rows separated "
              "by [IMG_BREAK], ended by [IMG_END]")
    # plain generate hands the model the vision output (its per-picture token counts), not
    # image_sizes; each picture's first run of image tokens then gives its width
    input_keys = ("image_sizes", "mm_encoder_outputs")

    def grids(self, config, image_sizes) -> List[Tuple[int, int]]:
        """Each picture's token grid (rows, cols) from its processed ``(height, width)``, as
        the model's projector merges it (``image_sizes // (patch_size * merge)``)."""
        step = int(config.vision_config.patch_size) * int(config.spatial_merge_size)
        return [(int(h) // step, int(w) // step) for h, w in torch.as_tensor(image_sizes).tolist()]

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        sizes = inputs.get("image_sizes")
        encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
        if sizes is not None:
            grids = self.grids(config, sizes)
            counts = [r * c for r, c in grids]
        elif encoded is not None:
            grids, counts = None, [len(t) for t in encoded.pooler_output]
        else:
            raise missing_input(config, "image_sizes")
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = split_images(WHO, per_row, counts)
        grid = iter(grids) if grids is not None else None
        out = []
        for row in pictures:
            images = []
            for positions in row:
                rows, cols = next(grid) if grid is not None else _grid_of_runs(positions)
                _check_rows(positions, rows, cols)
                images.append(ImageTokens((View("base", positions, rows, cols),)))
            out.append(images)
        return out


def _grid_of_runs(positions: torch.Tensor) -> Tuple[int, int]:
    """(rows, cols) of a picture of ``len(positions)`` tokens whose first row is its first
    run of consecutive positions."""
    cols = len(runs(positions)[0])
    if len(positions) % cols:
        raise ValueError(f"{WHO}: a picture of {len(positions)} image tokens does not split "
                         f"into rows of {cols} (its first run of image tokens)")
    return len(positions) // cols, cols


def _check_rows(positions: torch.Tensor, rows: int, cols: int) -> None:
    """A picture's tokens must be ``rows`` runs of ``cols`` consecutive positions, each
    run one marker (``[IMG_BREAK]``) after the last."""
    at = positions.reshape(rows, cols)
    within = bool((at[:, 1:] - at[:, :-1] == 1).all())
    between = bool((at[1:, 0] - at[:-1, -1] == 2).all())
    if not (within and between):
        raise ValueError(f"{WHO}: a picture of {rows}x{cols} tokens is not laid out as "
                         f"{rows} rows of {cols} image tokens, each followed by one break "
                         f"token, in input_ids (image_sizes do not describe input_ids)")
