"""LLaVA-OneVision: LLaVA-NeXT's layout (a base view, then the anyres tiles stitched,
unpadded and followed row by row by a newline feature at image-token positions), the tiles
grid scaled down when it holds more than ``vision_aspect_ratio``'s ``anyres_max_N`` tiles'
worth of tokens; a picture of a prompt with several pictures (``batch_num_images``) is
only its base view of the picture padded to a square, and one newline."""
from __future__ import annotations

import math
from typing import Any, Dict, List

from .base import register
from .layout import WHOLE, patches_per_side
from .llava_next import LlavaNext, Piece, anyres_tiles


@register
class LlavaOnevision(LlavaNext):
    name = "llava_onevision"
    titles = ("LLaVA-OneVision",)
    model_types = ("llava_onevision",)
    layout = ("base view, then the anyres tiles stitched, unpadded and scaled down to at most "
              "anyres_max_N tiles' tokens, a newline after each row; several pictures in a "
              "prompt: the base view of the picture padded to a square and one newline")
    input_keys = ("image_sizes", "batch_num_images")

    def pieces(self, config, inputs: Dict[str, Any], index: int, height: int, width: int
               ) -> List[Piece]:
        side = patches_per_side(config.vision_config)
        counts = inputs.get("batch_num_images")
        if counts is not None:
            patched = [n == 1 for n in counts.tolist() for _ in range(n)]
            if not patched[index]:
                # the image processor's pad_to_square: centred on the longer side
                edge = max(height, width)
                x, y = (edge - width) // 2, (edge - height) // 2
                box = (-x / width, -y / height, (edge - x) / width, (edge - y) / height)
                return [("base", side, side, box, 0, 1)]
        rows, cols, box = anyres_tiles(config, height, width)
        # pack_image_features' bilinear downscaling keeps the grid's extent, not its cells
        most = int(getattr(config, "vision_aspect_ratio", "anyres_max_9").strip("anyres_max_"))
        ratio = math.sqrt(rows * cols / (most * side ** 2))
        if ratio > 1.1:
            rows, cols = int(rows // ratio), int(cols // ratio)
        return [("base", side, side, WHOLE, 0, 0), ("tiles", rows, cols, box, 1, 0)]
