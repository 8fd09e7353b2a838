"""LLaVA (1.5): one square grid of patch tokens per picture (the vision tower's fixed
input size); the picture is the processor's centre crop (the inputs keep no original
size)."""
from __future__ import annotations

from typing import Any, Dict, List

from .base import Family, register
from .layout import ImageTokens, patches_per_side, square_pictures

WHO = "headscope.hf.Tracer"
# Towers that see every picture at one fixed square size (a Pixtral tower keeps the
# picture's own aspect ratio: its grid varies per picture).
_FIXED_GRID_TOWERS = ("clip_vision_model", "siglip_vision_model")


@register
class Llava(Family):
    name = "llava"
    titles = ("LLaVA",)
    model_types = ("llava",)
    layout = "one square patch grid per picture (the centre crop)"

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        if getattr(config, "vision_feature_select_strategy", "default") != "default":
            raise ValueError(f"{WHO}: regions need the image's patch grid; with "
                             f"vision_feature_select_strategy='full' the CLS token has no "
                             f"place on it")
        vision = config.vision_config
        if vision.model_type not in _FIXED_GRID_TOWERS:
            raise NotImplementedError(
                f"{WHO}: a LLaVA model with a {vision.model_type} vision tower has no fixed "
                f"square patch grid; supported towers: {', '.join(_FIXED_GRID_TOWERS)}")
        return square_pictures(WHO, inputs, self.image_token_ids(config),
                               patches_per_side(vision))
