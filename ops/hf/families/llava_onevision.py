"""LLaVA-OneVision: LLaVA-NeXT's layout (a base view, then the anyres tiles stitched,
unpadded and followed row by row by a newline feature at image-token positions), the tiles
grid scaled down when it holds more than ``vision_aspect_ratio``'s ``anyres_max_N`` tiles'
worth of tokens; a picture of a prompt with several pictures (``batch_num_images``) is
only its base view of the picture padded to a square, and one newline.

A video is one run of ``<video>`` tokens: each sampled frame (the video processor takes
the frames it is given, ``do_sample_frames`` off as in the checkpoints) squashed to the
tower's square input, its patch grid pooled bilinearly to half its side (rounded up), the
frames one after the other, then one newline feature for the whole video (a marker). No
frames are merged: each frame is a group of its own."""
from __future__ import annotations

import math
from typing import Any, Dict, List

from .base import register
from .layout import (WHOLE, ImageTokens, VideoTokens, View, group_videos, image_positions,
                     metadata_frames, patches_per_side, runs, split_images)
from .llava_next import WHO, LlavaNext, Piece, anyres_tiles


@register
class LlavaOnevision(LlavaNext):
    name = "llava_onevision"
    titles = ("LLaVA-OneVision",)
    model_types = ("llava_onevision",)
    layout = ("base view, then the anyres tiles stitched, unpadded and scaled down to at most "
              "anyres_max_N tiles' tokens, a newline after each row; several pictures in a "
              "prompt: the base view of the picture padded to a square and one newline")
    # video_metadata: the processor's, with return_metadata=True (each video's sampled
    # frames and fps); the model does not take it
    input_keys = ("image_sizes", "batch_num_images", "video_metadata")
    layout_keys = ("video_metadata",)

    def pieces(self, config, inputs: Dict[str, Any], index: int, height: int, width: int
               ) -> List[Piece]:
        side = patches_per_side(config.vision_config)
        counts = inputs.get("batch_num_images")
        if counts is not None:
            patched = [n == 1 for n in counts.tolist() for _ in range(n)]
            if not patched[index]:
                # the image processor's pad_to_square: centred on the longer side
                edge = max(height, width)
                x, y = (edge - width) // 2, (edge - height) // 2
                box = (-x / width, -y / height, (edge - x) / width, (edge - y) / height)
                return [("base", side, side, box, 0, 1)]
        rows, cols, box = anyres_tiles(config, height, width)
        # pack_image_features' bilinear downscaling keeps the grid's extent, not its cells
        most = int(getattr(config, "vision_aspect_ratio", "anyres_max_9").strip("anyres_max_"))
        ratio = math.sqrt(rows * cols / (most * side ** 2))
        if ratio > 1.1:
            rows, cols = int(rows // ratio), int(cols // ratio)
        return [("base", side, side, WHOLE, 0, 0), ("tiles", rows, cols, box, 1, 0)]

    def videos(self, config, inputs: Dict[str, Any]) -> List[List[VideoTokens]]:
        per_row = image_positions(inputs["input_ids"], self.video_token_ids(config))
        if not any(len(p) for p in per_row):
            return [[] for _ in per_row]
        side = math.ceil(patches_per_side(config.vision_config) / 2)  # apply_pooling's
        per_frame = side * side
        metadata = inputs.get("video_metadata")
        counts = [metadata_frames(metadata, i) for i in range(len(metadata or ()))]
        if counts and None not in counts:  # videos side by side split by their frames
            sizes = [n * per_frame + 1 for n in counts]
        else:
            sizes = [len(run) for row in per_row for run in runs(row)]
        frames, markers, groups = [], [], []
        for row in split_images(WHO, per_row, sizes, "video"):
            groups.append([])
            for positions in row:
                if (len(positions) - 1) % per_frame:
                    raise ValueError(f"{WHO}: a video of {len(positions)} video tokens at "
                                     f"position {int(positions[0])} is not whole frames of "
                                     f"{per_frame} tokens ({side} x {side}) and a newline")
                frames.append((len(positions) - 1) // per_frame)
                markers.append(positions[-1:])
                groups[-1] += [ImageTokens((View("base", chunk, side, side),))
                               for chunk in positions[:-1].reshape(-1, per_frame)]
        return group_videos(WHO, groups, frames, 1, metadata, markers)
