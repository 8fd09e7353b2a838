"""LLaVA-OneVision: LLaVA-NeXT's layout (a base view, then the anyres tiles stitched,
unpadded and followed row by row by a newline feature at image-token positions), the tiles
grid scaled down when it holds more than ``vision_aspect_ratio``'s ``anyres_max_N`` tiles'
worth of tokens; a picture of a prompt with several pictures (``batch_num_images``) is
only its base view of the picture padded to a square, and one newline."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN, VIDEO_TOKEN
from .base import TinySpec, llava_template, register
from .layout import WHOLE, patches_per_side
from .llava_next import LlavaNext, Piece, anyres_tiles, tiny_pinpoints


@register
class LlavaOnevision(LlavaNext):
    name = "llava_onevision"
    titles = ("LLaVA-OneVision",)
    model_types = ("llava_onevision",)
    layout = ("base view, then the anyres tiles stitched, unpadded and scaled down to at most "
              "anyres_max_N tiles' tokens, a newline after each row; several pictures in a "
              "prompt: the base view of the picture padded to a square and one newline")
    input_keys = ("image_sizes", "batch_num_images")
    tiny = TinySpec(tokens={"<image>": IMAGE_TOKEN, "<video>": VIDEO_TOKEN, "</s>": EOS},
                    chat_template=llava_template(), effects={"llava_onevision": ("mask",)},
                    unseen_region_effects=("llava_onevision",))

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

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        import transformers as tf
        vision = tiny_siglip(vision_hidden)
        return tf.LlavaOnevisionConfig(
            text_config=dict(text, model_type="qwen2"), vision_config=vision,
            image_token_index=ids["image_token_id"], video_token_index=ids["video_token_id"],
            image_grid_pinpoints=tiny_pinpoints(vision), vision_aspect_ratio=TINY_ASPECT,
            vision_feature_layer=-1, vision_feature_select_strategy="full"), \
            tf.LlavaOnevisionForConditionalGeneration

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        ids, inputs = super().tiny_image(model, grid, generator)
        return ids, dict(inputs, batch_num_images=torch.tensor([1]))

    def tiny_processor(self, model_type: str, tokenizer, **_):
        """A base and tiles of 16 x 16 pixels (SigLIP) on the canvases of
        ``tiny_pinpoints``."""
        import transformers as tf
        vision = tiny_siglip(32)
        tile = vision["image_size"]
        images = tf.LlavaOnevisionImageProcessor(size={"height": tile, "width": tile},
                                                 image_grid_pinpoints=tiny_pinpoints(vision))
        return tf.LlavaOnevisionProcessor(
            image_processor=images, tokenizer=tokenizer,
            video_processor=tf.LlavaOnevisionVideoProcessor(size={"height": tile, "width": tile}),
            num_image_tokens=(tile // vision["patch_size"]) ** 2,
            vision_feature_select_strategy="full", vision_aspect_ratio=TINY_ASPECT,
            chat_template=self.tiny.chat_template)


# The tiny models' tiles grids hold at most about two tiles' tokens, so that a 2 x 2 canvas
# is scaled down (the real checkpoints: anyres_max_9 of up to 6 x 6 tiles).
TINY_ASPECT = "anyres_max_2"


def tiny_siglip(hidden: int) -> Dict[str, Any]:
    """The tiny OneVision tower: SigLIP (no CLS token, all features used), 16 x 16 pixels in
    patches of 4, two blocks."""
    return dict(model_type="siglip_vision_model", hidden_size=hidden, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)
