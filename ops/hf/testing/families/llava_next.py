"""The tests' side of LLaVA-NeXT (``headscope.hf.families.llava_next``): the tiny random
models, one picture's prompt as the processor lays it out, the real processor sized to the
tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ...families.llava_next import LlavaNext, token_count
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN
from .llava import clip_vision


def tiny_pinpoints(vision: Dict[str, Any]) -> List[List[int]]:
    """The real checkpoints' canvases (1x2, 2x1, 2x2, 3x1 and 1x3 tiles) for the tiny
    tower's tile size."""
    tile = vision["image_size"]
    return [[tile * r, tile * c] for r, c in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


@register_tiny(LlavaNext)
class TinyLlavaNext(TinyFamily):
    spec = TinySpec(tokens={"<image>": IMAGE_TOKEN, "</s>": EOS}, chat_template=llava_template(),
                    effects={"llava_next": ("mask", "zero")},
                    unseen_region_effects=("llava_next",))

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        vision = clip_vision(vision_hidden)
        return tf.LlavaNextConfig(
            text_config=dict(text, model_type="llama"), vision_config=vision,
            image_token_index=ids["image_token_id"], image_grid_pinpoints=tiny_pinpoints(vision),
            image_seq_length=(vision["image_size"] // vision["patch_size"]) ** 2,
            vision_feature_layer=-1, vision_feature_select_strategy="default"), \
            tf.LlavaNextForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """A picture of ``grid`` patches of the vision tower (height x width), as the
        processor gives it: the base and its tiles (batch, tiles, 3, size, size), its size
        in ``image_sizes`` and its image tokens, newlines included."""
        from transformers.image_processing_utils import select_best_resolution
        config = model.config
        vc = config.vision_config
        height, width = grid[0] * vc.patch_size, grid[1] * vc.patch_size
        canvas_h, canvas_w = select_best_resolution([height, width], config.image_grid_pinpoints)
        tiles = 1 + (canvas_h // vc.image_size) * (canvas_w // vc.image_size)
        sizes = torch.tensor([[height, width]])
        pixels = torch.randn(1, tiles, 3, vc.image_size, vc.image_size, generator=generator)
        count = token_count(self.family.pieces(config, {"image_sizes": sizes}, 0, height, width))
        return torch.full((count,), IMAGE_TOKEN), {"pixel_values": pixels, "image_sizes": sizes}

    def processor(self, model_type: str, tokenizer, **_):
        """A base and tiles of 16 x 16 pixels on the canvases of :func:`tiny_pinpoints`."""
        import transformers as tf
        vision = clip_vision(32)
        tile = vision["image_size"]
        images = tf.LlavaNextImageProcessor(size={"shortest_edge": tile},
                                            crop_size={"height": tile, "width": tile},
                                            image_grid_pinpoints=tiny_pinpoints(vision))
        return tf.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer,
                                     patch_size=vision["patch_size"],
                                     vision_feature_select_strategy="default",
                                     num_additional_image_tokens=1,
                                     chat_template=self.spec.chat_template)
