"""The tests' side of Aya Vision (``headscope.hf.families.aya_vision``): the tiny random
models, one picture's prompt as the processor lays it out, the real processor sized to the
tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.aya_vision import AyaVision, tile_side
from ...families.layout import thumbnail
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VISION_END, VISION_START
from .gemma3 import alternating_layers

# The tiny models' marker tokens; <|IMG_PATCH|> is the shared IMAGE_TOKEN, <|START_OF_IMG|>
# and <|END_OF_IMG|> VISION_START and VISION_END
TILE = MARKER_IDS[2]         # TILE (of "TILE_k"; "_k" is a word of its own)
TILE_GLOBAL = MARKER_IDS[3]  # TILE_GLOBAL
LINE_BREAK = MARKER_IDS[4]   # <|IMG_LINE_BREAK|>, which the processor never writes
TEXT_IMAGE = MARKER_IDS[5]   # <image>, which the processor replaces in the text
TINY_TILE = 16               # the tiny vision tower's input size in pixels: one tile


@register_tiny(AyaVision)
class TinyAyaVision(TinyFamily):
    spec = TinySpec(
        tokens={"<|IMG_PATCH|>": IMAGE_TOKEN, "<|START_OF_IMG|>": VISION_START,
                "<|END_OF_IMG|>": VISION_END, "TILE": TILE, "TILE_GLOBAL": TILE_GLOBAL,
                "<|IMG_LINE_BREAK|>": LINE_BREAK, "<image>": TEXT_IMAGE, "</s>": EOS},
        chat_template=llava_template(), grids=((2, 2), (1, 3)),
        effects={"aya_vision": ("mask",)})

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        # the checkpoints' Cohere 2 decoder: sliding-window layers with rope, every 4th a
        # full layer without (here every other); a window of 8, shorter than the prompts
        text = dict(text, model_type="cohere2", sliding_window=8,
                    layer_types=alternating_layers(text["num_hidden_layers"]))
        vision = dict(model_type="siglip_vision_model", hidden_size=vision_hidden,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=TINY_TILE, patch_size=4, vision_use_head=False)
        return tf.AyaVisionConfig(text_config=text, vision_config=vision,
                                  image_token_index=ids["image_token_id"],
                                  downsample_factor=2, vision_feature_layer=-1,
                                  vision_feature_select_strategy="full",
                                  tie_word_embeddings=False), \
            tf.AyaVisionForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the canvas's rows x cols tiles, laid out as ``replace_image_token``
        does with the tiny tokenizer ("TILE_k": TILE and an unknown word); the tiles are
        cut from one random picture and the thumbnail is that picture downscaled."""
        size = model.config.vision_config.image_size
        rows, cols = grid
        picture = torch.randn(3, rows * size, cols * size, generator=generator)
        tiles = [picture[:, r * size:(r + 1) * size, c * size:(c + 1) * size]
                 for r in range(rows) for c in range(cols)]
        if len(tiles) > 1:
            tiles.append(thumbnail(picture, size))
        tokens = [IMAGE_TOKEN] * tile_side(model.config) ** 2
        ids = [VISION_START]
        for _ in range(len(tiles) - 1):
            ids += [TILE, 1] + tokens
        ids += [TILE_GLOBAL] + tokens + [VISION_END]
        return torch.tensor(ids), {"pixel_values": torch.stack(tiles)}

    def processor(self, model_type: str, tokenizer, *, max_tiles: int, **_):
        """Up to ``max_tiles`` tiles of 16 x 16 pixels and a thumbnail, 4 tokens each."""
        import transformers as tf
        images = tf.GotOcr2ImageProcessor(size={"height": TINY_TILE, "width": TINY_TILE},
                                          crop_to_patches=True, min_patches=1,
                                          max_patches=max_tiles)
        return tf.AyaVisionProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                     img_size=TINY_TILE, downsample_factor=2,
                                     chat_template=self.spec.chat_template)
