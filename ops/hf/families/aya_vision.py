"""Aya Vision: GotOcr2's tiles, as InternVL's: each picture is a canvas of rows x cols
square tiles (the optimal canvas for its aspect ratio) plus a thumbnail of the whole
picture when there is more than one tile, each tile's SigLIP patches pixel-shuffled
``downsample_factor`` squared to one token (row-major). Its prompt
(``AyaVisionProcessor.replace_image_token``)::

    <|START_OF_IMG|> (TILE_k tile) per tile  TILE_GLOBAL thumbnail <|END_OF_IMG|>

with ``<|IMG_PATCH|>`` (the image token) for every token of a tile; a picture of one tile
is ``TILE_GLOBAL`` and that tile alone. Each tile is thus one run of image tokens, and a
picture's last run follows ``TILE_GLOBAL`` (one token, as the models' tokenizer keeps it);
the canvas, which the processor drops, is read back from ``pixel_values``' tiles."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS, VISION_END, VISION_START
from .base import Family, TinySpec, llava_template, register
from .gemma3 import alternating_layers
from .internvl import tiled_pictures
from .layout import ImageTokens, image_positions, image_runs, patches_per_side, thumbnail

WHO = "headscope.hf.Tracer"

# The tiny models' marker tokens; <|IMG_PATCH|> is the shared IMAGE_TOKEN, <|START_OF_IMG|>
# and <|END_OF_IMG|> VISION_START and VISION_END
TILE = MARKER_IDS[2]         # TILE (of "TILE_k"; "_k" is a word of its own)
TILE_GLOBAL = MARKER_IDS[3]  # TILE_GLOBAL
LINE_BREAK = MARKER_IDS[4]   # <|IMG_LINE_BREAK|>, which the processor never writes
TEXT_IMAGE = MARKER_IDS[5]   # <image>, which the processor replaces in the text
TINY_TILE = 16               # the tiny vision tower's input size in pixels: one tile


def tile_side(config) -> int:
    """Tokens along each side of one tile (and of the thumbnail)."""
    return patches_per_side(config.vision_config) // int(config.downsample_factor)


@register
class AyaVision(Family):
    name = "aya_vision"
    titles = ("Aya Vision",)
    model_types = ("aya_vision",)
    layout = ("rows x cols tiles on the optimal canvas plus a thumbnail (more than one "
              "tile), each a square token grid after the pixel shuffle, TILE_k before each "
              "tile, TILE_GLOBAL before the thumbnail")
    input_keys = ("pixel_values",)
    tiny = TinySpec(
        tokens={"<|IMG_PATCH|>": IMAGE_TOKEN, "<|START_OF_IMG|>": VISION_START,
                "<|END_OF_IMG|>": VISION_END, "TILE": TILE, "TILE_GLOBAL": TILE_GLOBAL,
                "<|IMG_LINE_BREAK|>": LINE_BREAK, "<image>": TEXT_IMAGE, "</s>": EOS},
        chat_template=llava_template(), grids=((2, 2), (1, 3)),
        effects={"aya_vision": ("mask",)})

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        side = tile_side(config)
        ids = inputs["input_ids"].cpu()
        per_row = image_positions(ids, self.image_token_ids(config))
        pictures = [[(torch.cat(runs), len(runs)) for runs in _pictures(ids[b], positions, side)]
                    for b, positions in enumerate(per_row)]
        return tiled_pictures(config, pictures, side, inputs.get("pixel_values"))

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
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

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
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

    def tiny_processor(self, model_type: str, tokenizer, *, max_tiles: int, **_):
        """Up to ``max_tiles`` tiles of 16 x 16 pixels and a thumbnail, 4 tokens each."""
        import transformers as tf
        images = tf.GotOcr2ImageProcessor(size={"height": TINY_TILE, "width": TINY_TILE},
                                          crop_to_patches=True, min_patches=1,
                                          max_patches=max_tiles)
        return tf.AyaVisionProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                     img_size=TINY_TILE, downsample_factor=2,
                                     chat_template=self.tiny.chat_template)


def _pictures(ids: torch.Tensor, positions: torch.Tensor, side: int
              ) -> List[List[torch.Tensor]]:
    """One row's pictures, each its tiles' runs of positions in order (the thumbnail
    last): every run is one tile, and a picture ends with the run after ``TILE_GLOBAL``,
    the token before the row's last run."""
    if not len(positions):
        return []
    found = image_runs(WHO, positions, side)
    global_marker = int(ids[int(found[-1][0]) - 1])
    pictures, current = [], []
    for run in found:
        current.append(run)
        if int(ids[int(run[0]) - 1]) == global_marker:
            pictures.append(current)
            current = []
    return pictures
