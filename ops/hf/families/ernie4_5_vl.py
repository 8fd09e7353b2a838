"""ERNIE 4.5-VL (``ernie4_5_vl_moe``): Qwen-VL's layout under its own marker names. Each
picture is one grid of tokens between ``<|IMAGE_START|>`` and ``<|IMAGE_END|>``: the image
processor's ``patchify`` orders the patches merge x merge block by block, row-major over
the merged grid, and the resampler joins each run of ``spatial_merge_size`` squared
patches into one token; ``image_grid_thw`` gives each picture's patch grid, and the 3-D
rope (``get_rope_index``) numbers the tokens by the same grid. The decoder is a mixture
of experts whose image tokens (markers included: ``moe_mm_token_type_ids``) go to experts
of their own; its attention is softmax throughout."""
from __future__ import annotations

from typing import Any, Dict

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START
from .base import TinySpec, llava_template, register
from .qwen_vl import QwenVL

# The tiny models' video markers; their image markers are the shared VISION_START and
# VISION_END
VIDEO_START = MARKER_IDS[5]  # <|VIDEO_START|>
VIDEO_END = MARKER_IDS[6]    # <|VIDEO_END|>


@register
class Ernie4_5VL(QwenVL):
    name = "ernie4_5_vl"
    titles = ("ERNIE 4.5-VL",)
    model_types = ("ernie4_5_vl_moe",)
    layout = ("one grid per picture (patches merged 2x2), between <|IMAGE_START|> and "
              "<|IMAGE_END|>")
    tiny = TinySpec(
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

    def prompt_types(self, model, is_image: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The processor's two type inputs: ``mm_token_type_ids`` 1 on the image tokens,
        ``moe_mm_token_type_ids`` 1 also on the markers, the positions just before and
        just after each run of image tokens (where the processor's template puts
        ``<|IMAGE_START|>`` and ``<|IMAGE_END|>``)."""
        image = is_image.to(torch.int32)
        shifted = torch.nn.functional.pad(image, (1, 1))
        with_markers = image | shifted[:, :-2] | shifted[:, 2:]
        return {"mm_token_type_ids": image, "moe_mm_token_type_ids": with_markers}

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
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

    def tiny_processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
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
                                          chat_template=self.tiny.chat_template)
