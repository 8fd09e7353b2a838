"""The tests' side of LLaVA (``headscope.hf.families.llava``): the tiny random models, one
picture's prompt as the processor lays it out, the real processor sized to the tiny vision
tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.layout import patches_per_side
from ...families.llava import Llava
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN


def clip_vision(hidden: int) -> Dict[str, Any]:
    """The tiny LLaVA models' CLIP tower: 16 x 16 pixels in patches of 4, two blocks."""
    return dict(model_type="clip_vision_model", hidden_size=hidden, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4,
                projection_dim=hidden)


@register_tiny(Llava)
class TinyLlava(TinyFamily):
    spec = TinySpec(
        tokens={"<image>": IMAGE_TOKEN, "</s>": EOS}, chat_template=llava_template(),
        grids=((8, 8), (8, 8)),  # the grid is fixed by the vision tower
        effects={"llava": ("mask",)}, unseen_region_effects=("llava",),
        geometry_waiver="one fixed square patch grid per picture (the tower's input, the "
                        "processor's centre crop): the contract's tr.images test covers it")

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        return tf.LlavaConfig(
            text_config=dict({"model_type": "llama"}, **text),
            vision_config=clip_vision(vision_hidden),
            image_token_index=ids["image_token_id"], image_seq_length=16,
            vision_feature_layer=-1, vision_feature_select_strategy="default"), \
            tf.LlavaForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        vc = model.config.vision_config
        side = patches_per_side(vc)
        pixels = torch.randn(1, 3, vc.image_size, vc.image_size, generator=generator)
        return torch.full((side * side,), IMAGE_TOKEN), {"pixel_values": pixels}

    def processor(self, model_type: str, tokenizer, **_):
        """16 x 16 pixels (the CLIP tower's input)."""
        import transformers as tf
        images = tf.CLIPImageProcessor(size={"shortest_edge": 16},
                                       crop_size={"height": 16, "width": 16})
        return tf.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                 vision_feature_select_strategy="default",
                                 num_additional_image_tokens=1,
                                 chat_template=self.spec.chat_template)
