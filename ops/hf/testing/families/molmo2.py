"""The tests' side of Molmo 2 (``headscope.hf.families.molmo2``): the tiny random models, one
picture's prompt as the processor lays it out, the real processor sized to the tiny vision
tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch

from ...families.layout import patches_per_side
from ...families.molmo2 import Molmo2
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START

# The tiny models' marker tokens; <im_patch> is the shared IMAGE_TOKEN, <im_start> and
# <im_end> VISION_START and VISION_END
TEXT_IMAGE = MARKER_IDS[0]       # <|image|>, which the processor replaces in the text
COLUMN = MARKER_IDS[1]           # <im_col>, after each row of tokens
LOW_RES_START = MARKER_IDS[2]    # <low_res_im_start>, before the global view
FRAME_START = MARKER_IDS[3]      # <frame_start> (videos)
FRAME_END = MARKER_IDS[4]        # <frame_end> (videos)
LOW_RES_PATCH = MARKER_IDS[5]    # <im_low>, which the processor never writes
# the tiny processor's crops: 20 x 20 pixels in patches of 4 (5 x 5 patches, an odd count
# as the checkpoints' 27 x 27: the windows overhang), pooled 2 x 2, overlapping by one
# patch on each side
TINY_CROP, TINY_PATCH, TINY_POOL, TINY_MARGINS = 20, 4, (2, 2), (1, 1)


def pool_windows(patches: torch.Tensor, window: Sequence[int]) -> Tuple[torch.Tensor, int, int]:
    """``(pooled, rows, cols)``: the grid of patch indices ``patches`` ``(H, W)`` cut into
    ``ph x pw`` windows, padded evenly with -1 (the extra one after), each window a row of
    ``pooled``, row-major."""
    ph, pw = window
    H, W = patches.shape
    rows, cols = -(-H // ph), -(-W // pw)
    pad_h, pad_w = rows * ph - H, cols * pw - W
    padded = torch.nn.functional.pad(patches, (pad_w // 2, pad_w - pad_w // 2,
                                               pad_h // 2, pad_h - pad_h // 2), value=-1)
    pooled = padded.reshape(rows, ph, cols, pw).permute(0, 2, 1, 3).reshape(rows * cols, -1)
    return pooled, rows, cols


def canvas_patches(tiling: Tuple[int, int], side: int, margins: Tuple[int, int]
                   ) -> torch.Tensor:
    """The canvas's grid of patch indices (crop k's patches ``k * side**2`` on, the crops
    row-major over a ``tiling`` of crops of ``side x side`` patches): each crop overlaps
    its neighbours by ``margins`` (left/top, right/bottom) patches, and of an overlap the
    crop nearer its centre keeps the patches."""
    R, C = tiling
    first, last = margins
    index = torch.arange(R * C * side * side).reshape(R, C, side, side)

    def kept(count):  # per crop along one axis, the range of its patches on the canvas
        return [(0 if i == 0 else first, side if i == count - 1 else side - last)
                for i in range(count)]

    return torch.cat([torch.cat([index[i, j, r0:r1, c0:c1] for j, (c0, c1) in
                                 enumerate(kept(C))], 1)
                      for i, (r0, r1) in enumerate(kept(R))])


@register_tiny(Molmo2)
class TinyMolmo2(TinyFamily):
    spec = TinySpec(
        tokens={"<im_patch>": IMAGE_TOKEN, "<|video|>": VIDEO_TOKEN, "<im_start>": VISION_START,
                "<im_end>": VISION_END, "<|endoftext|>": EOS, "<|image|>": TEXT_IMAGE,
                "<im_col>": COLUMN, "<low_res_im_start>": LOW_RES_START,
                "<frame_start>": FRAME_START, "<frame_end>": FRAME_END,
                "<im_low>": LOW_RES_PATCH},
        tokenizer_extras={"image_token": "<|image|>", "video_token": "<|video|>"},
        chat_template=llava_template("<|image|> "), grids=((2, 2), (1, 3)),
        typed_tokens=("<im_col>", "<im_start>", "<low_res_im_start>", "<im_end>"),
        index_inputs={"image_token_pooling": "pixel_values"},
        effects={"molmo2": ("mask", "zero")}, commands=("molmo2",))

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        """Its transformers tests' tiny Molmo 2 (a ViT of two layers, one of them pooled by
        the adapter), on crops of ``TINY_CROP`` pixels."""
        import transformers as tf
        from transformers.models.molmo2.configuration_molmo2 import (Molmo2AdapterConfig,
                                                                      Molmo2TextConfig,
                                                                      Molmo2VisionConfig)
        heads = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8)
        vision = Molmo2VisionConfig(hidden_size=vision_hidden, intermediate_size=37,
                                    num_hidden_layers=2, image_size=[TINY_CROP, TINY_CROP],
                                    patch_size=TINY_PATCH, **heads)
        adapter = Molmo2AdapterConfig(vision_feature_layer=[1], hidden_size=vision_hidden,
                                      intermediate_size=37, text_hidden_size=text["hidden_size"],
                                      **heads)
        return tf.Molmo2Config(
            text_config=Molmo2TextConfig(**dict(text, rms_norm_eps=1e-6)),
            vision_config=vision, adapter_config=adapter,
            image_patch_id=ids["image_token_id"], image_start_token_id=VISION_START,
            image_end_token_id=VISION_END, low_res_image_start_token_id=LOW_RES_START,
            frame_start_token_id=FRAME_START, frame_end_token_id=FRAME_END,
            tie_word_embeddings=False), tf.Molmo2ForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the canvas's rows x cols crops; the prompt and the pooled indices as
        the tiny processor lays out a picture it cuts so (random pixels; ``<im_col>``
        after the canvas's rows only, as the checkpoints' processor)."""
        side = patches_per_side(model.config.vision_config)
        crops = 1 + grid[0] * grid[1]
        low = torch.arange(side * side).reshape(side, side)
        low_pooled, rows, cols = pool_windows(low, TINY_POOL)
        canvas = canvas_patches(grid, side, TINY_MARGINS) + side * side
        canvas_pooled, canvas_rows, canvas_cols = pool_windows(canvas, TINY_POOL)
        ids = ([LOW_RES_START] + [IMAGE_TOKEN] * rows * cols + [VISION_END, VISION_START]
               + ([IMAGE_TOKEN] * canvas_cols + [COLUMN]) * canvas_rows + [VISION_END])
        pixels = TINY_PATCH * TINY_PATCH * 3
        return torch.tensor(ids), {
            "pixel_values": torch.randn(crops, side * side, pixels, generator=generator),
            "image_token_pooling": torch.cat([low_pooled, canvas_pooled]),
            "image_grids": torch.tensor([[rows, cols, canvas_rows, canvas_cols]]),
            "image_num_crops": torch.tensor([crops])}

    def processor(self, model_type: str, tokenizer, *, max_tiles: int, **_):
        """Up to ``max_tiles`` crops of ``TINY_CROP`` pixels on the canvas, plus the global
        crop; ``<im_col>`` after the canvas's rows only, as the checkpoints' processor."""
        import transformers as tf
        sizes = dict(size={"height": TINY_CROP, "width": TINY_CROP}, patch_size=TINY_PATCH,
                     pooling_size=list(TINY_POOL))
        images = tf.Molmo2ImageProcessor(max_crops=max_tiles,
                                         overlap_margins=list(TINY_MARGINS), **sizes)
        return tf.Molmo2Processor(image_processor=images, tokenizer=tokenizer,
                                  video_processor=tf.Molmo2VideoProcessor(**sizes),
                                  use_single_crop_col_tokens=False,
                                  chat_template=self.spec.chat_template)
