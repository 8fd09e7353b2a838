"""Kimi K2.5 (``kimi_k25``): a DeepSeek-V3 text decoder (MLA attention, traced on its
latent keys; a mixture of experts) under a MoonViT vision tower. The image processor
shrinks a picture to fit its patch budget (never enlarging it), pads it with black on
the right and bottom to a multiple of ``patch_size * merge_size`` pixels and cuts the
canvas into patches row-major; the tower pools each ``merge_kernel_size`` block of
patches into one token, row-major over the merged grid: one run of ``<|media_pad|>``
tokens per picture, between ``<|media_begin|>``/``<|media_content|>`` and
``<|media_end|>`` text tokens. ``image_grid_thw`` gives the canvas's patch grid; the
picture's own size (which the processor drops) is read back from ``pixel_values``: the
padding is black after normalisation and narrower than one token, so the grid reaches
past the picture by less than one token on the right and bottom.

A video is cut into chunks of ``temporal_patch_size`` (4) consecutive sampled frames (the
last may hold fewer), and the tower averages each chunk's frames into one grid of tokens
(``video_grid_thw``: one row per chunk): each chunk is one frame group, a run of video
tokens between ``<|media_begin|>video<|media_content|>`` and ``<|media_end|>`` after its
time as text, laid out as a picture's. The processor's ``video_metadata`` (which it returns
by default) says how many frames, so how many chunks, each video has; without it, a row's
chunks are read as one video."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .base import Family, missing_input, register
from .layout import (FrameGroup, ImageTokens, VideoTokens, View, image_positions,
                     split_images, video_frames)
from .llama4 import content_size
from .qwen_vl import WHO, merged_grids


@register
class KimiK25(Family):
    name = "kimi_k25"
    titles = ("Kimi K2.5",)
    model_types = ("kimi_k25",)
    layout = ("one grid per picture (patches pooled 2x2) over the picture padded right and "
              "bottom, between <|media_begin|> and <|media_end|>")
    # video_metadata: the processor's (each video's sampled frames and fps); the model
    # does not take it
    input_keys = ("image_grid_thw", "pixel_values", "video_grid_thw", "pixel_values_videos",
                  "video_metadata")
    layout_keys = ("video_metadata",)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        if not any(len(p) for p in image_positions(inputs["input_ids"],
                                                   self.image_token_ids(config))):
            return [[] for _ in inputs["input_ids"]]  # a prompt of videos only
        merge = tuple(int(k) for k in config.vision_config.merge_kernel_size)
        grids = merged_grids(config, inputs, merge)
        pixels = inputs.get("pixel_values")
        if pixels is None:
            raise missing_input(config, "pixel_values", " (its padding)")
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = split_images(WHO, per_row, [r * c for r, c in grids])
        boxes = iter(_boxes(pixels.detach().cpu(), inputs["image_grid_thw"].tolist(), merge))
        grid = iter(grids)
        views = [[View("base", p, *next(grid), next(boxes)) for p in row] for row in pictures]
        # the grid reaches past the picture: it is the grid regions cluster on all the same
        return [[ImageTokens((view,), grid=view) for view in row] for row in views]


    def videos(self, config, inputs: Dict[str, Any]) -> List[List[VideoTokens]]:
        per_row = image_positions(inputs["input_ids"], self.video_token_ids(config))
        if not any(len(p) for p in per_row):
            return [[] for _ in per_row]
        for key, detail in (("video_grid_thw", ""), ("pixel_values_videos", " (its padding)")):
            if inputs.get(key) is None:
                raise missing_input(config, key, detail)
        merge = tuple(int(k) for k in config.vision_config.merge_kernel_size)
        thw = inputs["video_grid_thw"].tolist()
        grids = [(h // merge[0], w // merge[1]) for _, h, w in thw]
        # the first frame of each chunk shows its padding (every frame has the same)
        patches, firsts, start = inputs["pixel_values_videos"].detach().cpu(), [], 0
        for t, h, w in thw:
            firsts.append(patches[start:start + h * w])
            start += t * h * w
        boxes = _boxes(torch.cat(firsts), [[1, h, w] for _, h, w in thw], merge)
        chunks = split_images(WHO, per_row, [r * c for r, c in grids], "video chunk")
        metadata, index, used, videos = inputs.get("video_metadata"), 0, 0, []
        chunk = iter(zip(thw, grids, boxes))
        for b, row in enumerate(chunks):
            videos.append([])
            taken = 0
            while taken < len(row):
                if metadata is None:  # which chunks make each video: the row's all one
                    frames = sum(t for t, _, _ in thw[used:used + len(row)])
                elif index >= len(metadata):
                    raise ValueError(f"{WHO}: row {b} holds more video chunks than the "
                                     f"{len(metadata)} videos of video_metadata")
                else:
                    frames = len(metadata[index]["frames_indices"])
                groups, first = [], 0
                while first < frames:
                    if taken >= len(row):
                        raise ValueError(f"{WHO}: video {index}'s {frames} frames need more "
                                         f"chunks than row {b} holds")
                    (t, _, _), (rows, cols), box = next(chunk)
                    view = View("base", row[taken], rows, cols, box)
                    groups.append(FrameGroup(tuple(range(first, first + t)),
                                             ImageTokens((view,), grid=view)))
                    first, taken, used = first + t, taken + 1, used + 1
                count, seconds, source = (first, None, None) if metadata is None else \
                    video_frames(WHO, metadata, index, len(groups),
                                 max(len(g.frames) for g in groups))
                if count != first:
                    raise ValueError(f"{WHO}: video {index}'s chunks hold {first} frames, "
                                     f"its video_metadata {count}")
                videos[-1].append(VideoTokens(tuple(groups), count, index, seconds, source))
                index += 1
        if used != len(thw):
            raise ValueError(f"{WHO}: video_grid_thw has {len(thw)} chunks, input_ids {used}")
        return videos

def _boxes(pixels: torch.Tensor, thw: List[List[int]], merge: Tuple[int, int]) -> List[tuple]:
    """Per picture, the box its token grid covers on the picture: the padded canvas read
    back from ``pixel_values`` ``(patches, C, p, p)`` (each picture's patches row-major),
    the picture its part up to the last row and column that is not all black. The
    processor pads by less than ``merge`` patches, so a picture whose own edge is black
    reads at most that much of it as padding."""
    boxes, start = [], 0
    for _, h, w in thw:
        patches = pixels[start:start + h * w]
        start += h * w
        C, p = patches.shape[1], patches.shape[-1]
        canvas = patches.reshape(h, w, C, p, p).permute(2, 0, 3, 1, 4).reshape(C, h * p, w * p)
        content_h, content_w = content_size(canvas)
        content_h = max(content_h, (h - merge[0]) * p + 1)
        content_w = max(content_w, (w - merge[1]) * p + 1)
        boxes.append((0.0, 0.0, w * p / content_w, h * p / content_h))
    return boxes

