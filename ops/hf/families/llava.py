"""LLaVA (1.5): one square grid of patch tokens per picture (the vision tower's fixed
input size); the picture is the processor's centre crop (the inputs keep no original
size)."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN
from .base import Family, TinySpec, llava_template, register
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
    tiny = TinySpec(
        tokens={"<image>": IMAGE_TOKEN, "</s>": EOS}, chat_template=llava_template(),
        grids=((8, 8), (8, 8)),  # the grid is fixed by the vision tower
        effects={"llava": ("mask",)}, unseen_region_effects=("llava",),
        geometry_waiver="one fixed square patch grid per picture (the tower's input, the "
                        "processor's centre crop): the contract's tr.images test covers it")

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

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        import transformers as tf
        return tf.LlavaConfig(
            text_config=dict({"model_type": "llama"}, **text),
            vision_config=clip_vision(vision_hidden),
            image_token_index=ids["image_token_id"], image_seq_length=16,
            vision_feature_layer=-1, vision_feature_select_strategy="default"), \
            tf.LlavaForConditionalGeneration

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        vc = model.config.vision_config
        side = patches_per_side(vc)
        pixels = torch.randn(1, 3, vc.image_size, vc.image_size, generator=generator)
        return torch.full((side * side,), IMAGE_TOKEN), {"pixel_values": pixels}

    def tiny_processor(self, model_type: str, tokenizer, **_):
        """16 x 16 pixels (the CLIP tower's input)."""
        import transformers as tf
        images = tf.CLIPImageProcessor(size={"shortest_edge": 16},
                                       crop_size={"height": 16, "width": 16})
        return tf.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                 vision_feature_select_strategy="default",
                                 num_additional_image_tokens=1,
                                 chat_template=self.tiny.chat_template)


def clip_vision(hidden: int) -> Dict[str, Any]:
    """The tiny LLaVA models' CLIP tower: 16 x 16 pixels in patches of 4, two blocks."""
    return dict(model_type="clip_vision_model", hidden_size=hidden, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4,
                projection_dim=hidden)
