"""Kimi K2.5 (``kimi_k25``): a DeepSeek-V3 text decoder (MLA attention, traced on its
latent keys; a mixture of experts) under a MoonViT vision tower. The image processor
shrinks a picture to fit its patch budget (never enlarging it), pads it with black on
the right and bottom to a multiple of ``patch_size * merge_size`` pixels and cuts the
canvas into patches row-major; the tower pools each ``merge_kernel_size`` block of
patches into one token, row-major over the merged grid: one run of ``<|media_pad|>``
tokens per picture, between ``<|media_begin|>``/``<|media_content|>`` and
``<|media_end|>`` text tokens. ``image_grid_thw`` gives the canvas's patch grid; the
picture's own size (which the processor drops) is read back from ``pixel_values``: the
padding is black after normalisation and narrower than one token, so the grid reaches
past the picture by less than one token on the right and bottom."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START
from .base import Family, TinySpec, llava_template, missing_input, register
from .layout import ImageTokens, View, image_positions, split_images
from .llama4 import content_size
from .qwen_vl import WHO, merged_grids

MEDIA_CONTENT = MARKER_IDS[0]  # <|media_content|>, between <|media_begin|> and the picture

# the tiny models' MLA decoder (DeepSeek-V3 as its transformers tests build it): latent keys
# and values of rank 16, rope and no-rope parts of 8, one dense layer then 4 experts; the
# queries low-rank as in the checkpoints (a full-rank q_proj is taken for the vision
# tower's when the model is saved: Kimi K2.5's weight conversion matches "attn.q_proj")
MLA_TEXT = dict(model_type="deepseek_v3", kv_lora_rank=16, q_lora_rank=16,
                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                first_k_dense_replace=1)


@register
class KimiK25(Family):
    name = "kimi_k25"
    titles = ("Kimi K2.5",)
    model_types = ("kimi_k25",)
    layout = ("one grid per picture (patches pooled 2x2) over the picture padded right and "
              "bottom, between <|media_begin|> and <|media_end|>")
    input_keys = ("image_grid_thw", "pixel_values")
    tiny = TinySpec(
        tokens={"<|media_pad|>": IMAGE_TOKEN, "<|kimi_k25_video_placeholder|>": VIDEO_TOKEN,
                "<|media_begin|>": VISION_START, "<|media_end|>": VISION_END,
                "<|media_content|>": MEDIA_CONTENT, "[EOS]": EOS},
        tokenizer_extras={"image_token": "<|media_pad|>",
                          "video_token": "<|kimi_k25_video_placeholder|>"},
        chat_template=llava_template(
            "<|media_begin|><|media_content|><|media_pad|><|media_end|> "),
        effects={"kimi_k25": ("mask",)})

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        merge = tuple(int(k) for k in config.vision_config.merge_kernel_size)
        grids = merged_grids(config, inputs, merge)
        pixels = inputs.get("pixel_values")
        if pixels is None:
            raise missing_input(config, "pixel_values", " (its padding)")
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = split_images(WHO, per_row, [r * c for r, c in grids])
        boxes = iter(_boxes(pixels.detach().cpu(), inputs["image_grid_thw"].tolist(), merge))
        grid = iter(grids)
        views = [[View("base", p, *next(grid), next(boxes)) for p in row] for row in pictures]
        # the grid reaches past the picture: it is the grid regions cluster on all the same
        return [[ImageTokens((view,), grid=view) for view in row] for row in views]

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        """MLA_TEXT's decoder (as many key/value heads as query heads), a MoonViT of patches
        of 4 pooled 2 x 2, as Kimi K2.5's transformers tests build them."""
        import transformers as tf
        text = {k: v for k, v in text.items() if k != "head_dim"}
        text.update(MLA_TEXT, num_key_value_heads=text["num_attention_heads"])
        config = tf.Kimi_K25Config(
            text_config=text,
            vision_config=dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, pos_emb_time=2,
                               num_attention_heads=2, num_hidden_layers=2,
                               hidden_size=vision_hidden, intermediate_size=64),
            projection_hidden_size=vision_hidden, tie_word_embeddings=False, **ids)
        return config, tf.Kimi_K25ForConditionalGeneration

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        vc = model.config.vision_config
        kh, kw = vc.merge_kernel_size
        tokens = torch.full(((grid[0] // kh) * (grid[1] // kw),), IMAGE_TOKEN)
        ids = torch.cat([torch.tensor([VISION_START, MEDIA_CONTENT]), tokens,
                         torch.tensor([VISION_END])])
        pixels = torch.randn(grid[0] * grid[1], 3, vc.patch_size, vc.patch_size,
                             generator=generator)
        return ids, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, *grid]])}

    def tiny_processor(self, model_type: str, tokenizer, *, max_pixels: int,
                       longest_edge: int, **_):
        """Patches of 4 pixels pooled 2 x 2, pictures shrunk to at most ``max_pixels``
        and ``longest_edge`` pixels a side."""
        import transformers as tf
        side = longest_edge // 4  # the image processor's limit per side, in patches
        images = tf.Kimi_K25ImageProcessor(size={"max_height": side, "max_width": side},
                                           patch_size=4, merge_size=2,
                                           max_patches=max_pixels // 16)
        video = tf.Kimi_K25VideoProcessor(patch_size=4, merge_size=2)
        return tf.Kimi_K25Processor(image_processor=images, tokenizer=tokenizer,
                                    video_processor=video,
                                    chat_template=self.tiny.chat_template)


def _boxes(pixels: torch.Tensor, thw: List[List[int]], merge: Tuple[int, int]) -> List[tuple]:
    """Per picture, the box its token grid covers on the picture: the padded canvas read
    back from ``pixel_values`` ``(patches, C, p, p)`` (each picture's patches row-major),
    the picture its part up to the last row and column that is not all black. The
    processor pads by less than ``merge`` patches, so a picture whose own edge is black
    reads at most that much of it as padding."""
    boxes, start = [], 0
    for _, h, w in thw:
        patches = pixels[start:start + h * w]
        start += h * w
        C, p = patches.shape[1], patches.shape[-1]
        canvas = patches.reshape(h, w, C, p, p).permute(2, 0, 3, 1, 4).reshape(C, h * p, w * p)
        content_h, content_w = content_size(canvas)
        content_h = max(content_h, (h - merge[0]) * p + 1)
        content_w = max(content_w, (w - merge[1]) * p + 1)
        boxes.append((0.0, 0.0, w * p / content_w, h * p / content_h))
    return boxes
