"""GLM-4.1V, GLM-4.5V and GLM-4.6V (``glm4v``, ``glm4v_moe``, ``glm46v``): Qwen-VL's layout under other marker
names. Each picture is one grid of tokens (patches merged ``spatial_merge_size`` squared
to one token by the vision tower's downsampling convolution, in the row-major order of the
merged grid) between ``<|begin_of_image|>`` and ``<|end_of_image|>``; ``image_grid_thw``
gives each picture's patch grid, and the 3-D rope (``get_rope_index``) numbers the tokens
by the same grid.

A video lies between ``<|begin_of_video|>`` and ``<|end_of_video|>``: each frame group
(``temporal_patch_size``, 2, consecutive sampled frames) is one grid of *image* tokens
between ``<|begin_of_image|>`` and ``<|end_of_image|>``, followed by its time as text; so
its image tokens are the video's, not pictures (the model itself then cannot take a
picture and a video in one prompt: it scatters a picture's features into every image
token)."""
from __future__ import annotations

from typing import List, Tuple

import torch

from .base import register
from .layout import image_positions
from .qwen_vl import QwenVL


@register
class Glm4v(QwenVL):
    name = "glm4v"
    titles = ("GLM-4.1V", "GLM-4.5V", "GLM-4.6V")
    model_types = ("glm4v", "glm4v_moe", "glm46v")
    layout = ("one grid per picture (patches merged 2x2), between <|begin_of_image|> and "
              "<|end_of_image|>")

    def media_positions(self, config, input_ids: torch.Tensor
                        ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Image tokens between a video's begin and end markers are the video's (as the
        processor's ``mm_token_type_ids`` type them), the others pictures'."""
        ids = input_ids.cpu()
        starts = (ids == int(config.video_start_token_id)).cumsum(-1)
        ends = (ids == int(config.video_end_token_id)).cumsum(-1)
        in_video = starts > ends
        per_row = image_positions(ids, self.image_token_ids(config))
        pictures = [p[~in_video[b, p]] for b, p in enumerate(per_row)]
        videos = [p[in_video[b, p]] for b, p in enumerate(per_row)]
        return pictures, videos
