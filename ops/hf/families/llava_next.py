"""LLaVA-NeXT: per picture a base view (the picture squashed to the vision tower's square
input) and then the "anyres" tiles stitched into one grid, unpadded to the picture's aspect
ratio, with a newline feature after each of its rows; the newline features sit at
image-token positions of ``input_ids`` and belong to no view. ``image_sizes`` gives each
picture's original (height, width)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN
from .base import Family, TinySpec, llava_template, missing_input, register
from .layout import WHOLE, Box, ImageTokens, View, image_positions, patches_per_side, split_images
from .llava import clip_vision

WHO = "headscope.hf.Tracer"

# (name, rows, cols, box, marker tokens after each row, marker tokens after the view)
Piece = Tuple[str, int, int, Box, int, int]


def anyres_tiles(config, height: int, width: int) -> Tuple[int, int, Box]:
    """``(rows, cols, box)`` of the stitched tile grid of a ``height x width`` picture
    after unpadding, as the model's ``get_anyres_image_grid_shape`` and ``unpad_image``
    (and the processor's ``_get_unpadded_features``) derive it; ``box`` is where those
    tokens' cells lie on the picture, from where the image processor put the picture on
    the padded canvas (resized to fit, centred), so an edge row or column that is partly
    padding reaches a little outside [0, 1]."""
    from transformers.image_processing_utils import select_best_resolution
    vision = config.vision_config
    tile = int(vision.image_size)
    side = patches_per_side(vision)
    canvas_h, canvas_w = select_best_resolution([height, width], config.image_grid_pinpoints)
    rows, cols = canvas_h // tile * side, canvas_w // tile * side
    top = left = 0
    # the same expressions as unpad_image, so the same rounding
    if width / height > cols / rows:
        new = int(round(height * (cols / width), 7))
        top = (rows - new) // 2
        rows -= 2 * top
    else:
        new = int(round(width * (rows / height), 7))
        left = (cols - new) // 2
        cols -= 2 * left
    # the picture on the canvas: get_patch_output_size, then _get_padding_size's centring
    if canvas_w / width < canvas_h / height:
        shown_w, shown_h = canvas_w, min(math.ceil(height * (canvas_w / width)), canvas_h)
    else:
        shown_h, shown_w = canvas_h, min(math.ceil(width * (canvas_h / height)), canvas_w)
    x, y = (canvas_w - shown_w) // 2, (canvas_h - shown_h) // 2
    cell = tile / side  # pixels of the canvas per token
    box = ((left * cell - x) / shown_w, (top * cell - y) / shown_h,
           ((left + cols) * cell - x) / shown_w, ((top + rows) * cell - y) / shown_h)
    return rows, cols, box


def token_count(pieces: Sequence[Piece]) -> int:
    """How many image-token positions ``pieces`` take, markers included."""
    return sum(rows * (cols + per_row) + after for _, rows, cols, _, per_row, after in pieces)


def lay_out(positions: torch.Tensor, pieces: Sequence[Piece]) -> ImageTokens:
    """The picture whose image tokens are at ``positions`` (in order): the views of
    ``pieces`` one after the other, each row followed by its marker tokens; the grid is
    the tiles view where there is one, else the first view."""
    views, taken, at = [], [], 0
    for name, rows, cols, box, per_row, after in pieces:
        index = (torch.arange(rows)[:, None] * (cols + per_row) + torch.arange(cols)).flatten()
        views.append(View(name, positions[index + at], rows, cols, box))
        taken.append(index + at)
        at += rows * (cols + per_row) + after
    is_marker = torch.ones(len(positions), dtype=torch.bool)
    is_marker[torch.cat(taken)] = False
    tiles = [v for v in views if v.name == "tiles"]
    return ImageTokens(tuple(views), tiles[0] if tiles else views[0], positions[is_marker])


@register
class LlavaNext(Family):
    name = "llava_next"
    titles = ("LLaVA-NeXT",)
    model_types = ("llava_next",)
    layout = ("base view (the picture squashed to the tower's square), then the anyres tiles "
              "stitched and unpadded to the picture's aspect ratio, a newline after each row")
    input_keys = ("image_sizes",)
    tiny = TinySpec(tokens={"<image>": IMAGE_TOKEN, "</s>": EOS}, chat_template=llava_template(),
                    effects={"llava_next": ("mask", "zero")},
                    unseen_region_effects=("llava_next",))

    def pieces(self, config, inputs: Dict[str, Any], index: int, height: int, width: int
               ) -> List[Piece]:
        """Picture ``index``'s views and markers in sequence order (``pack_image_features``)."""
        side = patches_per_side(config.vision_config)
        rows, cols, box = anyres_tiles(config, height, width)
        return [("base", side, side, WHOLE, 0, 0), ("tiles", rows, cols, box, 1, 0)]

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        sizes = inputs.get("image_sizes")
        if sizes is None:
            raise missing_input(config, "image_sizes", " (each picture's original size)")
        pieces = [self.pieces(config, inputs, i, int(h), int(w))
                  for i, (h, w) in enumerate(sizes.tolist())]
        counts = [token_count(p) for p in pieces]
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = iter(pieces)
        return [[lay_out(positions, next(pictures)) for positions in row]
                for row in split_images(WHO, per_row, counts)]

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        import transformers as tf
        vision = clip_vision(vision_hidden)
        return tf.LlavaNextConfig(
            text_config=dict(text, model_type="llama"), vision_config=vision,
            image_token_index=ids["image_token_id"], image_grid_pinpoints=tiny_pinpoints(vision),
            image_seq_length=(vision["image_size"] // vision["patch_size"]) ** 2,
            vision_feature_layer=-1, vision_feature_select_strategy="default"), \
            tf.LlavaNextForConditionalGeneration

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """A picture of ``grid`` patches of the vision tower (height x width), as the
        processor gives it: the base and its tiles (batch, tiles, 3, size, size), its size
        in ``image_sizes`` and its image tokens, newlines included."""
        from transformers.image_processing_utils import select_best_resolution
        config = model.config
        vc = config.vision_config
        height, width = grid[0] * vc.patch_size, grid[1] * vc.patch_size
        canvas_h, canvas_w = select_best_resolution([height, width], config.image_grid_pinpoints)
        tiles = 1 + (canvas_h // vc.image_size) * (canvas_w // vc.image_size)
        sizes = torch.tensor([[height, width]])
        pixels = torch.randn(1, tiles, 3, vc.image_size, vc.image_size, generator=generator)
        count = token_count(self.pieces(config, {"image_sizes": sizes}, 0, height, width))
        return torch.full((count,), IMAGE_TOKEN), {"pixel_values": pixels, "image_sizes": sizes}

    def tiny_processor(self, model_type: str, tokenizer, **_):
        """A base and tiles of 16 x 16 pixels on the canvases of :func:`tiny_pinpoints`."""
        import transformers as tf
        vision = clip_vision(32)
        tile = vision["image_size"]
        images = tf.LlavaNextImageProcessor(size={"shortest_edge": tile},
                                            crop_size={"height": tile, "width": tile},
                                            image_grid_pinpoints=tiny_pinpoints(vision))
        return tf.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer,
                                     patch_size=vision["patch_size"],
                                     vision_feature_select_strategy="default",
                                     num_additional_image_tokens=1,
                                     chat_template=self.tiny.chat_template)


def tiny_pinpoints(vision: Dict[str, Any]) -> List[List[int]]:
    """The real checkpoints' canvases (1x2, 2x1, 2x2, 3x1 and 1x3 tiles) for the tiny
    tower's tile size."""
    tile = vision["image_size"]
    return [[tile * r, tile * c] for r, c in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]
