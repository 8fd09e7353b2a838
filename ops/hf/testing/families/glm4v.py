"""The tests' side of GLM-4.1V, GLM-4.5V and GLM-4.6V (``headscope.hf.families.glm4v``): the
tiny random models, one picture's prompt as the processor lays it out, the real processor
sized to the tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict

from ...families.glm4v import Glm4v
from ...families.qwen_vl import mrope_section
from ..spec import TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START
from .qwen_vl import TinyQwenVL

# The tiny models' video markers; their image markers are the shared VISION_START and
# VISION_END
VIDEO_START = MARKER_IDS[5]  # <|begin_of_video|>
VIDEO_END = MARKER_IDS[6]    # <|end_of_video|>


@register_tiny(Glm4v)
class TinyGlm4v(TinyQwenVL):
    spec = TinySpec(
        tokens={"<|image|>": IMAGE_TOKEN, "<|video|>": VIDEO_TOKEN,
                "<|begin_of_image|>": VISION_START, "<|end_of_image|>": VISION_END,
                "<|begin_of_video|>": VIDEO_START, "<|end_of_video|>": VIDEO_END,
                "<|endoftext|>": EOS},
        tokenizer_extras={"image_token": "<|image|>", "video_token": "<|video|>"},
        chat_template=llava_template("<|begin_of_image|><|image|><|end_of_image|> "),
        effects={"glm4v": ("mask",), "glm4v_moe": ("mask",)}, commands=("glm4v",))

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        # half of each head rotates, as in the checkpoints (partial_rotary_factor 0.5); the
        # rotated half is split into the temporal, height and width sections
        rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                    mrope_section=mrope_section(text["head_dim"] // 2))
        vision = dict(depth=2, hidden_size=vision_hidden, intermediate_size=48, num_heads=2,
                      out_hidden_size=text["hidden_size"], image_size=16, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2)
        markers = dict(image_token_id=ids["image_token_id"],
                       video_token_id=ids["video_token_id"],
                       image_start_token_id=ids["vision_start_token_id"],
                       image_end_token_id=ids["vision_end_token_id"],
                       video_start_token_id=VIDEO_START, video_end_token_id=VIDEO_END)
        if model_type == "glm4v":
            return tf.Glm4vConfig(text_config=dict(text, rope_parameters=rope),
                                  vision_config=vision, **markers), \
                tf.Glm4vForConditionalGeneration
        if model_type == "glm46v":  # GLM-4.1V's text decoder and vision tower
            return tf.Glm46VConfig(text_config=dict(text, rope_parameters=rope),
                                   vision_config=vision, tie_word_embeddings=False,
                                   **markers), tf.Glm46VForConditionalGeneration
        moe = dict(text, rope_parameters=rope, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, moe_intermediate_size=text["intermediate_size"] // 2,
                   first_k_dense_replace=1)
        return tf.Glm4vMoeConfig(text_config=moe, vision_config=vision, **markers), \
            tf.Glm4vMoeForConditionalGeneration

    def processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
                  **_):
        """Qwen-VL's sizes."""
        import transformers as tf
        sizes = dict(patch_size=4, temporal_patch_size=2, merge_size=2)
        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        if model_type == "glm46v":
            cls, images, video = (tf.Glm46VProcessor, tf.Glm46VImageProcessor,
                                  tf.Glm46VVideoProcessor)
        else:
            cls, images, video = (tf.Glm4vProcessor, tf.Glm4vImageProcessor,
                                  tf.Glm4vVideoProcessor)
        return cls(image_processor=images(size=size, **sizes), tokenizer=tokenizer,
                   video_processor=video(**sizes), chat_template=self.spec.chat_template)
