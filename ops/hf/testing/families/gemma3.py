"""The tests' side of Gemma 3 (``headscope.hf.families.gemma3``): the tiny random models, one
picture's prompt as the processor lays it out, the real processor sized to the tiny vision
tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ...families.gemma3 import Gemma3
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, VISION_END, VISION_START


def alternating_layers(count: int) -> List[str]:
    """Sliding-window and full attention layers in turn, sliding first (the tiny models'
    window is smaller than the test prompts)."""
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(count)]


def siglip_vision(hidden: int) -> Dict[str, Any]:
    """The tiny Gemma 3 and PaliGemma models' SigLIP tower: 32 x 32 pixels in patches of 4
    (8 x 8 patches), two blocks."""
    return dict(model_type="siglip_vision_model", hidden_size=hidden, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4)


@register_tiny(Gemma3)
class TinyGemma3(TinyFamily):
    spec = TinySpec(
        tokens={"<image_soft_token>": IMAGE_TOKEN, "<start_of_image>": VISION_START,
                "<end_of_image>": VISION_END, "</s>": EOS},
        tokenizer_extras={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                          "image_token": "<image_soft_token>"},
        chat_template=llava_template("<start_of_image> "), effects={"gemma3": ("mask",)})

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
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

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        vc = model.config.vision_config
        pixels = torch.randn(1, 3, vc.image_size, vc.image_size, generator=generator)
        tokens = torch.full((int(model.config.mm_tokens_per_image),), IMAGE_TOKEN)
        return torch.cat([torch.tensor([VISION_START]), tokens, torch.tensor([VISION_END])]), \
            {"pixel_values": pixels}

    def processor(self, model_type: str, tokenizer, **_):
        """32 x 32 pixels, 16 tokens; pan-and-scan when the call asks for it."""
        import transformers as tf
        side = siglip_vision(32)["image_size"]
        images = tf.Gemma3ImageProcessor(size={"height": side, "width": side})
        return tf.Gemma3Processor(image_processor=images, tokenizer=tokenizer,
                                  image_seq_length=16, chat_template=self.spec.chat_template)
