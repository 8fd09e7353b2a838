"""Gemma 4: each picture is one grid of tokens between ``<start_of_image>`` and
``<end_of_image>``, at its own resolution. The image processor resizes a picture, keeping
its aspect ratio, to the largest size within its patch budget whose sides are multiples of
``pooling_kernel_size * patch_size`` pixels, cuts it into patches row-major and pads them
to the budget (``image_position_ids``: each patch's ``(x, y)``, padding ``(-1, -1)``); the
vision tower average-pools each ``k x k`` block of patches into one token, the tokens
row-major over the picture. ``mm_token_type_ids`` marks the image tokens: the sliding
layers see each picture's tokens both ways (within their window to the left), the full
layers causally; the Tracer reads both from the masks transformers builds."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .base import Family, missing_input, register
from .layout import ImageTokens, grid_pictures

WHO = "headscope.hf.Tracer"


@register
class Gemma4(Family):
    name = "gemma4"
    titles = ("Gemma 4",)
    model_types = ("gemma4",)
    layout = ("one grid per picture at its own aspect ratio (patches pooled k x k), between "
              "begin and end of image; bidirectional inside it on the sliding layers")
    input_keys = ("image_position_ids",)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        patches = inputs.get("image_position_ids")
        if patches is None:
            raise missing_input(config, "image_position_ids")
        pooling = int(config.vision_config.pooling_kernel_size)
        grids = [picture_grid(p, pooling) for p in torch.as_tensor(patches).cpu()]
        return grid_pictures(WHO, inputs["input_ids"], self.image_token_ids(config), grids)

    def final_softcap(self, config) -> Optional[float]:
        return config.get_text_config().final_logit_softcapping


def picture_grid(patches: torch.Tensor, pooling: int) -> Tuple[int, int]:
    """``(rows, cols)`` of the tokens of one picture whose patches are ``patches``
    ``(max_patches, 2)`` (each its ``(x, y)``, padding ``(-1, -1)``, as the image processor
    lays them out), pooled ``pooling x pooling``; checked to be a whole grid."""
    real = patches[(patches >= 0).all(-1)]
    if not len(real):
        raise ValueError(f"{WHO}: a picture's image_position_ids hold no patch (all (-1, -1))")
    width, height = (int(v) + 1 for v in real.max(0).values)
    if len(real) != width * height or width % pooling or height % pooling:
        raise ValueError(f"{WHO}: image_position_ids place {len(real)} patches on a "
                         f"{height} x {width} grid, which is not whole or not cut into "
                         f"{pooling} x {pooling} blocks by the vision tower's pooling")
    return height // pooling, width // pooling
