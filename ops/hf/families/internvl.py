"""InternVL: each picture is a canvas of rows x cols square tiles (the optimal canvas for
its aspect ratio) plus a thumbnail of the whole picture when there is more than one tile,
each tile pixel-shuffled to ``image_seq_length`` tokens, between ``<img>`` and ``</img>``;
the canvas (which the processor drops) is read back from ``pixel_values``' tiles."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN
from .base import Family, TinySpec, llava_template, missing_input, register
from .layout import (ImageTokens, canvas_and_thumbnail, image_positions, patches_per_side,
                     runs, thumbnail)

WHO = "headscope.hf.Tracer"

# The tiny models' marker tokens
IMAGE_START = MARKER_IDS[2]  # <img>
IMAGE_END = MARKER_IDS[3]    # </img>


@register
class InternVL(Family):
    name = "internvl"
    titles = ("InternVL",)
    model_types = ("internvl",)
    layout = ("rows x cols tiles on the optimal canvas plus a thumbnail (more than one "
              "tile), each a square token grid after the pixel shuffle, between <img> and "
              "</img>")
    input_keys = ("pixel_values",)
    tiny = TinySpec(
        tokens={"<IMG_CONTEXT>": IMAGE_TOKEN, "<video>": VIDEO_TOKEN, "<img>": IMAGE_START,
                "</img>": IMAGE_END, "</s>": EOS},
        tokenizer_extras={"start_image_token": "<img>", "end_image_token": "</img>",
                          "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        chat_template=llava_template("<IMG_CONTEXT> "), grids=((2, 2), (1, 3)),
        effects={"internvl": ("mask",)}, commands=("internvl",))

    def side(self, config) -> int:
        """Tokens per side of a tile: its patches per side times the shuffle's ratio."""
        return int(patches_per_side(config.vision_config) * float(config.downsample_ratio))

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        side = self.side(config)
        per_tile = side * side
        pictures = []
        for row in image_positions(inputs["input_ids"], self.image_token_ids(config)):
            pictures.append([])
            for positions in runs(row):
                if len(positions) % per_tile:
                    raise ValueError(f"{WHO}: a picture of {len(positions)} image tokens is "
                                     f"not a whole number of tiles of {per_tile} tokens")
                pictures[-1].append((positions, len(positions) // per_tile))
        return tiled_pictures(config, pictures, side, inputs.get("pixel_values"))

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        import transformers as tf
        return tf.InternVLConfig(
            text_config=dict(text, model_type="qwen2", use_sliding_window=False),
            vision_config=dict(hidden_size=vision_hidden, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2,
                               image_size=[16, 16], patch_size=[4, 4]),
            image_token_id=ids["image_token_id"], image_seq_length=4, downsample_ratio=0.5,
            vision_feature_layer=-1, vision_feature_select_strategy="default",
            tie_word_embeddings=False), tf.InternVLForConditionalGeneration

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the canvas's rows x cols tiles; the tiles are cut from one random
        picture and the thumbnail is that picture downscaled, as the processor makes them."""
        vc = model.config.vision_config
        size = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
        rows, cols = grid
        picture = torch.randn(vc.num_channels, rows * size, cols * size, generator=generator)
        tiles = [picture[:, r * size:(r + 1) * size, c * size:(c + 1) * size]
                 for r in range(rows) for c in range(cols)]
        if len(tiles) > 1:
            tiles.append(thumbnail(picture, size))
        tokens = self.side(model.config) ** 2 * len(tiles)
        ids = torch.cat([torch.tensor([IMAGE_START]), torch.full((tokens,), IMAGE_TOKEN),
                         torch.tensor([IMAGE_END])])
        return ids, {"pixel_values": torch.stack(tiles)}

    def tiny_processor(self, model_type: str, tokenizer, *, max_tiles: int, **_):
        """Up to ``max_tiles`` tiles of 16 x 16 pixels and a thumbnail, 4 tokens each."""
        import transformers as tf
        images = tf.GotOcr2ImageProcessor(size={"height": 16, "width": 16}, crop_to_patches=True,
                                          min_patches=1, max_patches=max_tiles)
        return tf.InternVLProcessor(image_processor=images, tokenizer=tokenizer,
                                    video_processor=tf.InternVLVideoProcessor(),
                                    image_seq_length=4, chat_template=self.tiny.chat_template)


def tiled_pictures(config, pictures: List[List[Tuple[torch.Tensor, int]]], side: int,
                   tiles: Optional[torch.Tensor]) -> List[List[ImageTokens]]:
    """Per batch row, its pictures of GotOcr2's tiles (``canvas_and_thumbnail``) from each
    picture's image positions and its count of tiles (the thumbnail among them), the
    canvases read from ``tiles`` (``pixel_values``, taken in order; None: only pictures of
    one tile can be read), checking that the counts add up."""
    out, used = [], 0
    for row in pictures:
        out.append([])
        for positions, count in row:
            if count > 1 and tiles is None:
                raise missing_input(config, "pixel_values",
                                    " (their tiles give each picture's canvas)")
            mine = tiles[used:used + count] if tiles is not None else None
            if mine is not None and len(mine) != count:
                raise ValueError(f"{WHO}: input_ids hold more tiles than pixel_values")
            used += count
            out[-1].append(canvas_and_thumbnail(positions, count, side, mine))
    if tiles is not None and used != len(tiles):
        raise ValueError(f"{WHO}: pixel_values hold {len(tiles)} tiles but input_ids {used}")
    return out
