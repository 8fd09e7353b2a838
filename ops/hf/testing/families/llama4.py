"""The tests' side of Llama 4 (``headscope.hf.families.llama4``): the tiny random models, one
picture's prompt as the processor lays it out, the real processor sized to the tiny vision
tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.llama4 import Llama4, tile_side
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VISION_END, VISION_START

# The tiny models' marker tokens; <|patch|> is the shared IMAGE_TOKEN, <|image_start|> and
# <|image_end|> VISION_START and VISION_END
TILE_X_SEPARATOR = MARKER_IDS[2]  # <|tile_x_separator|>
TILE_Y_SEPARATOR = MARKER_IDS[3]  # <|tile_y_separator|>
GLOBAL_MARKER = MARKER_IDS[4]     # <|image|>
TINY_TILE = 16          # the tiny vision tower's input size in pixels: one tile


@register_tiny(Llama4)
class TinyLlama4(TinyFamily):
    spec = TinySpec(
        tokens={"<|patch|>": IMAGE_TOKEN, "<|image_start|>": VISION_START,
                "<|image_end|>": VISION_END, "<|tile_x_separator|>": TILE_X_SEPARATOR,
                "<|tile_y_separator|>": TILE_Y_SEPARATOR, "<|image|>": GLOBAL_MARKER,
                "</s>": EOS},
        chat_template=llava_template("<|image|> "), grids=((2, 2), (1, 3)),
        contract_xfail=(AttributeError,
                        "transformers 5.24's Llama4ForConditionalGeneration.forward reads "
                        "image_outputs off its language model's output and raises (docs/hf.md; "
                        "its text decoder's chunked and NoPE layers are traced behind LLaVA in "
                        "test_families_patterns.py)"))

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        # the checkpoints' pattern on two layers: chunked attention with rope, then full
        # attention without rope (NoPE; every 4th layer in the checkpoints); chunks of 16
        # tokens, shorter than the tests' prompts, so that chunking shows; MoE everywhere
        text = dict(text, intermediate_size_mlp=text["intermediate_size"],
                    num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=16,
                    no_rope_layer_interval=2)
        # the vision MLP's width is also the pixel shuffle's output (4 x hidden), which the
        # adapter's first layer reads
        vision = dict(hidden_size=vision_hidden, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=4 * vision_hidden, image_size=TINY_TILE, patch_size=4,
                      pixel_shuffle_ratio=0.5, projector_input_dim=vision_hidden,
                      projector_output_dim=vision_hidden, vision_output_dim=vision_hidden,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0))
        return tf.Llama4Config(text_config=text, vision_config=vision,
                               image_token_index=ids["image_token_id"],
                               boi_token_index=ids["vision_start_token_id"],
                               eoi_token_index=ids["vision_end_token_id"]), \
            tf.Llama4ForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the canvas's rows x cols tiles, laid out as ``_prompt_split_image``
        does (no padding: random pixels)."""
        R, C = grid
        tile = [IMAGE_TOKEN] * tile_side(model.config) ** 2
        ids = [VISION_START]
        if R * C > 1:
            for _ in range(R):
                for j in range(C):
                    ids += tile + ([TILE_X_SEPARATOR] if j < C - 1 else [])
                ids.append(TILE_Y_SEPARATOR)
        ids += [GLOBAL_MARKER] + tile + [VISION_END]
        size = model.config.vision_config.image_size
        count = R * C + (R * C > 1)
        pixels = torch.randn(count, 3, size, size, generator=generator)
        return torch.tensor(ids), {"pixel_values": pixels}

    def processor(self, model_type: str, tokenizer, *, max_tiles: int, **_):
        """A canvas of up to ``max_tiles`` tiles of 16 x 16 pixels and a global image, 4
        tokens each."""
        import transformers as tf
        images = tf.Llama4ImageProcessor(size={"height": TINY_TILE, "width": TINY_TILE},
                                         max_patches=max_tiles)
        return tf.Llama4Processor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                  pixel_shuffle_ratio=0.5, chat_template=self.spec.chat_template)
