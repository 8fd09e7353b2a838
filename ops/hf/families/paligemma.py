"""PaliGemma and PaliGemma 2: the picture's SigLIP patch grid (the processor's resize to
the tower's square input) comes first, then the prompt; image and prompt are one prefix
whose tokens attend to each other both ways (``token_type_ids`` 0), the answer attends
causally (1). PaliGemma 2's Gemma 2 decoder alternates sliding-window and full layers and
soft-caps its logits (eager attention only)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .base import Family, register
from .layout import ImageTokens, patches_per_side, square_pictures

WHO = "headscope.hf.Tracer"


@register
class PaliGemma(Family):
    name = "paligemma"
    titles = ("PaliGemma", "PaliGemma 2")
    model_types = ("paligemma",)
    layout = "one square patch grid per picture, before the prompt; image and prompt one " \
             "bidirectional prefix"

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        return square_pictures(WHO, inputs, self.image_token_ids(config),
                               patches_per_side(config.vision_config))

    def prompt_types(self, model, is_image: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"token_type_ids": torch.zeros_like(is_image, dtype=torch.int64)}

    def answer_type(self, name: str) -> int:
        return 1  # generated tokens are the causal suffix

    def final_softcap(self, config) -> Optional[float]:
        return getattr(config.get_text_config(), "final_logit_softcapping", None)
