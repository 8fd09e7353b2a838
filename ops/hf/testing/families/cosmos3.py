"""The tests' side of Cosmos 3 Edge (``headscope.hf.families.cosmos3``): the tiny random
models, one picture's prompt as the processor lays it out, the real processor sized to the
tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict

from ...families.cosmos3 import Cosmos3
from ...families.qwen_vl import mrope_section
from ..spec import TinySpec, register_tiny
from .qwen_vl import QWEN_TEMPLATE, TinyQwenVL


@register_tiny(Cosmos3)
class TinyCosmos3(TinyQwenVL):
    spec = TinySpec(tokens=TinyQwenVL.spec.tokens,
                    tokenizer_extras=TinyQwenVL.spec.tokenizer_extras,
                    chat_template=QWEN_TEMPLATE, effects={"cosmos3_edge": ("mask",)})

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        rope = dict(rope_type="default", rope_theta=10000.0,
                    mrope_section=mrope_section(text["head_dim"]))
        text = dict(text, rope_parameters=rope)
        vision = dict(hidden_size=vision_hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, patch_size=4, num_patches=16,
                      spatial_merge_size=2)
        return tf.Cosmos3EdgeConfig(text_config=text, vision_config=vision,
                                    projector_hidden_size=32, tie_word_embeddings=False,
                                    **ids), tf.Cosmos3EdgeForConditionalGeneration

    def processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
                  **_):
        """Patches of 4 pixels (one frame each) merged 2 x 2, pictures resized to between
        ``min_pixels`` and ``max_pixels``; the tokenizer asks for ``mm_token_type_ids``
        (the processor's default is not to give them, and the model's 3-D rope needs
        them), as the checkpoints' tokenizer config does."""
        import transformers as tf
        tokenizer.init_kwargs["return_mm_token_type_ids"] = True
        sizes = dict(patch_size=4, temporal_patch_size=1, merge_size=2)
        images = tf.Cosmos3EdgeImageProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **sizes)
        return tf.Cosmos3EdgeProcessor(image_processor=images, tokenizer=tokenizer,
                                       video_processor=tf.Cosmos3EdgeVideoProcessor(**sizes),
                                       chat_template=self.spec.chat_template)
