"""The tests' side of InternVL (``headscope.hf.families.internvl``): the tiny random models,
one picture's prompt as the processor lays it out, the real processor sized to the tiny
vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.internvl import InternVL
from ...families.layout import thumbnail
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN

# The tiny models' marker tokens
IMAGE_START = MARKER_IDS[2]  # <img>
IMAGE_END = MARKER_IDS[3]    # </img>


@register_tiny(InternVL)
class TinyInternVL(TinyFamily):
    spec = TinySpec(
        tokens={"<IMG_CONTEXT>": IMAGE_TOKEN, "<video>": VIDEO_TOKEN, "<img>": IMAGE_START,
                "</img>": IMAGE_END, "</s>": EOS},
        tokenizer_extras={"start_image_token": "<img>", "end_image_token": "</img>",
                          "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        chat_template=llava_template("<IMG_CONTEXT> "), grids=((2, 2), (1, 3)),
        effects={"internvl": ("mask",)}, commands=("internvl",))

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        return tf.InternVLConfig(
            text_config=dict(text, model_type="qwen2", use_sliding_window=False),
            vision_config=dict(hidden_size=vision_hidden, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2,
                               image_size=[16, 16], patch_size=[4, 4]),
            image_token_id=ids["image_token_id"], image_seq_length=4, downsample_ratio=0.5,
            vision_feature_layer=-1, vision_feature_select_strategy="default",
            tie_word_embeddings=False), tf.InternVLForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the canvas's rows x cols tiles; the tiles are cut from one random
        picture and the thumbnail is that picture downscaled, as the processor makes them."""
        vc = model.config.vision_config
        size = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
        rows, cols = grid
        picture = torch.randn(vc.num_channels, rows * size, cols * size, generator=generator)
        tiles = [picture[:, r * size:(r + 1) * size, c * size:(c + 1) * size]
                 for r in range(rows) for c in range(cols)]
        if len(tiles) > 1:
            tiles.append(thumbnail(picture, size))
        tokens = self.family.side(model.config) ** 2 * len(tiles)
        ids = torch.cat([torch.tensor([IMAGE_START]), torch.full((tokens,), IMAGE_TOKEN),
                         torch.tensor([IMAGE_END])])
        return ids, {"pixel_values": torch.stack(tiles)}

    def processor(self, model_type: str, tokenizer, *, max_tiles: int, **_):
        """Up to ``max_tiles`` tiles of 16 x 16 pixels and a thumbnail, 4 tokens each."""
        import transformers as tf
        images = tf.GotOcr2ImageProcessor(size={"height": 16, "width": 16}, crop_to_patches=True,
                                          min_patches=1, max_patches=max_tiles)
        return tf.InternVLProcessor(image_processor=images, tokenizer=tokenizer,
                                    video_processor=tf.InternVLVideoProcessor(),
                                    image_seq_length=4, chat_template=self.spec.chat_template)
