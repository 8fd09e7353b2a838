"""Cosmos 3 Edge (``cosmos3_edge``): Qwen-VL's layout. Each picture is one grid of tokens
between ``<|vision_start|>`` and ``<|vision_end|>``, its patches merged
``spatial_merge_size`` squared to one token by the projector: the image processor packs
the patches block-major (each 2 x 2 block of patches in a run), so the merged tokens are
row-major over the merged grid, as the 3-D rope (``get_rope_index``) numbers them;
``image_grid_thw`` gives each picture's patch grid."""
from __future__ import annotations

from .base import register
from .qwen_vl import QwenVL


@register
class Cosmos3(QwenVL):
    name = "cosmos3"
    titles = ("Cosmos 3 Edge",)
    model_types = ("cosmos3_edge",)
    layout = ("one grid per picture (patches merged 2x2), between vision start and end, "
              "as Qwen-VL's")
