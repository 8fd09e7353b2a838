"""Gemma 4: each picture is one grid of tokens between ``<start_of_image>`` and
``<end_of_image>``, at its own resolution. The image processor resizes a picture, keeping
its aspect ratio, to the largest size within its patch budget whose sides are multiples of
``pooling_kernel_size * patch_size`` pixels, cuts it into patches row-major and pads them
to the budget (``image_position_ids``: each patch's ``(x, y)``, padding ``(-1, -1)``); the
vision tower average-pools each ``k x k`` block of patches into one token, the tokens
row-major over the picture. ``mm_token_type_ids`` marks the image tokens: the sliding
layers see each picture's tokens both ways (within their window to the left), the full
layers causally; the Tracer reads both from the masks transformers builds.

A video is its sampled frames one by one (the video processor samples ``num_frames``
frames evenly, 32 in the checkpoints, and merges none), each frame laid out as a picture
(resized to the patch budget, ``video_position_ids`` its patches, pooled ``k x k``), each
written ``mm:ss <start_of_image><|video|>...<end_of_image>`` with its time;
``num_frames_per_video`` cuts the frames into videos."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .base import Family, missing_input, register
from .layout import (ImageTokens, VideoTokens, View, grid_pictures, group_videos,
                     image_positions, runs, split_images)

WHO = "headscope.hf.Tracer"


@register
class Gemma4(Family):
    name = "gemma4"
    titles = ("Gemma 4",)
    model_types = ("gemma4",)
    layout = ("one grid per picture at its own aspect ratio (patches pooled k x k), between "
              "begin and end of image; bidirectional inside it on the sliding layers")
    # video_metadata: the processor's (each video's sampled frames and fps); the model
    # does not take it
    input_keys = ("image_position_ids", "video_position_ids", "num_frames_per_video",
                  "video_metadata")
    layout_keys = ("video_metadata",)

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        if not any(len(p) for p in per_row):  # a prompt of videos only
            return [[] for _ in per_row]
        patches = inputs.get("image_position_ids")
        if patches is None:
            raise missing_input(config, "image_position_ids")
        pooling = int(config.vision_config.pooling_kernel_size)
        grids = [picture_grid(p, pooling) for p in torch.as_tensor(patches).cpu()]
        return grid_pictures(WHO, per_row, grids)

    def videos(self, config, inputs: Dict[str, Any]) -> List[List[VideoTokens]]:
        per_row = image_positions(inputs["input_ids"], self.video_token_ids(config))
        if not any(len(p) for p in per_row):
            return [[] for _ in per_row]
        for key in ("video_position_ids", "num_frames_per_video"):
            if inputs.get(key) is None:
                raise missing_input(config, key)
        pooling = int(config.vision_config.pooling_kernel_size)
        grids = [picture_grid(p, pooling, "video_position_ids")
                 for p in torch.as_tensor(inputs["video_position_ids"]).cpu()]
        frames = split_images(WHO, per_row, [rows * cols for rows, cols in grids], "video frame")
        grid, groups = iter(grids), []
        for row in frames:
            groups.append([])
            for positions in row:
                if len(runs(positions)) != 1:
                    raise ValueError(f"{WHO}: a video frame's {len(positions)} video tokens from "
                                     f"position {int(positions[0])} are not one run between its "
                                     f"begin and end of image; input_ids do not follow "
                                     f"video_position_ids")
                groups[-1].append(ImageTokens((View("base", positions, *next(grid)),)))
        counts = torch.as_tensor(inputs["num_frames_per_video"]).reshape(-1).tolist()
        return group_videos(WHO, groups, counts, 1, inputs.get("video_metadata"))

    def final_softcap(self, config) -> Optional[float]:
        return config.get_text_config().final_logit_softcapping


def picture_grid(patches: torch.Tensor, pooling: int, key: str = "image_position_ids"
                 ) -> Tuple[int, int]:
    """``(rows, cols)`` of the tokens of one picture (or video frame) whose patches are
    ``patches`` ``(max_patches, 2)`` (each its ``(x, y)``, padding ``(-1, -1)``, as the image
    and video processors lay them out, in the input ``key``), pooled ``pooling x
    pooling``; checked to be a whole grid."""
    real = patches[(patches >= 0).all(-1)]
    if not len(real):
        raise ValueError(f"{WHO}: a picture's {key} hold no patch (all (-1, -1))")
    width, height = (int(v) + 1 for v in real.max(0).values)
    if len(real) != width * height or width % pooling or height % pooling:
        raise ValueError(f"{WHO}: {key} place {len(real)} patches on a "
                         f"{height} x {width} grid, which is not whole or not cut into "
                         f"{pooling} x {pooling} blocks by the vision tower's pooling")
    return height // pooling, width // pooling
