"""Where a VLM's image tokens are and which region each belongs to.

An image's tokens form a grid (rows x columns, row-major in the sequence): Qwen-VL
models give it per image in ``image_grid_thw`` (patches, merged ``spatial_merge_size``
squared to one token); LLaVA's is the vision tower's square patch grid.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Union

import torch

from ..attribution import ward_regions

Regions = Union[int, torch.Tensor, Callable]


class Image(NamedTuple):
    positions: torch.Tensor  # (rows * cols,) sequence positions of its tokens, row-major
    rows: int
    cols: int


def image_token_id(config) -> int:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"headscope.hf.Tracer: the model's config ({type(config).__name__}) names "
                     f"no image token (image_token_id)")


def _token_grids(config, image_grid_thw: Optional[torch.Tensor], count: int) -> List[tuple]:
    """(rows, cols) of each image of the batch, in sequence order; ``count``: the batch's
    image tokens."""
    vision = config.vision_config
    if image_grid_thw is not None:
        merge = int(getattr(vision, "spatial_merge_size", 1))
        grids = []
        for t, h, w in image_grid_thw.tolist():
            if t != 1:
                raise ValueError(f"headscope.hf.Tracer: regions need still images (temporal "
                                 f"grid 1), got image_grid_thw row {[t, h, w]}")
            grids.append((h // merge, w // merge))
        return grids
    if not hasattr(vision, "image_size"):  # grids per image (Qwen-VL): need image_grid_thw
        raise ValueError(f"headscope.hf.Tracer: regions of a {config.model_type} model need the "
                         f"image_grid_thw of its inputs, and model.generate does not pass it to "
                         f"the model's forward; generate with tr.generate(**inputs, ...) or "
                         f"tr.generate_with(on_span, **inputs, ...)")
    if getattr(config, "vision_feature_select_strategy", "default") != "default":
        raise ValueError("headscope.hf.Tracer: regions need the image's patch grid; with "
                         "vision_feature_select_strategy='full' the CLS token has no place "
                         "on it")
    side = int(vision.image_size) // int(vision.patch_size)
    return [(side, side)] * (count // (side * side))


def find_images(config, input_ids: torch.Tensor,
                image_grid_thw: Optional[torch.Tensor]) -> List[List[Image]]:
    """Per batch row, its images in sequence order."""
    is_image = input_ids == image_token_id(config)
    per_row = [row.nonzero().flatten() for row in is_image.cpu()]
    count = sum(len(p) for p in per_row)
    grids = _token_grids(config, image_grid_thw, count)
    images, g = [], 0
    for b, positions in enumerate(per_row):
        row, used = [], 0
        while used < len(positions):
            if g >= len(grids):
                raise ValueError(f"headscope.hf.Tracer: row {b} has more image tokens than "
                                 f"the images' grids account for")
            rows, cols = grids[g]
            g += 1
            row.append(Image(positions[used:used + rows * cols], rows, cols))
            used += rows * cols
        if used != len(positions):
            raise ValueError(f"headscope.hf.Tracer: row {b}'s {len(positions)} image tokens do "
                             f"not split into whole images of the given grids")
        images.append(row)
    if g != len(grids):
        raise ValueError(f"headscope.hf.Tracer: {len(grids)} image grids for {g} images in "
                         f"input_ids")
    return images


def grid_regions(rows: int, cols: int) -> Callable:
    """Regions for :class:`Tracer` (``regions=``) that cut each image's token grid into
    ``rows x cols`` blocks of (nearly) equal size, numbered row-major: block
    ``(i * rows // R, j * cols // C)`` holds token ``(i, j)`` of an ``R x C`` grid. For
    images whose content is laid out on a known grid, or to compare with patch-grid
    attributions."""
    if not (isinstance(rows, int) and isinstance(cols, int)) or rows < 1 or cols < 1:
        raise ValueError(f"headscope.hf.grid_regions: rows and cols must be ints >= 1, got "
                         f"{rows!r} x {cols!r}")

    def labels(features, grid) -> torch.Tensor:
        R, C = grid
        if rows > R or cols > C:
            raise ValueError(f"headscope.hf.grid_regions: a {rows}x{cols} grid of regions "
                             f"needs an image of at least that many tokens, got {R}x{C}")
        block_row = torch.arange(R) * rows // R
        block_col = torch.arange(C) * cols // C
        return (block_row[:, None] * cols + block_col[None, :]).reshape(-1)
    return labels


def parse_grid(text: str) -> tuple:
    """``"ROWSxCOLS"`` (e.g. ``"3x3"``, any case) as ``(rows, cols)``, both >= 1."""
    try:
        rows, cols = (int(n) for n in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"a grid is ROWSxCOLS (e.g. 3x3), got {text!r}") from None
    if rows < 1 or cols < 1:
        raise ValueError(f"a grid needs ROWS and COLS >= 1, got {text!r}")
    return rows, cols


def _labels(regions: Regions, image: Image, features: Optional[torch.Tensor]) -> torch.Tensor:
    """Region labels in [0, K) of one image's tokens, row-major."""
    M = image.rows * image.cols
    if isinstance(regions, int):
        if not 1 <= regions <= M:
            raise ValueError(f"headscope.hf.Tracer: argument 'regions' must be in [1, {M}] "
                             f"(the image's {image.rows}x{image.cols} tokens), got {regions}")
        return ward_regions(features.float().contiguous(), image.rows, image.cols, regions)
    labels = regions(features, (image.rows, image.cols)) if callable(regions) else regions
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 \
            or tuple(labels.shape) != (M,):
        raise ValueError(f"headscope.hf.Tracer: region labels must be an int64 tensor ({M},) "
                         f"for an image of {image.rows}x{image.cols} tokens, got "
                         f"{labels.dtype if isinstance(labels, torch.Tensor) else type(labels)} "
                         f"{tuple(getattr(labels, 'shape', ()))}")
    if M and (int(labels.min()) < 0):
        raise ValueError("headscope.hf.Tracer: region labels must be >= 0")
    return labels


def region_ids(regions: Regions, images: List[List[Image]], embeds: torch.Tensor
               ) -> tuple:
    """``(region_ids (B, T) int64 with -1 off images, regions per row)``; each row's
    images are numbered one after the other, from 0 in every row."""
    B, T = embeds.shape[:2]
    ids = torch.full((B, T), -1, dtype=torch.int64)
    counts = []
    for b, row in enumerate(images):
        offset = 0
        for image in row:
            feats = embeds[b, image.positions.to(embeds.device)] if not isinstance(
                regions, torch.Tensor) else None
            labels = _labels(regions, image, feats).cpu()
            ids[b, image.positions] = labels + offset
            offset += int(labels.max()) + 1 if len(labels) else 0
        counts.append(offset)
    return ids.to(embeds.device), counts
