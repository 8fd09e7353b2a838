"""The tests' side of HunYuan-VL (``headscope.hf.families.hunyuan_vl``): the tiny random
models, one picture's prompt as the processor lays it out, the real processor sized to the
tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.hunyuan_vl import HunYuanVL
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, VISION_END, VISION_START


@register_tiny(HunYuanVL)
class TinyHunYuanVL(TinyFamily):
    spec = TinySpec(
        tokens={"<image>": IMAGE_TOKEN, "<image_start>": VISION_START,
                "<image_end>": VISION_END, "<|endoftext|>": EOS},
        tokenizer_extras={"image_token": "<image>", "image_start_token": "<image_start>",
                          "image_end_token": "<image_end>"},
        chat_template=llava_template("<image_start><image><image_end> "),
        effects={"hunyuan_vl": ("mask",)}, batch_numbers_pictures=True)

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        """Patches of 4 pixels merged 2 x 2 (as the checkpoints), four rotary axes of a
        16-wide head."""
        import transformers as tf
        rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 2, 2, 2])
        text = {"rope_parameters": rope, **text}  # entries the caller set win
        config = tf.HunYuanVLConfig(
            text_config=text,
            vision_config=dict(hidden_size=vision_hidden, intermediate_size=64,
                               num_attention_heads=2, num_hidden_layers=2,
                               out_hidden_size=text["hidden_size"],
                               text_hidden_size=text["hidden_size"], patch_size=4,
                               temporal_patch_size=1, spatial_merge_size=2, max_image_size=16,
                               min_image_size=16, anyres_vit_max_image_size=16,
                               max_vit_seq_len=16),
            image_token_id=ids["image_token_id"], tie_word_embeddings=False)
        return config, tf.HunYuanVLForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        vc = model.config.vision_config
        m = vc.spatial_merge_size
        rows, cols = grid[0] // m, grid[1] // m
        ids = torch.cat([torch.tensor([VISION_START]),
                         torch.full((rows * (cols + 1) + 2,), IMAGE_TOKEN),
                         torch.tensor([VISION_END])])
        pixels = torch.randn(grid[0] * grid[1], vc.num_channels * vc.patch_size ** 2,
                             generator=generator)
        return ids, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, *grid]])}

    def processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
                  **_):
        """Patches of 4 pixels merged 2 x 2, pictures resized to between ``min_pixels``
        and ``max_pixels``."""
        import transformers as tf
        images = tf.HunYuanVLImageProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=4,
            merge_size=2)
        return tf.HunYuanVLProcessor(image_processor=images, tokenizer=tokenizer,
                                     chat_template=self.spec.chat_template)
