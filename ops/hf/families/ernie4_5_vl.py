"""ERNIE 4.5-VL (``ernie4_5_vl_moe``): Qwen-VL's layout under its own marker names. Each
picture is one grid of tokens between ``<|IMAGE_START|>`` and ``<|IMAGE_END|>``: the image
processor's ``patchify`` orders the patches merge x merge block by block, row-major over
the merged grid, and the resampler joins each run of ``spatial_merge_size`` squared
patches into one token; ``image_grid_thw`` gives each picture's patch grid, and the 3-D
rope (``get_rope_index``) numbers the tokens by the same grid. The decoder is a mixture
of experts whose image tokens (markers included: ``moe_mm_token_type_ids``) go to experts
of their own; its attention is softmax throughout."""
from __future__ import annotations

from typing import Dict

import torch

from .base import register
from .qwen_vl import QwenVL


@register
class Ernie4_5VL(QwenVL):
    name = "ernie4_5_vl"
    titles = ("ERNIE 4.5-VL",)
    model_types = ("ernie4_5_vl_moe",)
    layout = ("one grid per picture (patches merged 2x2), between <|IMAGE_START|> and "
              "<|IMAGE_END|>")

    def prompt_types(self, model, is_image: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The processor's two type inputs: ``mm_token_type_ids`` 1 on the image tokens,
        ``moe_mm_token_type_ids`` 1 also on the markers, the positions just before and
        just after each run of image tokens (where the processor's template puts
        ``<|IMAGE_START|>`` and ``<|IMAGE_END|>``)."""
        image = is_image.to(torch.int32)
        shifted = torch.nn.functional.pad(image, (1, 1))
        with_markers = image | shifted[:, :-2] | shifted[:, 2:]
        return {"mm_token_type_ids": image, "moe_mm_token_type_ids": with_markers}
