"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE: each picture is
one grid of tokens (patches merged ``spatial_merge_size`` squared to one token) between
``<|vision_start|>`` and ``<|vision_end|>``; ``image_grid_thw`` gives each picture's
patch grid. Qwen3.5's decoder is a hybrid (gated delta nets between gated softmax
layers): only its softmax layers are traced.

A video is ``video_grid_thw``'s ``t`` frame groups of ``temporal_patch_size`` (2)
consecutive sampled frames, each patch spanning both frames, each group one grid of
tokens laid out as a picture's, the groups in time order: Qwen2-VL and Qwen2.5-VL put the
whole video in one run of ``<|video_pad|>`` between vision start and end, Qwen3-VL and
Qwen3.5 each group in its own run between vision start and end, after its time as text
(``<1.0 seconds>``)."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .base import Family, missing_input, register
from .layout import ImageTokens, VideoTokens, grid_pictures, grid_videos, image_positions

WHO = "headscope.hf.Tracer"


@register
class QwenVL(Family):
    name = "qwen_vl"
    titles = ("Qwen2-VL", "Qwen2.5-VL", "Qwen3-VL", "Qwen3-VL-MoE", "Qwen3.5", "Qwen3.5-MoE")
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                   "qwen3_5_moe")
    layout = "one grid per picture (patches merged 2x2), between vision start and end"
    # video_metadata: the processor's, with return_metadata=True (each video's sampled
    # frames and fps); the model does not take it
    input_keys = ("image_grid_thw", "video_grid_thw", "video_metadata")
    layout_keys = ("video_metadata",)

    def media_positions(self, config, input_ids: torch.Tensor
                        ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Per batch row, the positions of its pictures' tokens and of its videos'."""
        return (image_positions(input_ids, self.image_token_ids(config)),
                image_positions(input_ids, self.video_token_ids(config)))

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        per_row, _ = self.media_positions(config, inputs["input_ids"])
        if not any(len(p) for p in per_row):  # a prompt of videos only
            return [[] for _ in per_row]
        return grid_pictures(WHO, per_row, merged_grids(config, inputs))

    def videos(self, config, inputs: Dict[str, Any]) -> List[List[VideoTokens]]:
        _, per_row = self.media_positions(config, inputs["input_ids"])
        if not any(len(p) for p in per_row):
            return [[] for _ in per_row]
        thw = inputs.get("video_grid_thw")
        if thw is None:
            raise missing_input(config, "video_grid_thw")
        frames = self.frames_per_token(config)
        m = int(getattr(config.vision_config, "spatial_merge_size", 1))
        grids = [(self.frame_groups(config, t), h // m, w // m) for t, h, w in thw.tolist()]
        return grid_videos(WHO, per_row, grids, frames, inputs.get("video_metadata"))

    def frames_per_token(self, config) -> int:
        """The consecutive sampled frames each video token covers: the vision tower's
        ``temporal_patch_size`` (each patch spans them)."""
        return int(getattr(config.vision_config, "temporal_patch_size", 1))

    def frame_groups(self, config, t: int) -> int:
        """A video's frame groups (of :meth:`frames_per_token` frames) from its
        ``video_grid_thw`` ``t``: its patches' temporal size, one group each."""
        return t


def merged_grids(config, inputs: Dict[str, Any], merge: Tuple[int, int] = None
                 ) -> List[Tuple[int, int]]:
    """Each picture's grid of tokens (rows, cols): ``image_grid_thw``'s patch grid merged
    ``merge`` (rows, cols of patches; default ``spatial_merge_size`` squared) to one
    token."""
    thw = inputs.get("image_grid_thw")
    if thw is None:
        raise missing_input(config, "image_grid_thw")
    if merge is None:
        merge = (int(getattr(config.vision_config, "spatial_merge_size", 1)),) * 2
    grids = []
    for t, h, w in thw.tolist():
        if t != 1:
            raise ValueError(f"{WHO}: regions need still images (temporal grid 1), got "
                             f"image_grid_thw row {[t, h, w]}")
        grids.append((h // merge[0], w // merge[1]))
    return grids


def mrope_section(head_dim: int) -> list:
    """Qwen-VL's rotary sections (temporal, height, width) of a head of ``head_dim``."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]
