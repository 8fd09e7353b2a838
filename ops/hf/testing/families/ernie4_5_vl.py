"""The tests' side of ERNIE 4.5-VL (``headscope.hf.families.ernie4_5_vl``): the tiny random
models, one picture's prompt as the processor lays it out, the real processor sized to the
tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict

from ...families.ernie4_5_vl import Ernie4_5VL
from ..spec import TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START
from .qwen_vl import TinyQwenVL

# The tiny models' video markers; their image markers are the shared VISION_START and
# VISION_END
VIDEO_START = MARKER_IDS[5]  # <|VIDEO_START|>
VIDEO_END = MARKER_IDS[6]    # <|VIDEO_END|>


@register_tiny(Ernie4_5VL)
class TinyErnie4_5VL(TinyQwenVL):
    spec = TinySpec(
        tokens={"<|IMAGE_PLACEHOLDER|>": IMAGE_TOKEN, "<|VIDEO_PLACEHOLDER|>": VIDEO_TOKEN,
                "<|IMAGE_START|>": VISION_START, "<|IMAGE_END|>": VISION_END,
                "<|VIDEO_START|>": VIDEO_START, "<|VIDEO_END|>": VIDEO_END,
                "</s>": EOS},
        tokenizer_extras={"image_token": "<|IMAGE_PLACEHOLDER|>",
                          "image_start_token": "<|IMAGE_START|>",
                          "image_end_token": "<|IMAGE_END|>",
                          "video_token": "<|VIDEO_PLACEHOLDER|>",
                          "video_start_token": "<|VIDEO_START|>",
                          "video_end_token": "<|VIDEO_END|>"},
        chat_template=llava_template("<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|> "),
        effects={"ernie4_5_vl_moe": ("mask",)})

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        """As its transformers tests build it: one dense and one sparse layer of 4 experts
        (2 per token, one shared), the rotary sections of a 16-wide head."""
        import transformers as tf
        moe = dict(mlp_layer_types=["dense", "sparse"], moe_intermediate_size=[32, 32],
                   moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                        mrope_section=[3, 3, 2]))
        moe.update(text)  # entries the caller set win
        config = tf.Ernie4_5_VLMoeConfig(
            text_config=moe,
            vision_config=dict(depth=2, hidden_size=vision_hidden, intermediate_size=32,
                               num_heads=2, patch_size=4, spatial_merge_size=2),
            image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
            image_start_token_id=ids["vision_start_token_id"],
            image_end_token_id=ids["vision_end_token_id"], video_start_token_id=VIDEO_START,
            video_end_token_id=VIDEO_END, tie_word_embeddings=False)
        return config, tf.Ernie4_5_VLMoeForConditionalGeneration

    def processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
                  **_):
        """Patches of 4 pixels merged 2 x 2, pictures resized to between ``min_pixels``
        and ``max_pixels``."""
        import transformers as tf
        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        images = tf.Ernie4_5_VLMoeImageProcessor(size=size, patch_size=4, merge_size=2)
        # no timestamps drawn on video frames: their font is a hub download, and a saved
        # processor that names a font it cannot find does not load
        video = tf.Ernie4_5_VLMoeVideoProcessor(size=size, patch_size=4, merge_size=2,
                                                draw_on_frames=False)
        return tf.Ernie4_5_VLMoeProcessor(image_processor=images, tokenizer=tokenizer,
                                          video_processor=video,
                                          chat_template=self.spec.chat_template)
