"""Molmo 2: each picture is two views, in this order: the whole picture resized to one
crop (``global``, low resolution), then the picture resized to a canvas that overlapping
crops cover (``canvas``, high resolution). Each image token pools a window of
``ph x pw`` patches through ``image_token_pooling`` (indices into the flattened patches of
every crop, -1 where a window overhangs the view), and the processor lays each view's
windows row-major over the view's patch grid, centred (the canvas's patch grid being the
crops' patches without their overlap margins); ``image_grids`` gives the views' token
grids. A token's place on the picture is thus where its pooled patches lie: the view's
patch grid cut into windows, the edge windows reaching past the picture by their padding.
The prompt (``Molmo2Processor.replace_image_token``)::

    <low_res_im_start> (<im_patch> * cols [<im_col>]) * rows <im_end>
    <im_start> (<im_patch> * cols <im_col>) * rows <im_end>

(``<im_col>`` after the global view's rows where the processor is set so; the checkpoints'
are not). All of these tokens are the picture's block, which attends bidirectionally
(``mm_token_type_ids`` 1); only ``<im_patch>`` holds the picture (the pooled features are
added onto its embedding), the markers are text positions, region -1."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START
from .base import Family, TinySpec, llava_template, missing_input, register
from .layout import Box, ImageTokens, View, image_positions, patches_per_side, split_images

WHO = "headscope.hf.Tracer"

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


@register
class Molmo2(Family):
    name = "molmo2"
    titles = ("Molmo 2",)
    model_types = ("molmo2",)
    layout = ("global view (the picture resized to one crop), then the canvas of "
              "overlapping crops, each token pooling a window of patches by index "
              "(image_token_pooling), <im_col> after each row")
    input_keys = ("image_grids", "image_token_pooling", "video_grids")
    tiny = TinySpec(
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

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        grids, pooling = inputs.get("image_grids"), inputs.get("image_token_pooling")
        if inputs.get("video_grids") is not None:  # frames' tokens are <im_patch> too
            raise ValueError(f"{WHO}: regions of a Molmo 2 video prompt (video_grids) are not "
                             f"supported; pictures (image_grids) are")
        if grids is None:
            raise missing_input(config, "image_grids", " (each picture's token grids)")
        if pooling is None:
            raise missing_input(config, "image_token_pooling",
                                " (the patches each token pools: its place on the picture)")
        grids = grids.reshape(-1, 4).tolist()
        counts = [rows * cols + canvas_rows * canvas_cols
                  for rows, cols, canvas_rows, canvas_cols in grids]
        if sum(counts) != len(pooling):
            raise ValueError(f"{WHO}: image_grids give {sum(counts)} image tokens but "
                             f"image_token_pooling pools {len(pooling)}")
        side = patches_per_side(config.vision_config)
        pictures = []
        for (rows, cols, canvas_rows, canvas_cols), end in zip(grids, _ends(counts)):
            first = end - rows * cols - canvas_rows * canvas_cols
            pooled = pooling[first:first + rows * cols].cpu()
            window = pooling_window(pooled, rows, cols, side)
            canvas = pooling[first + rows * cols:end].cpu()
            pictures.append(((rows, cols, view_box(pooled, rows, cols, window)),
                             (canvas_rows, canvas_cols,
                              view_box(canvas, canvas_rows, canvas_cols, window))))
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        views = iter(pictures)
        return [[_picture(positions, *next(views)) for positions in row]
                for row in split_images(WHO, per_row, counts)]

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
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

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
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

    def tiny_processor(self, model_type: str, tokenizer, *, max_tiles: int, **_):
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
                                  chat_template=self.tiny.chat_template)


def _ends(counts: Sequence[int]) -> List[int]:
    return torch.tensor(counts).cumsum(0).tolist()


def windows_grid(pooled: torch.Tensor, rows: int, cols: int, window: Tuple[int, int]
                 ) -> torch.Tensor:
    """``(rows * ph, cols * pw)``: the patch indices that ``pooled`` ``(rows * cols,
    ph * pw)`` (one row-major window per token, tokens row-major) pools, laid back out on
    the view's grid (-1: padding)."""
    ph, pw = window
    return pooled.reshape(rows, cols, ph, pw).permute(0, 2, 1, 3).reshape(rows * ph, cols * pw)


def pooling_window(pooled: torch.Tensor, rows: int, cols: int, side: int) -> Tuple[int, int]:
    """``(ph, pw)``: the windows by which the global view's tokens ``pooled`` pool its crop
    of ``side x side`` patches: the one shape under which they lay the crop's patches out
    in their own order, row-major."""
    size = pooled.shape[1]
    for ph in range(1, size + 1):
        if size % ph:
            continue
        window = (ph, size // ph)
        if rows * ph < side or cols * window[1] < side:
            continue
        grid = windows_grid(pooled, rows, cols, window)
        patches = grid[grid >= 0]
        if len(patches) == side * side and torch.equal(
                patches - patches[0], torch.arange(side * side, dtype=patches.dtype)):
            return window
    raise ValueError(f"{WHO}: image_token_pooling's first {rows * cols} rows do not pool a "
                     f"picture's global crop of {side} x {side} patches in windows, row-major "
                     f"(as Molmo2ImageProcessor lays them out)")


def view_box(pooled: torch.Tensor, rows: int, cols: int, window: Tuple[int, int]) -> Box:
    """Where the ``rows x cols`` tokens ``pooled`` of one view lie on the picture: its
    patch grid (the pooled patches, each once) spans the whole picture, and the windows
    that overhang it (the padding, -1) reach past its edges."""
    grid = windows_grid(pooled, rows, cols, window)
    valid = grid >= 0
    used_rows, used_cols = valid.any(1).nonzero().flatten(), valid.any(0).nonzero().flatten()
    top, left = int(used_rows[0]), int(used_cols[0])
    height, width = int(used_rows[-1]) - top + 1, int(used_cols[-1]) - left + 1
    patches = grid[top:top + height, left:left + width]
    if int(valid.sum()) != height * width or not bool((patches >= 0).all()) \
            or len(patches.unique()) != height * width:
        raise ValueError(f"{WHO}: image_token_pooling's windows of a {rows} x {cols} view do "
                         f"not cover one grid of patches, each once")
    ph, pw = window
    return (-left / width, -top / height, (cols * pw - left) / width, (rows * ph - top) / height)


def _picture(positions: torch.Tensor, global_view, canvas_view) -> ImageTokens:
    rows, cols, box = global_view
    canvas_rows, canvas_cols, canvas_box = canvas_view
    cut = rows * cols
    canvas = View("canvas", positions[cut:], canvas_rows, canvas_cols, canvas_box)
    return ImageTokens((View("global", positions[:cut], rows, cols, box), canvas), canvas)


# ---- the tiny processor's layout, for the tiny prompts --------------------------------------

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
