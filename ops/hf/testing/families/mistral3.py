"""The tests' side of Mistral 3 (``headscope.hf.families.mistral3``): the tiny random models,
one picture's prompt as the processor lays it out, the real processor sized to the tiny
vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.mistral3 import Mistral3
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS

# The tiny models' marker tokens
IMAGE_BREAK = MARKER_IDS[2]  # [IMG_BREAK]
IMAGE_END = MARKER_IDS[3]    # [IMG_END]


@register_tiny(Mistral3)
class TinyMistral3(TinyFamily):
    spec = TinySpec(tokens={"[IMG]": IMAGE_TOKEN, "[IMG_BREAK]": IMAGE_BREAK,
                            "[IMG_END]": IMAGE_END, "</s>": EOS},
                    chat_template=llava_template("[IMG] "), effects={"mistral3": ("mask",)},
                    commands=("mistral3",))

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        # The real checkpoints' text models have no sliding window; MistralConfig's own
        # default is 4096.
        return tf.Mistral3Config(
            text_config=dict({"model_type": "mistral", "sliding_window": None}, **text),
            vision_config=dict(model_type="pixtral", hidden_size=vision_hidden,
                               intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, head_dim=vision_hidden // 2,
                               image_size=64, patch_size=4),
            image_token_index=ids["image_token_id"], spatial_merge_size=2,
            vision_feature_layer=-1, tie_word_embeddings=False), \
            tf.Mistral3ForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the picture's patch grid (even sizes)."""
        vc = model.config.vision_config
        patch, merge = vc.patch_size, model.config.spatial_merge_size
        rows, cols = grid[0] // merge, grid[1] // merge
        ids = torch.full((rows, cols + 1), IMAGE_TOKEN)
        ids[:, -1] = IMAGE_BREAK
        ids[-1, -1] = IMAGE_END
        size = (grid[0] * patch, grid[1] * patch)
        pixels = torch.randn(1, vc.num_channels, *size, generator=generator)
        return ids.flatten(), {"pixel_values": pixels, "image_sizes": torch.tensor([size])}

    def processor(self, model_type: str, tokenizer, *, longest_edge: int, **_):
        """Longest edge ``longest_edge`` pixels, sides rounded up to multiples of 8,
        patches of 4 merged 2 x 2."""
        import transformers as tf
        images = tf.PixtralImageProcessor(size={"longest_edge": longest_edge})
        return tf.PixtralProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                   spatial_merge_size=2, chat_template=self.spec.chat_template)
