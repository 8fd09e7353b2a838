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

from .base import Family, missing_input, register
from .layout import Box, ImageTokens, View, image_positions, patches_per_side, split_images

WHO = "headscope.hf.Tracer"


@register
class Molmo2(Family):
    name = "molmo2"
    titles = ("Molmo 2",)
    model_types = ("molmo2",)
    layout = ("global view (the picture resized to one crop), then the canvas of "
              "overlapping crops, each token pooling a window of patches by index "
              "(image_token_pooling), <im_col> after each row")
    input_keys = ("image_grids", "image_token_pooling", "video_grids")

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
