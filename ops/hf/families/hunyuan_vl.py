"""HunYuan-VL (``hunyuan_vl``): each picture is one grid of tokens (the image processor's
patches row-major, merged ``spatial_merge_size`` squared to one token by the patch
merger's convolution), written row by row with a newline feature after each row, between
a begin and an end feature: ``rows * (cols + 1) + 2`` placeholders, all under the image
token id, between the text tokens ``<image_start>`` and ``<image_end>``. The begin, end
and newline slots hold no piece of the picture (markers, region -1). ``image_grid_thw``
gives each picture's patch grid; the 4-axis rope numbers the tokens by the same grid and
a batch's pictures in order on its last axis (so a row's picture in a batch is numbered
otherwise than alone)."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN, VISION_END, VISION_START
from .base import Family, TinySpec, llava_template, register
from .layout import ImageTokens, View, image_positions, split_images
from .qwen_vl import WHO, merged_grids


@register
class HunYuanVL(Family):
    name = "hunyuan_vl"
    titles = ("HunYuan-VL",)
    model_types = ("hunyuan_vl",)
    layout = ("one grid per picture (patches merged 2x2), a newline slot after each row and "
              "begin and end slots, all placeholders")
    input_keys = ("image_grid_thw",)
    tiny = TinySpec(
        tokens={"<image>": IMAGE_TOKEN, "<image_start>": VISION_START,
                "<image_end>": VISION_END, "<|endoftext|>": EOS},
        tokenizer_extras={"image_token": "<image>", "image_start_token": "<image_start>",
                          "image_end_token": "<image_end>"},
        chat_template=llava_template("<image_start><image><image_end> "),
        effects={"hunyuan_vl": ("mask",)}, batch_numbers_pictures=True)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        grids = merged_grids(config, inputs)
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = split_images(WHO, per_row, [r * (c + 1) + 2 for r, c in grids])
        grid = iter(grids)
        out = []
        for row in pictures:
            images = []
            for positions in row:
                rows, cols = next(grid)
                lines = positions[1:-1].reshape(rows, cols + 1)
                markers = torch.cat([positions[:1], lines[:, cols], positions[-1:]])
                images.append(ImageTokens((View("base", lines[:, :cols].flatten(), rows, cols),),
                                          markers=markers))
            out.append(images)
        return out

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
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

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
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

    def tiny_processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
                       **_):
        """Patches of 4 pixels merged 2 x 2, pictures resized to between ``min_pixels``
        and ``max_pixels``."""
        import transformers as tf
        images = tf.HunYuanVLImageProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=4,
            merge_size=2)
        return tf.HunYuanVLProcessor(image_processor=images, tokenizer=tokenizer,
                                     chat_template=self.tiny.chat_template)
