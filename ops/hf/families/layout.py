"""Where an image's tokens lie: in the sequence, and on the picture; a video's, also in
time.

A model may show one picture as several views (a base grid, tiles, a thumbnail, a global
image), each a grid of tokens laid over a box of the picture. Every token then has a box
on the picture, in coordinates normalised to [0, 1], so that a region is the same part of
the picture in every view.

A video is a sequence of frame groups (:class:`VideoTokens`): each group is one or more
consecutive sampled frames that the model merges into the same tokens (Qwen-VL's
``temporal_patch_size`` 2: each token covers 2 frames), its tokens laid out on the frame
as a picture's are (an :class:`ImageTokens`), so a token has its box on the frame and the
frames it covers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

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


@dataclass(frozen=True)
class FrameGroup:
    """The tokens of one group of consecutive sampled frames of a video that the model
    merges into the same tokens: ``frames``, their indices among the video's sampled
    frames (ascending, consecutive; one frame where the model takes frames one by one,
    Qwen-VL's 2, the last group of an odd count 1: the processor repeats the last frame),
    and ``image``, the group's tokens laid out on the frame as a picture's are (its
    views, positions and boxes on the frame)."""
    frames: Tuple[int, ...]
    image: ImageTokens

    def __post_init__(self):
        frames = tuple(int(f) for f in self.frames)
        if not frames or list(frames) != list(range(frames[0], frames[0] + len(frames))):
            raise ValueError(f"headscope.hf: a frame group covers consecutive frames, got "
                             f"{self.frames}")
        object.__setattr__(self, "frames", frames)


@dataclass(frozen=True)
class VideoTokens:
    """One video's tokens: its frame ``groups`` in time order (each group's tokens lie
    after the previous group's in the sequence); ``num_frames``, the frames the processor
    sampled from the source video (the groups' ``frames`` index them); ``index``, the
    video's place among the batch's videos (its row of ``video_grid_thw``, its entry of
    ``video_metadata``); ``seconds`` ``(num_frames,)`` float64, each sampled frame's time
    in the source video, and ``source_frames`` ``(num_frames,)`` int64, its frame index
    there (None where the inputs do not say: the processor's ``video_metadata``, with the
    video's fps for ``seconds``); ``markers``, the positions among the video tokens that
    hold no piece of a frame (region -1; the groups' own markers included)."""
    groups: Tuple[FrameGroup, ...]
    num_frames: int
    index: int = 0
    seconds: Optional[torch.Tensor] = None
    source_frames: Optional[torch.Tensor] = None
    markers: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def __post_init__(self):
        if not self.groups:
            raise ValueError("headscope.hf: a video needs at least one frame group")
        covered = [f for g in self.groups for f in g.frames]
        if covered != list(range(self.num_frames)):
            raise ValueError(f"headscope.hf: a video's frame groups must cover its "
                             f"{self.num_frames} sampled frames once, in order, got "
                             f"{[g.frames for g in self.groups]}")
        for name in ("seconds", "source_frames"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (self.num_frames,):
                raise ValueError(f"headscope.hf: a video's {name} needs one entry per sampled "
                                 f"frame ({self.num_frames}), got {tuple(value.shape)}")
        markers = [self.markers, *(g.image.markers for g in self.groups)]
        object.__setattr__(self, "markers", torch.cat(markers).unique())

    @property
    def frames_per_group(self) -> int:
        """The frames the model merges into each token (Qwen-VL: 2, its
        ``temporal_patch_size``; 1: frames one by one)."""
        return max(len(g.frames) for g in self.groups)

    @property
    def positions(self) -> torch.Tensor:
        """Sequence positions of every token, group by group (each group's in its
        ``image.positions`` order)."""
        return torch.cat([g.image.positions for g in self.groups])

    @property
    def boxes(self) -> torch.Tensor:
        """(tokens, 4) float64: each token's box on the frame, in the order of
        :attr:`positions`."""
        return torch.cat([g.image.boxes for g in self.groups])

    @property
    def token_frames(self) -> torch.Tensor:
        """(tokens, 2) int64: the first and last sampled frame each token covers, in the
        order of :attr:`positions`."""
        return torch.cat([torch.tensor([[g.frames[0], g.frames[-1]]], dtype=torch.int64)
                          .expand(len(g.image.positions), 2) for g in self.groups])

    @property
    def token_groups(self) -> torch.Tensor:
        """(tokens,) int64: the frame group of each token, in the order of
        :attr:`positions`."""
        return torch.cat([torch.full((len(g.image.positions),), i, dtype=torch.int64)
                          for i, g in enumerate(self.groups)])

    @property
    def token_seconds(self) -> Optional[torch.Tensor]:
        """(tokens, 2) float64: the times of the first and last frame each token covers
        (None where :attr:`seconds` is unknown)."""
        return None if self.seconds is None else self.seconds[self.token_frames]

    @property
    def grid(self) -> Tuple[int, int, int]:
        """(groups, rows, cols): the space-time grid regions are clustered on, each frame
        group's :attr:`ImageTokens.grid` (the same in every group)."""
        shapes = {(g.image.rows, g.image.cols) for g in self.groups}
        if len(shapes) != 1:
            raise ValueError(f"headscope.hf: a video's frame groups have grids of different "
                             f"sizes {sorted(shapes)}")
        (rows, cols), = shapes
        return len(self.groups), rows, cols


# ---- reading a layout from the inputs: what several families share ---------------------------

def patches_per_side(vision_config) -> int:
    """Patches along each side of the vision tower's square input (``image_size //
    patch_size``; of a ``[height, width]`` size, the first)."""
    size, patch = vision_config.image_size, vision_config.patch_size
    size = size[0] if isinstance(size, (list, tuple)) else size
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return int(size) // int(patch)


def runs(positions: torch.Tensor) -> List[torch.Tensor]:
    """``positions`` (ascending) cut into runs of consecutive positions."""
    if len(positions) == 0:
        return []
    breaks = (positions[1:] - positions[:-1] != 1).nonzero().flatten() + 1
    return list(torch.tensor_split(positions, breaks.tolist()))


def tile_boxes(rows: int, cols: int) -> List[Box]:
    """The boxes of a ``rows x cols`` canvas of equal tiles on the picture, row-major:
    ``j / cols`` exactly (``cell_boxes``' linspace can be an ulp off, 0.6666666666666667
    for 2 / 3)."""
    return [(j / cols, i / rows, (j + 1) / cols, (i + 1) / rows)
            for i in range(rows) for j in range(cols)]


def stitch(tiles: torch.Tensor, rows: Optional[int] = None) -> torch.Tensor:
    """``(R * rows, C * cols)``: the positions of ``tiles`` ``(R, C, rows * cols)`` (each
    tile's tokens row-major, the tiles row-major) laid out as one grid over the canvas;
    each tile ``rows`` tokens high (None: square tiles)."""
    R, C, n = tiles.shape
    rows = math.isqrt(n) if rows is None else rows
    cols = n // rows
    return tiles.reshape(R, C, rows, cols).permute(0, 2, 1, 3).reshape(R * rows, C * cols)


def image_positions(input_ids: torch.Tensor, token_ids: Sequence[int]) -> List[torch.Tensor]:
    """Per batch row, the sequence positions of its image tokens (on the CPU)."""
    is_image = torch.isin(input_ids.cpu(), torch.tensor(list(token_ids)))
    return [row.nonzero().flatten() for row in is_image]


def square_pictures(who: str, inputs: Dict[str, Any], token_ids: Sequence[int],
                    side: int) -> List[List[ImageTokens]]:
    """Per batch row, its pictures for a model that lays every picture out as one
    ``side x side`` grid of image tokens (one "base" view)."""
    per_row = image_positions(inputs["input_ids"], token_ids)
    count = sum(len(p) for p in per_row)
    pictures = split_images(who, per_row, [side * side] * (count // (side * side)))
    return [[ImageTokens((View("base", p, side, side),)) for p in row] for row in pictures]


def grid_pictures(who: str, per_row: List[torch.Tensor],
                  grids: Sequence[Tuple[int, int]]) -> List[List[ImageTokens]]:
    """Per batch row, its pictures for a model that lays every picture out as one grid
    of image tokens, row-major (one "base" view): ``per_row`` each row's image-token
    positions (:func:`image_positions`), ``grids`` each picture's ``(rows, cols)``, the
    batch's pictures in order."""
    pictures = split_images(who, per_row, [rows * cols for rows, cols in grids])
    grid = iter(grids)
    return [[ImageTokens((View("base", p, *next(grid)),)) for p in row] for row in pictures]


def image_runs(who: str, positions: torch.Tensor, side: int) -> List[torch.Tensor]:
    """One row's image positions cut into runs of consecutive positions, each checked to
    hold one ``side x side`` tile or global image."""
    found = runs(positions)
    for run in found:
        if len(run) != side * side:
            raise ValueError(f"{who}: a run of {len(run)} image tokens at position "
                             f"{int(run[0])}; each tile and global image of this model is "
                             f"{side * side} tokens ({side} x {side})")
    return found


def split_images(who: str, per_row: List[torch.Tensor], sizes: Sequence[int],
                 kind: str = "image") -> List[List[torch.Tensor]]:
    """Cuts each row's image positions into consecutive pictures of ``sizes`` tokens (the
    batch's pictures in order), checking that the counts add up; ``kind="video"``: a
    row's video positions into videos."""
    items = "pictures" if kind == "image" else f"{kind}s"
    images, i = [], 0
    for b, positions in enumerate(per_row):
        row, used = [], 0
        while used < len(positions):
            if i >= len(sizes):
                raise ValueError(f"{who}: row {b} has more {kind} tokens than its {items} "
                                 f"account for")
            row.append(positions[used:used + sizes[i]])
            used += sizes[i]
            i += 1
        if used != len(positions):
            raise ValueError(f"{who}: row {b}'s {len(positions)} {kind} tokens do not split "
                             f"into whole {items}")
        images.append(row)
    if i != len(sizes):
        raise ValueError(f"{who}: {len(sizes)} {items} in the inputs but {i} in input_ids")
    return images


def video_frames(who: str, metadata, index: int, groups: int, frames_per_group: int
                 ) -> Tuple[int, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(num_frames, seconds, source_frames)`` of the batch's video ``index``, of
    ``groups`` frame groups of ``frames_per_group`` frames each, as :class:`VideoTokens`
    takes them: from the processor's ``video_metadata`` (a list, one entry per video, with
    ``frames_indices`` and ``fps``) where given; otherwise the groups' frame slots, times
    unknown (an odd count's last frame is then counted twice: the processor repeats it)."""
    slots = groups * frames_per_group
    entry = None
    if metadata is not None:
        if index >= len(metadata):
            raise ValueError(f"{who}: video_metadata has {len(metadata)} entries, but the "
                             f"inputs hold video {index}")
        entry = metadata[index]
    indices = None if entry is None else entry.get("frames_indices")
    if indices is None:
        return slots, None, None
    source = torch.as_tensor([int(i) for i in indices], dtype=torch.int64)
    count = len(source)
    if not slots - frames_per_group < count <= slots:
        raise ValueError(f"{who}: video {index}'s video_metadata lists {count} sampled frames, "
                         f"but its {groups} frame groups of {frames_per_group} hold "
                         f"{slots - frames_per_group + 1} to {slots}")
    fps = entry.get("fps")
    seconds = source.to(torch.float64) / float(fps) if fps else None
    return count, seconds, source


def grid_videos(who: str, per_row: List[torch.Tensor],
                grids: Sequence[Tuple[int, int, int]], frames_per_group: int,
                metadata=None) -> List[List[VideoTokens]]:
    """Per batch row, its videos for a model that lays every video out as frame groups of
    one grid of tokens each, row-major, the groups one after the other in the sequence
    (each group one run of consecutive positions: text such as a timestamp may lie
    between groups): ``per_row`` each row's video-token positions, ``grids`` each video's
    ``(groups, rows, cols)`` (the batch's videos in order), ``frames_per_group`` the
    frames the model merges into one token, ``metadata`` the processor's
    ``video_metadata`` (:func:`video_frames`)."""
    videos = split_images(who, per_row, [g * r * c for g, r, c in grids], "video")
    out, index = [], 0
    for row in videos:
        found = []
        for positions in row:
            G, R, C = grids[index]
            count, seconds, source = video_frames(who, metadata, index, G, frames_per_group)
            groups = []
            for g, chunk in enumerate(positions.reshape(G, R * C)):
                if len(runs(chunk)) != 1:
                    raise ValueError(f"{who}: frame group {g} of video {index} is not one run "
                                     f"of {R * C} video tokens (positions {int(chunk[0])} to "
                                     f"{int(chunk[-1])}); input_ids do not follow "
                                     f"video_grid_thw")
                first = g * frames_per_group
                frames = tuple(range(first, min(first + frames_per_group, count)))
                groups.append(FrameGroup(frames, ImageTokens((View("base", chunk, R, C),))))
            found.append(VideoTokens(tuple(groups), count, index, seconds, source))
            index += 1
        out.append(found)
    return out


def metadata_frames(metadata, index: int) -> Optional[int]:
    """The sampled frames the processor's ``video_metadata`` lists for the batch's video
    ``index`` (None: no metadata, or its entry lists none)."""
    if metadata is None or index >= len(metadata):
        return None
    indices = metadata[index].get("frames_indices")
    return None if indices is None else len(indices)


def group_videos(who: str, groups: List[List[ImageTokens]], counts: Sequence[int],
                 frames_per_group: int = 1, metadata=None,
                 markers: Optional[Sequence[torch.Tensor]] = None) -> List[List[VideoTokens]]:
    """Per batch row, its videos from the frame groups of each row in sequence order
    (``groups``, each group's tokens as an :class:`ImageTokens`), ``counts`` the frame
    groups of each of the batch's videos in order, ``frames_per_group`` the frames each
    group merges (the last group of a video may hold fewer: :func:`video_frames`),
    ``metadata`` the processor's ``video_metadata`` and ``markers`` each video's marker
    positions (batch order); checks that the counts add up."""
    out, index = [], 0
    for b, row in enumerate(groups):
        found, used = [], 0
        while used < len(row):
            if index >= len(counts):
                raise ValueError(f"{who}: row {b} has more video frames than its videos "
                                 f"account for")
            mine = row[used:used + counts[index]]
            if len(mine) != counts[index]:
                raise ValueError(f"{who}: row {b}'s {len(row)} frame groups do not split into "
                                 f"whole videos ({counts[index]} groups for video {index})")
            count, seconds, source = video_frames(who, metadata, index, len(mine),
                                                  frames_per_group)
            frames = [tuple(range(g * frames_per_group,
                                  min((g + 1) * frames_per_group, count)))
                      for g in range(len(mine))]
            extra = {} if markers is None else {"markers": markers[index]}
            found.append(VideoTokens(tuple(FrameGroup(f, image) for f, image in zip(frames, mine)),
                                     count, index, seconds, source, **extra))
            used += counts[index]
            index += 1
        out.append(found)
    if index != len(counts):
        raise ValueError(f"{who}: {len(counts)} videos in the inputs but {index} in input_ids")
    return out


def thumbnail(picture: torch.Tensor, size: int) -> torch.Tensor:
    """(C, size, size): ``picture`` (C, H, W) resized to one tile."""
    return torch.nn.functional.interpolate(picture[None].float(), (size, size),
                                           mode="bilinear", antialias=True,
                                           align_corners=False)[0].to(picture.dtype)


def canvas(tiles: torch.Tensor) -> Tuple[int, int]:
    """(rows, cols) of the canvas of ``tiles`` (N + 1, C, S, S): N tiles, row-major, and the
    thumbnail last: the arrangement rows * cols = N whose stitched picture, downscaled to
    one tile, is nearest the thumbnail (the processor keeps no other trace of it; the
    canvas's shape follows the picture's aspect ratio, which the thumbnail has lost but
    its content keeps)."""
    n = len(tiles) - 1
    C, S = tiles.shape[1], tiles.shape[-1]
    best, found = None, None
    for rows in range(1, n + 1):
        if n % rows:
            continue
        cols = n // rows
        stitched = tiles[:n].reshape(rows, cols, C, S, S).permute(2, 0, 3, 1, 4)
        small = thumbnail(stitched.reshape(C, rows * S, cols * S), S)
        error = float((small.float() - tiles[n].float()).pow(2).mean())
        if best is None or error < best:
            best, found = error, (rows, cols)
    return found


def canvas_and_thumbnail(positions: torch.Tensor, count: int, side: int, tiles) -> ImageTokens:
    """One picture shown as ``count`` square tiles of ``side x side`` tokens at
    ``positions`` (in order): one tile alone is the base view; more are a canvas's tiles,
    row-major, and a thumbnail last, the canvas read back from the tiles' pixels ``tiles``
    ``(count, C, S, S)`` (:func:`canvas`)."""
    per_tile = side * side
    if count == 1:
        return ImageTokens((View("base", positions, side, side),))
    rows, cols = canvas(tiles)
    tiles = positions[:rows * cols * per_tile].reshape(rows, cols, per_tile)
    views = [View("tile", run, side, side, box)
             for run, box in zip(tiles.reshape(-1, per_tile), tile_boxes(rows, cols))]
    views.append(View("thumbnail", positions[rows * cols * per_tile:], side, side))
    grid = View("tiles", stitch(tiles).flatten(), rows * side, cols * side)
    return ImageTokens(tuple(views), grid)
