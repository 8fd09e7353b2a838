"""Where an image's tokens lie: in the sequence, and on the picture.

A model may show one picture as several views (a base grid, tiles, a thumbnail, a global
image), each a grid of tokens laid over a box of the picture. Every token then has a box
on the picture, in coordinates normalised to [0, 1], so that a region is the same part of
the picture in every view."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

import torch

Box = Tuple[float, float, float, float]  # (x0, y0, x1, y1), normalised to the picture
WHOLE: Box = (0.0, 0.0, 1.0, 1.0)


def cell_boxes(rows: int, cols: int, box: Box = WHOLE) -> torch.Tensor:
    """(rows * cols, 4) float64: the cells of a ``rows x cols`` grid laid evenly over
    ``box``, row-major."""
    x0, y0, x1, y1 = box
    xs = torch.linspace(x0, x1, cols + 1, dtype=torch.float64)
    ys = torch.linspace(y0, y1, rows + 1, dtype=torch.float64)
    left, right = xs[:-1].repeat(rows), xs[1:].repeat(rows)
    top, bottom = ys[:-1].repeat_interleave(cols), ys[1:].repeat_interleave(cols)
    return torch.stack([left, top, right, bottom], 1)


@dataclass(frozen=True)
class View:
    """One view of a picture: ``rows x cols`` tokens at sequence ``positions`` (row-major)
    covering ``box`` of the picture in equal cells. ``name``: ``"base"``, ``"tile"``,
    ``"thumbnail"``, ``"global"``, ..."""
    name: str
    positions: torch.Tensor  # (rows * cols,) int64
    rows: int
    cols: int
    box: Box = WHOLE

    def __post_init__(self):
        if tuple(self.positions.shape) != (self.rows * self.cols,):
            raise ValueError(f"headscope.hf: a {self.rows}x{self.cols} view needs "
                             f"{self.rows * self.cols} positions, got "
                             f"{tuple(self.positions.shape)}")

    @property
    def boxes(self) -> torch.Tensor:
        """(rows * cols, 4) float64: each token's box on the picture, row-major."""
        return cell_boxes(self.rows, self.cols, self.box)


@dataclass(frozen=True)
class ImageTokens:
    """One picture's tokens: its ``views`` in sequence order, and ``grid``, the view Ward
    regions are clustered on (the finest grid that covers the whole picture; tiles
    stitched together where the picture is cut into tiles). Marker tokens (row breaks,
    begin and end of image, tile labels) belong to no view; ``markers`` lists those that
    sit at image-token positions (LLaVA-NeXT's newline features), region -1 like the
    others."""
    views: Tuple[View, ...]
    grid: View = field(default=None)  # None: the first view covering the whole picture
    markers: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def __post_init__(self):
        if self.grid is None:
            whole = [v for v in self.views if v.box == WHOLE]
            if not whole:
                raise ValueError("headscope.hf: an image needs a view covering the whole "
                                 "picture, or an explicit grid")
            object.__setattr__(self, "grid", whole[0])

    @property
    def positions(self) -> torch.Tensor:
        """Sequence positions of every token of every view, in view order."""
        return torch.cat([v.positions for v in self.views])

    @property
    def boxes(self) -> torch.Tensor:
        """(tokens, 4) float64: each token's box, in the order of :attr:`positions`."""
        return torch.cat([v.boxes for v in self.views])

    @property
    def rows(self) -> int:
        return self.grid.rows

    @property
    def cols(self) -> int:
        return self.grid.cols

    def overlap(self, boxes: torch.Tensor) -> torch.Tensor:
        """(tokens, grid tokens): the area each box of ``boxes`` shares with each token
        of :attr:`grid`."""
        g = self.grid.boxes
        w = (torch.minimum(boxes[:, None, 2], g[None, :, 2])
             - torch.maximum(boxes[:, None, 0], g[None, :, 0])).clamp_min(0)
        h = (torch.minimum(boxes[:, None, 3], g[None, :, 3])
             - torch.maximum(boxes[:, None, 1], g[None, :, 1])).clamp_min(0)
        return w * h
