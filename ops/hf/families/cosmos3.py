"""Cosmos 3 Edge (``cosmos3_edge``): Qwen-VL's layout. Each picture is one grid of tokens
between ``<|vision_start|>`` and ``<|vision_end|>``, its patches merged
``spatial_merge_size`` squared to one token by the projector: the image processor packs
the patches block-major (each 2 x 2 block of patches in a run), so the merged tokens are
row-major over the merged grid, as the 3-D rope (``get_rope_index``) numbers them;
``image_grid_thw`` gives each picture's patch grid."""
from __future__ import annotations

from typing import Any, Dict

from .base import TinySpec, register
from .qwen_vl import QWEN_TEMPLATE, QwenVL, mrope_section


@register
class Cosmos3(QwenVL):
    name = "cosmos3"
    titles = ("Cosmos 3 Edge",)
    model_types = ("cosmos3_edge",)
    layout = ("one grid per picture (patches merged 2x2), between vision start and end, "
              "as Qwen-VL's")
    tiny = TinySpec(tokens=QwenVL.tiny.tokens, tokenizer_extras=QwenVL.tiny.tokenizer_extras,
                    chat_template=QWEN_TEMPLATE, effects={"cosmos3_edge": ("mask",)})

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
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

    def tiny_processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
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
                                       chat_template=self.tiny.chat_template)
