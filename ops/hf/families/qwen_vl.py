"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE: each picture is
one grid of tokens (patches merged ``spatial_merge_size`` squared to one token) between
``<|vision_start|>`` and ``<|vision_end|>``; ``image_grid_thw`` gives each picture's
patch grid. Qwen3.5's decoder is a hybrid (gated delta nets between gated softmax
layers): only its softmax layers are traced."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .base import Family, missing_input, register
from .layout import ImageTokens, grid_pictures

WHO = "headscope.hf.Tracer"


@register
class QwenVL(Family):
    name = "qwen_vl"
    titles = ("Qwen2-VL", "Qwen2.5-VL", "Qwen3-VL", "Qwen3-VL-MoE", "Qwen3.5", "Qwen3.5-MoE")
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                   "qwen3_5_moe")
    layout = "one grid per picture (patches merged 2x2), between vision start and end"
    input_keys = ("image_grid_thw",)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        return grid_pictures(WHO, inputs["input_ids"], self.image_token_ids(config),
                             merged_grids(config, inputs))


def merged_grids(config, inputs: Dict[str, Any], merge: Tuple[int, int] = None
                 ) -> List[Tuple[int, int]]:
    """Each picture's grid of tokens (rows, cols): ``image_grid_thw``'s patch grid merged
    ``merge`` (rows, cols of patches; default ``spatial_merge_size`` squared) to one
    token."""
    thw = inputs.get("image_grid_thw")
    if thw is None:
        raise missing_input(config, "image_grid_thw")
    if merge is None:
        merge = (int(getattr(config.vision_config, "spatial_merge_size", 1)),) * 2
    grids = []
    for t, h, w in thw.tolist():
        if t != 1:
            raise ValueError(f"{WHO}: regions need still images (temporal grid 1), got "
                             f"image_grid_thw row {[t, h, w]}")
        grids.append((h // merge[0], w // merge[1]))
    return grids


def mrope_section(head_dim: int) -> list:
    """Qwen-VL's rotary sections (temporal, height, width) of a head of ``head_dim``."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]
