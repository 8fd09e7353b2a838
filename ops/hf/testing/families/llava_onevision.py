"""The tests' side of LLaVA-OneVision (``headscope.hf.families.llava_onevision``): the tiny
random models, one picture's prompt as the processor lays it out, the real processor sized
to the tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.llava_onevision import LlavaOnevision
from ..spec import TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, VIDEO_TOKEN
from .llava_next import TinyLlavaNext, tiny_pinpoints

# The tiny models' tiles grids hold at most about two tiles' tokens, so that a 2 x 2 canvas
# is scaled down (the real checkpoints: anyres_max_9 of up to 6 x 6 tiles).
TINY_ASPECT = "anyres_max_2"


def tiny_siglip(hidden: int) -> Dict[str, Any]:
    """The tiny OneVision tower: SigLIP (no CLS token, all features used), 16 x 16 pixels in
    patches of 4, two blocks."""
    return dict(model_type="siglip_vision_model", hidden_size=hidden, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)


@register_tiny(LlavaOnevision)
class TinyLlavaOnevision(TinyLlavaNext):
    spec = TinySpec(tokens={"<image>": IMAGE_TOKEN, "<video>": VIDEO_TOKEN, "</s>": EOS},
                    chat_template=llava_template(), effects={"llava_onevision": ("mask",)},
                    unseen_region_effects=("llava_onevision",))

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        vision = tiny_siglip(vision_hidden)
        return tf.LlavaOnevisionConfig(
            text_config=dict(text, model_type="qwen2"), vision_config=vision,
            image_token_index=ids["image_token_id"], video_token_index=ids["video_token_id"],
            image_grid_pinpoints=tiny_pinpoints(vision), vision_aspect_ratio=TINY_ASPECT,
            vision_feature_layer=-1, vision_feature_select_strategy="full"), \
            tf.LlavaOnevisionForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        ids, inputs = super().image(model, grid, generator)
        return ids, dict(inputs, batch_num_images=torch.tensor([1]))

    def processor(self, model_type: str, tokenizer, **_):
        """A base and tiles of 16 x 16 pixels (SigLIP) on the canvases of
        ``tiny_pinpoints``."""
        import transformers as tf
        vision = tiny_siglip(32)
        tile = vision["image_size"]
        images = tf.LlavaOnevisionImageProcessor(size={"height": tile, "width": tile},
                                                 image_grid_pinpoints=tiny_pinpoints(vision))
        return tf.LlavaOnevisionProcessor(
            image_processor=images, tokenizer=tokenizer,
            video_processor=tf.LlavaOnevisionVideoProcessor(size={"height": tile, "width": tile}),
            num_image_tokens=(tile // vision["patch_size"]) ** 2,
            vision_feature_select_strategy="full", vision_aspect_ratio=TINY_ASPECT,
            chat_template=self.spec.chat_template)
