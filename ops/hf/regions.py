"""Which region each image token belongs to. Regions live on the picture (see
``families/layout.py``): a region is the same part of the picture in every view of it, so
attribution to a region sums over all views' tokens.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Union

import torch

from ..attribution import ward_regions
from .families.layout import ImageTokens, cell_boxes

Regions = Union[int, torch.Tensor, Callable]


class grid_regions:
    """Regions for :class:`Tracer` (``regions=``) that cut each picture into ``rows x
    cols`` blocks of equal size, numbered row-major: a token belongs to the block that
    holds the centre of its box on the picture, whichever view it is in. For pictures
    whose content is laid out on a known grid, or to compare with patch-grid
    attributions. Called as ``labels(features, (R, C))`` it labels an ``R x C`` grid
    covering the whole picture."""

    def __init__(self, rows: int, cols: int):
        if not (isinstance(rows, int) and isinstance(cols, int)) or isinstance(rows, bool) \
                or isinstance(cols, bool) or rows < 1 or cols < 1:
            raise ValueError(f"headscope.hf.grid_regions: rows and cols must be ints >= 1, got "
                             f"{rows!r} x {cols!r}")
        self.rows, self.cols = rows, cols

    def of_boxes(self, boxes: torch.Tensor) -> torch.Tensor:
        """(N,) int64 block of each box of ``boxes`` (N, 4) by its centre."""
        cx = (boxes[:, 0] + boxes[:, 2]) / 2
        cy = (boxes[:, 1] + boxes[:, 3]) / 2
        col = (cx * self.cols).floor().clamp(0, self.cols - 1).to(torch.int64)
        row = (cy * self.rows).floor().clamp(0, self.rows - 1).to(torch.int64)
        return row * self.cols + col

    def check(self, R: int, C: int) -> None:
        if self.rows > R or self.cols > C:
            raise ValueError(f"headscope.hf.grid_regions: a {self.rows}x{self.cols} grid of "
                             f"regions needs an image of at least that many tokens, got {R}x{C}")

    def __call__(self, features, grid) -> torch.Tensor:
        R, C = grid
        self.check(R, C)
        return self.of_boxes(cell_boxes(R, C))

    def __repr__(self) -> str:
        return f"grid_regions({self.rows}, {self.cols})"


def parse_grid(text: str) -> tuple:
    """``"ROWSxCOLS"`` (e.g. ``"3x3"``, any case) as ``(rows, cols)``, both >= 1."""
    try:
        rows, cols = (int(n) for n in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"a grid is ROWSxCOLS (e.g. 3x3), got {text!r}") from None
    if rows < 1 or cols < 1:
        raise ValueError(f"a grid needs ROWS and COLS >= 1, got {text!r}")
    return rows, cols


def _grid_labels(regions: Regions, image: ImageTokens,
                 features: Optional[torch.Tensor]) -> torch.Tensor:
    """Region labels in [0, K) of the tokens of ``image.grid``, row-major."""
    R, C = image.rows, image.cols
    M = R * C
    if isinstance(regions, int):
        if not 1 <= regions <= M:
            raise ValueError(f"headscope.hf.Tracer: argument 'regions' must be in [1, {M}] "
                             f"(the image's {R}x{C} tokens), got {regions}")
        return ward_regions(features.float().contiguous(), R, C, regions)
    labels = regions(features, (R, C)) if callable(regions) else regions
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 \
            or tuple(labels.shape) != (M,):
        raise ValueError(f"headscope.hf.Tracer: region labels must be an int64 tensor ({M},) "
                         f"for an image of {R}x{C} tokens, got "
                         f"{labels.dtype if isinstance(labels, torch.Tensor) else type(labels)} "
                         f"{tuple(getattr(labels, 'shape', ()))}")
    if M and (int(labels.min()) < 0):
        raise ValueError("headscope.hf.Tracer: region labels must be >= 0")
    return labels.cpu()


def image_labels(regions: Regions, image: ImageTokens,
                 features: Optional[torch.Tensor]) -> torch.Tensor:
    """Region labels of every token of ``image`` (in the order of ``image.positions``):
    :class:`grid_regions` by each token's box centre; otherwise labels of ``image.grid``
    (Ward on ``features``, the grid tokens' embeddings, or the user's labels), and each
    token of another view joins the region that covers the most of its box."""
    if isinstance(regions, grid_regions):
        regions.check(image.rows, image.cols)
        return regions.of_boxes(image.boxes)
    grid = _grid_labels(regions, image, features)
    if len(image.views) == 1 and image.views[0] is image.grid:
        return grid
    label_at = dict(zip(image.grid.positions.tolist(), grid.tolist()))
    positions = image.positions
    labels = torch.tensor([label_at.get(p, -1) for p in positions.tolist()], dtype=torch.int64)
    others = labels < 0
    if bool(others.any()):
        K = int(grid.max()) + 1 if len(grid) else 0
        area = image.overlap(image.boxes[others])  # (others, grid tokens)
        per_region = area @ torch.nn.functional.one_hot(grid, K).to(area.dtype)
        labels[others] = per_region.argmax(1)
    return labels


def region_ids(regions: Regions, images: List[List[ImageTokens]], embeds: torch.Tensor
               ) -> tuple:
    """``(region_ids (B, T) int64 with -1 off images, regions per row)``; each row's
    images are numbered one after the other, from 0 in every row."""
    B, T = embeds.shape[:2]
    ids = torch.full((B, T), -1, dtype=torch.int64)
    counts = []
    needs_features = isinstance(regions, int) or (callable(regions)
                                                  and not isinstance(regions, grid_regions))
    for b, row in enumerate(images):
        offset = 0
        for image in row:
            feats = embeds[b, image.grid.positions.to(embeds.device)] if needs_features \
                else None
            labels = image_labels(regions, image, feats)
            ids[b, image.positions] = labels + offset
            offset += (regions.rows * regions.cols if isinstance(regions, grid_regions)
                       else int(labels.max()) + 1 if len(labels) else 0)
        counts.append(offset)
    return ids.to(embeds.device), counts
