"""Idefics3 and SmolVLM: a picture is rows x cols tiles plus a global image (the whole
picture downscaled to one tile), each a square grid of ``image_seq_len`` tokens (patches
pixel-shuffled ``scale_factor`` squared to one token), with ``<fake_token_around_image>
<row_i_col_j>`` before each tile, a newline after each row of tiles and
``<fake_token_around_image><global-img>`` before the global image (only the global image
when the picture is not split; each frame of a SmolVLM video is such a picture).

The processor drops each picture's rows and cols; they are read back from the layout of
its prompt string (``get_image_prompt_string``): each tile or global image is one run of
``image_seq_len`` image tokens, two tiles of one row are two marker tokens apart, a new
row of tiles follows a newline, and every picture ends with its global image, whose
``<global-img>`` marker is the token before the last run of image tokens in a row. This
needs a tokenizer that keeps each marker one token and gives the newline a token, as the
models' own tokenizers do; a prompt that does not fit raises."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS
from .base import Family, TinySpec, llava_template, register
from .layout import (WHOLE, ImageTokens, View, image_positions, image_runs, patches_per_side,
                     stitch, tile_boxes)

WHO = "headscope.hf.Tracer"

# Marker ids of the tiny vocabulary: special tokens among MARKER_IDS, the 6 x 6
# ``<row_i_col_j>`` markers at ordinary text ids below the image token.
FAKE_TOKEN = MARKER_IDS[2]        # <fake_token_around_image>
GLOBAL_TOKEN = MARKER_IDS[3]      # <global-img>
NEWLINE = MARKER_IDS[4]           # "\n"
END_OF_UTTERANCE = MARKER_IDS[5]  # <end_of_utterance>
ROW_COL_BASE = 464     # <row_{i+1}_col_{j+1}> is ROW_COL_BASE + 6 * i + j
TINY_TILE = 16         # the tiny vision tower's input size in pixels: one tile
TINY_TOKENS = {"<image>": IMAGE_TOKEN, "</s>": EOS, "<fake_token_around_image>": FAKE_TOKEN,
               "<global-img>": GLOBAL_TOKEN, "\n": NEWLINE,
               "<end_of_utterance>": END_OF_UTTERANCE,
               **{f"<row_{i + 1}_col_{j + 1}>": ROW_COL_BASE + 6 * i + j
                  for i in range(6) for j in range(6)}}


def tile_side(config) -> int:
    """Tokens along each side of one tile (and of the global image)."""
    return patches_per_side(config.vision_config) // int(config.scale_factor)


@register
class Idefics3(Family):
    name = "idefics3"
    titles = ("Idefics3", "SmolVLM")
    model_types = ("idefics3", "smolvlm")
    layout = ("rows x cols tiles plus a global image, each a square token grid (pixel "
              "shuffle), with <row_i_col_j>, newline and <global-img> markers")
    tiny = TinySpec(tokens=TINY_TOKENS, chat_template=llava_template(),
                    grids=((2, 2), (1, 3)), commands=("idefics3",))

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        side = tile_side(config)
        ids = inputs["input_ids"].cpu()
        per_row = image_positions(ids, self.image_token_ids(config))
        return [self._row(ids[b], positions, side) for b, positions in enumerate(per_row)]

    def _row(self, ids: torch.Tensor, positions: torch.Tensor, side: int
             ) -> List[ImageTokens]:
        if not len(positions):
            return []
        runs = image_runs(WHO, positions, side)
        global_marker = int(ids[runs[-1][0] - 1])  # every picture ends with its global image
        pictures, rows = [], []
        for run in runs:
            start = int(run[0])
            if int(ids[start - 1]) == global_marker:
                pictures.append(_picture(rows, run, side, start))
                rows = []
            elif rows and start - int(rows[-1][-1][-1]) == 3:  # <fake><row_i_col_j> apart
                rows[-1].append(run)
            else:
                rows.append([run])
        if rows:
            raise ValueError(f"{WHO}: tiles at positions {int(rows[0][0][0])}.. are not "
                             f"followed by their picture's global image")
        return pictures

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        import transformers as tf
        # intermediate_size 48: the random weights (drawn vision tower first) whose greedy
        # answers to the tests' prompts hold no image token, which would make prompt plus
        # answer invalid input for the model itself
        common = dict(text_config=dict(text, model_type="llama"),
                      vision_config=dict(hidden_size=vision_hidden, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         image_size=TINY_TILE, patch_size=4),
                      scale_factor=2, image_token_id=ids["image_token_id"])
        if model_type == "idefics3":
            return tf.Idefics3Config(**common), tf.Idefics3ForConditionalGeneration
        return tf.SmolVLMConfig(**common), tf.SmolVLMForConditionalGeneration

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the picture's rows x cols tiles ((0, 0): not split), laid out as
        ``get_image_prompt_string`` does, with a tokenizer that gives "\\n" one token."""
        rows, cols = grid
        seq = [IMAGE_TOKEN] * tile_side(model.config) ** 2
        ids = []
        for i in range(rows):
            for j in range(cols):
                ids += [FAKE_TOKEN, ROW_COL_BASE + 6 * i + j] + seq
            ids.append(NEWLINE)
        ids += ([NEWLINE] if rows else []) + [FAKE_TOKEN, GLOBAL_TOKEN] + seq + [FAKE_TOKEN]
        size = model.config.vision_config.image_size
        count = rows * cols + 1
        pixels = torch.randn(1, count, 3, size, size, generator=generator)
        mask = torch.ones(1, count, size, size, dtype=torch.int64)
        return torch.tensor(ids), {"pixel_values": pixels, "pixel_attention_mask": mask}

    def tiny_processor(self, model_type: str, tokenizer, **_):
        """Longest edge 48 pixels, up to 3 x 3 tiles of 16 x 16 pixels and a global image,
        4 tokens each (Idefics3; SmolVLM's processor needs num2words)."""
        import transformers as tf
        if model_type != "idefics3":
            raise NotImplementedError(f"headscope.hf.testing.tiny_processor: no tiny "
                                      f"{model_type} processor (SmolVLMProcessor needs "
                                      f"num2words); build one from tiny_tokenizer")
        images = tf.Idefics3ImageProcessor(size={"longest_edge": 3 * TINY_TILE},
                                           max_image_size={"longest_edge": TINY_TILE})
        return tf.Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                    image_seq_len=4, chat_template=self.tiny.chat_template)


def _picture(rows: List[List[torch.Tensor]], global_run: torch.Tensor, side: int,
             start: int) -> ImageTokens:
    """One picture from its tiles' runs (by row) and its global image's run."""
    whole = View("global", global_run, side, side, WHOLE)
    if not rows:
        return ImageTokens((whole,))
    R, C = len(rows), len(rows[0])
    if any(len(r) != C for r in rows) or R * C < 2:
        raise ValueError(f"{WHO}: the tiles before the global image at position {start} do "
                         f"not form a grid of rows x cols >= 2 tiles (tiles per row: "
                         f"{[len(r) for r in rows]})")
    if start - int(rows[-1][-1][-1]) <= 3:
        raise ValueError(f"{WHO}: no newline token between the last tile and the global "
                         f"image at position {start}: the rows of tiles cannot be told apart "
                         f"(a tokenizer that drops newlines?)")
    tiles = tuple(View("tile", run, side, side, box)
                  for run, box in zip([run for row in rows for run in row], tile_boxes(R, C)))
    stitched = stitch(torch.stack([torch.stack(row) for row in rows])).flatten()
    return ImageTokens(tiles + (whole,), View("tiles", stitched, R * side, C * side, WHOLE))
