"""GLM-4.1V, GLM-4.5V and GLM-4.6V (``glm4v``, ``glm4v_moe``, ``glm46v``): Qwen-VL's layout under other marker
names. Each picture is one grid of tokens (patches merged ``spatial_merge_size`` squared
to one token by the vision tower's downsampling convolution, in the row-major order of the
merged grid) between ``<|begin_of_image|>`` and ``<|end_of_image|>``; ``image_grid_thw``
gives each picture's patch grid, and the 3-D rope (``get_rope_index``) numbers the tokens
by the same grid."""
from __future__ import annotations

from .base import register
from .qwen_vl import QwenVL


@register
class Glm4v(QwenVL):
    name = "glm4v"
    titles = ("GLM-4.1V", "GLM-4.5V", "GLM-4.6V")
    model_types = ("glm4v", "glm4v_moe", "glm46v")
    layout = ("one grid per picture (patches merged 2x2), between <|begin_of_image|> and "
              "<|end_of_image|>")
