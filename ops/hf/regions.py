"""Which region each image and video token belongs to. Regions live on the picture (see
``families/layout.py``): a region is the same part of the picture in every view of it, so
attribution to a region sums over all views' tokens. A video's regions live on the frame
and in time: a region is a part of the frame over a window of frames (``grid_regions``),
or a Ward cluster of tokens adjacent in space or in time at the same place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from ..attribution import ward_regions
from .families.layout import ImageTokens, VideoTokens, cell_boxes

Regions = Union[int, torch.Tensor, Callable]
Media = Union[ImageTokens, VideoTokens]


class grid_regions:
    """Regions for :class:`Tracer` (``regions=``) that cut each picture into ``rows x
    cols`` blocks of equal size, numbered row-major: a token belongs to the block that
    holds the centre of its box on the picture, whichever view it is in. For pictures
    whose content is laid out on a known grid, or to compare with patch-grid
    attributions. Called as ``labels(features, (R, C))`` it labels an ``R x C`` grid
    covering the whole picture.

    A video is cut the same way on the frame, in each window of ``frames`` consecutive
    sampled frames (default: each frame group, the frames the model merges into one token;
    ``frames`` must be a multiple of it): its regions are numbered window by window, each
    window's blocks row-major, and a token belongs to the window of its first frame."""

    def __init__(self, rows: int, cols: int, frames: Optional[int] = None):
        if not (isinstance(rows, int) and isinstance(cols, int)) or isinstance(rows, bool) \
                or isinstance(cols, bool) or rows < 1 or cols < 1:
            raise ValueError(f"headscope.hf.grid_regions: rows and cols must be ints >= 1, got "
                             f"{rows!r} x {cols!r}")
        if frames is not None and (not isinstance(frames, int) or isinstance(frames, bool)
                                   or frames < 1):
            raise ValueError(f"headscope.hf.grid_regions: frames must be an int >= 1 (a window "
                             f"of sampled frames) or None (each frame group), got {frames!r}")
        self.rows, self.cols, self.frames = rows, cols, frames

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

    def window(self, video: VideoTokens) -> int:
        """The sampled frames of each of ``video``'s time windows."""
        merged = video.frames_per_group
        if self.frames is None:
            return merged
        if self.frames % merged:
            raise ValueError(f"headscope.hf.grid_regions: frames={self.frames} must be a "
                             f"multiple of the {merged} frames this model merges into each "
                             f"video token")
        return self.frames

    def of_video(self, video: VideoTokens) -> Tuple[torch.Tensor, int]:
        """``(labels, count)``: the region of each token of ``video`` (in the order of
        ``video.positions``) and the video's number of regions."""
        _, R, C = video.grid
        self.check(R, C)
        window = self.window(video)
        windows = -(-video.num_frames // window)
        first = video.token_frames[:, 0] // window
        return first * (self.rows * self.cols) + self.of_boxes(video.boxes), \
            windows * self.rows * self.cols

    def __call__(self, features, grid) -> torch.Tensor:
        if len(grid) == 3:  # a video's (groups, rows, cols): each group its own window
            if self.frames is not None:
                raise ValueError("headscope.hf.grid_regions: windows of frames need the "
                                 "video's frames; pass the grid_regions itself as regions=")
            G, R, C = grid
            self.check(R, C)
            blocks = self.of_boxes(cell_boxes(R, C))
            return (torch.arange(G)[:, None] * (self.rows * self.cols) + blocks).flatten()
        R, C = grid
        self.check(R, C)
        return self.of_boxes(cell_boxes(R, C))

    def __repr__(self) -> str:
        frames = "" if self.frames is None else f", frames={self.frames}"
        return f"grid_regions({self.rows}, {self.cols}{frames})"


def parse_grid(text: str) -> tuple:
    """``"ROWSxCOLS"`` (e.g. ``"3x3"``, any case) as ``(rows, cols)``, both >= 1."""
    try:
        rows, cols = (int(n) for n in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"a grid is ROWSxCOLS (e.g. 3x3), got {text!r}") from None
    if rows < 1 or cols < 1:
        raise ValueError(f"a grid needs ROWS and COLS >= 1, got {text!r}")
    return rows, cols


@dataclass(frozen=True)
class MediaRegions:
    """One picture or video of a batch row (``media``: its ``ImageTokens`` or
    ``VideoTokens``) and its regions ``[first, end)`` among the row's."""
    media: Media
    first: int
    end: int


def _grid_labels(regions: Regions, grid: Tuple[int, ...], what: str,
                 features: Optional[torch.Tensor]) -> torch.Tensor:
    """Region labels in [0, K) of the tokens of a grid ``(R, C)`` (a picture's grid view,
    row-major) or ``(G, R, C)`` (a video's frame groups' grids, group by group):
    Ward regions of ``features`` (4 neighbours in space; a video's also the same place in
    the next and previous group), the user's labels, or the user's callable."""
    M = 1
    for n in grid:
        M *= n
    if isinstance(regions, int):
        if not 1 <= regions <= M:
            raise ValueError(f"headscope.hf.Tracer: argument 'regions' must be in [1, {M}] "
                             f"(the {what}), got {regions}")
        frames = grid[0] if len(grid) == 3 else 1
        return ward_regions(features.float().contiguous(), grid[-2], grid[-1], regions,
                            frames=frames)
    labels = regions(features, grid) if callable(regions) else regions
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 \
            or tuple(labels.shape) != (M,):
        raise ValueError(f"headscope.hf.Tracer: region labels must be an int64 tensor ({M},) "
                         f"for the {what}, got "
                         f"{labels.dtype if isinstance(labels, torch.Tensor) else type(labels)} "
                         f"{tuple(getattr(labels, 'shape', ()))}")
    if M and (int(labels.min()) < 0):
        raise ValueError("headscope.hf.Tracer: region labels must be >= 0")
    return labels.cpu()


def _spread(image: ImageTokens, grid: torch.Tensor) -> torch.Tensor:
    """Region labels of every token of ``image`` (in the order of ``image.positions``)
    from ``grid``, those of its grid view's tokens: each token of another view joins the
    region that covers the most of its box."""
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


def image_labels(regions: Regions, image: ImageTokens,
                 features: Optional[torch.Tensor]) -> torch.Tensor:
    """Region labels of every token of ``image`` (in the order of ``image.positions``):
    :class:`grid_regions` by each token's box centre; otherwise labels of ``image.grid``
    (Ward on ``features``, the grid tokens' embeddings, or the user's labels), and each
    token of another view joins the region that covers the most of its box."""
    if isinstance(regions, grid_regions):
        regions.check(image.rows, image.cols)
        return regions.of_boxes(image.boxes)
    what = f"image's {image.rows}x{image.cols} tokens"
    return _spread(image, _grid_labels(regions, (image.rows, image.cols), what, features))


def video_labels(regions: Regions, video: VideoTokens, features: Optional[torch.Tensor]
                 ) -> Tuple[torch.Tensor, int]:
    """``(labels, count)``: the region of every token of ``video`` (in the order of
    ``video.positions``) and its number of regions: :class:`grid_regions` by window and
    box centre; otherwise labels of the space-time grid of its groups' grid views
    (``features`` their embeddings, group by group), each group's other tokens joining by
    overlap within the group."""
    if isinstance(regions, grid_regions):
        return regions.of_video(video)
    G, R, C = video.grid
    what = f"video's {G} frame groups of {R}x{C} tokens"
    grid = _grid_labels(regions, (G, R, C), what, features).reshape(G, R * C)
    labels = torch.cat([_spread(g.image, grid[i]) for i, g in enumerate(video.groups)])
    return labels, int(labels.max()) + 1 if len(labels) else 0


def grid_positions(media: Media) -> torch.Tensor:
    """The positions of the tokens regions are clustered on: a picture's grid view, a
    video's groups' grid views one after the other."""
    if isinstance(media, VideoTokens):
        return torch.cat([g.image.grid.positions for g in media.groups])
    return media.grid.positions


def in_sequence(images: List[ImageTokens], videos: List[VideoTokens]) -> List[Media]:
    """A row's pictures and videos, in the order their first tokens lie in the sequence."""
    media: List[Media] = [*images, *videos]
    return sorted(media, key=lambda m: int(m.positions.min()))


def region_ids(regions: Regions, images: List[List[ImageTokens]], embeds: torch.Tensor,
               videos: Optional[Sequence[List[VideoTokens]]] = None) -> tuple:
    """``(region_ids (B, T) int64 with -1 off images and videos, regions per row)``; each
    row's pictures and videos are numbered one after the other in sequence order, from 0
    in every row."""
    ids, counts, _ = media_region_ids(regions, images, embeds, videos)
    return ids, counts


def media_region_ids(regions: Regions, images: List[List[ImageTokens]],
                     embeds: torch.Tensor, videos: Optional[Sequence[List[VideoTokens]]] = None
                     ) -> tuple:
    """:func:`region_ids` and each row's :class:`MediaRegions` (its pictures and videos in
    sequence order, each with its regions)."""
    B, T = embeds.shape[:2]
    videos = videos if videos is not None else [[] for _ in images]
    ids = torch.full((B, T), -1, dtype=torch.int64)
    counts, ranges = [], []
    needs_features = isinstance(regions, int) or (callable(regions)
                                                  and not isinstance(regions, grid_regions))
    for b in range(B):
        offset, row = 0, []
        for media in in_sequence(images[b], videos[b]):
            feats = embeds[b, grid_positions(media).to(embeds.device)] if needs_features \
                else None
            if isinstance(media, VideoTokens):
                labels, count = video_labels(regions, media, feats)
            else:
                labels = image_labels(regions, media, feats)
                count = (regions.rows * regions.cols if isinstance(regions, grid_regions)
                         else int(labels.max()) + 1 if len(labels) else 0)
            ids[b, media.positions] = labels + offset
            row.append(MediaRegions(media, offset, offset + count))
            offset += count
        counts.append(offset)
        ranges.append(row)
    return ids.to(embeds.device), counts, ranges
