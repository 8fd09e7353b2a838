"""Gemma 3: each picture is one square grid of ``mm_tokens_per_image`` tokens (the SigLIP
tower's patches average-pooled), between ``<start_of_image>`` and ``<end_of_image>``; the
picture is the processor's resize to the tower's square input. ``token_type_ids`` marks the
image tokens, each picture's tokens attend to each other both ways. Pan-and-scan crops
come as further pictures of the same grid; each is read as a picture of its own."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

from .base import Family, square_pictures
from .layout import ImageTokens

WHO = "headscope.hf.Tracer"


class Gemma3(Family):
    name = "gemma3"
    model_types = ("gemma3",)
    layout = "one square grid per picture (pooled patches), bidirectional inside it"

    def image_token_ids(self, config) -> Tuple[int, ...]:
        return (int(config.image_token_id),)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        side = math.isqrt(int(config.mm_tokens_per_image))
        return square_pictures(WHO, inputs, self.image_token_ids(config), side)

    def prompt_types(self, model, is_image: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"token_type_ids": is_image.to(torch.int64)}

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        import transformers as tf
        text = dict(text, model_type="gemma3_text", sliding_window=8,
                    layer_types=alternating_layers(text["num_hidden_layers"]),
                    query_pre_attn_scalar=text["head_dim"])
        return tf.Gemma3Config(
            text_config=text, vision_config=siglip_vision(vision_hidden),
            mm_tokens_per_image=16, image_token_id=ids["image_token_id"],
            boi_token_id=ids["vision_start_token_id"], eoi_token_id=ids["vision_end_token_id"]), \
            tf.Gemma3ForConditionalGeneration

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        from ..tiny import IMAGE_TOKEN, VISION_END, VISION_START
        vc = model.config.vision_config
        pixels = torch.randn(1, 3, vc.image_size, vc.image_size, generator=generator)
        tokens = torch.full((int(model.config.mm_tokens_per_image),), IMAGE_TOKEN)
        return torch.cat([torch.tensor([VISION_START]), tokens, torch.tensor([VISION_END])]), \
            {"pixel_values": pixels}


def alternating_layers(count: int) -> List[str]:
    """Sliding-window and full attention layers in turn, sliding first (the tiny models'
    window is smaller than the test prompts)."""
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(count)]


def siglip_vision(hidden: int) -> Dict[str, Any]:
    """The tiny Gemma 3 and PaliGemma models' SigLIP tower: 32 x 32 pixels in patches of 4
    (8 x 8 patches), two blocks."""
    return dict(model_type="siglip_vision_model", hidden_size=hidden, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4)
