"""The tests' side of Idefics3 and SmolVLM (``headscope.hf.families.idefics3``): the tiny
random models, one picture's prompt as the processor lays it out, the real processor sized
to the tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.idefics3 import Idefics3, tile_side
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS

# Marker ids of the tiny vocabulary: special tokens among MARKER_IDS, the 6 x 6
# ``<row_i_col_j>`` markers at ordinary text ids below the image token.
FAKE_TOKEN = MARKER_IDS[2]        # <fake_token_around_image>
GLOBAL_TOKEN = MARKER_IDS[3]      # <global-img>
NEWLINE = MARKER_IDS[4]           # "\n"
END_OF_UTTERANCE = MARKER_IDS[5]  # <end_of_utterance>
ROW_COL_BASE = 464     # <row_{i+1}_col_{j+1}> is ROW_COL_BASE + 6 * i + j
TINY_TILE = 16         # the tiny vision tower's input size in pixels: one tile
TINY_TOKENS = {"<image>": IMAGE_TOKEN, "</s>": EOS, "<fake_token_around_image>": FAKE_TOKEN,
               "<global-img>": GLOBAL_TOKEN, "\n": NEWLINE,
               "<end_of_utterance>": END_OF_UTTERANCE,
               **{f"<row_{i + 1}_col_{j + 1}>": ROW_COL_BASE + 6 * i + j
                  for i in range(6) for j in range(6)}}


@register_tiny(Idefics3)
class TinyIdefics3(TinyFamily):
    spec = TinySpec(tokens=TINY_TOKENS, chat_template=llava_template(),
                    grids=((2, 2), (1, 3)), commands=("idefics3",))

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        # intermediate_size 48: the random weights (drawn vision tower first) whose greedy
        # answers to the tests' prompts hold no image token, which would make prompt plus
        # answer invalid input for the model itself
        common = dict(text_config=dict(text, model_type="llama"),
                      vision_config=dict(hidden_size=vision_hidden, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         image_size=TINY_TILE, patch_size=4),
                      scale_factor=2, image_token_id=ids["image_token_id"])
        if model_type == "idefics3":
            return tf.Idefics3Config(**common), tf.Idefics3ForConditionalGeneration
        return tf.SmolVLMConfig(**common), tf.SmolVLMForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the picture's rows x cols tiles ((0, 0): not split), laid out as
        ``get_image_prompt_string`` does, with a tokenizer that gives "\\n" one token."""
        rows, cols = grid
        seq = [IMAGE_TOKEN] * tile_side(model.config) ** 2
        ids = []
        for i in range(rows):
            for j in range(cols):
                ids += [FAKE_TOKEN, ROW_COL_BASE + 6 * i + j] + seq
            ids.append(NEWLINE)
        ids += ([NEWLINE] if rows else []) + [FAKE_TOKEN, GLOBAL_TOKEN] + seq + [FAKE_TOKEN]
        size = model.config.vision_config.image_size
        count = rows * cols + 1
        pixels = torch.randn(1, count, 3, size, size, generator=generator)
        mask = torch.ones(1, count, size, size, dtype=torch.int64)
        return torch.tensor(ids), {"pixel_values": pixels, "pixel_attention_mask": mask}

    def processor(self, model_type: str, tokenizer, **_):
        """Longest edge 48 pixels, up to 3 x 3 tiles of 16 x 16 pixels and a global image,
        4 tokens each (Idefics3; SmolVLM's processor needs num2words)."""
        import transformers as tf
        if model_type != "idefics3":
            raise NotImplementedError(f"headscope.hf.testing.tiny_processor: no tiny "
                                      f"{model_type} processor (SmolVLMProcessor needs "
                                      f"num2words); build one from tiny_tokenizer")
        images = tf.Idefics3ImageProcessor(size={"longest_edge": 3 * TINY_TILE},
                                           max_image_size={"longest_edge": TINY_TILE})
        return tf.Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                    image_seq_len=4, chat_template=self.spec.chat_template)
