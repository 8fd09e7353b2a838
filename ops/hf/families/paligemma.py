"""PaliGemma and PaliGemma 2: the picture's SigLIP patch grid (the processor's resize to
the tower's square input) comes first, then the prompt; image and prompt are one prefix
whose tokens attend to each other both ways (``token_type_ids`` 0), the answer attends
causally (1). PaliGemma 2's Gemma 2 decoder alternates sliding-window and full layers and
soft-caps its logits (eager attention only)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS
from .base import Family, TinySpec, llava_template, register
from .gemma3 import alternating_layers
from .layout import ImageTokens, patches_per_side, square_pictures
from .llava import Llava

WHO = "headscope.hf.Tracer"


@register
class PaliGemma(Family):
    name = "paligemma"
    titles = ("PaliGemma", "PaliGemma 2")
    model_types = ("paligemma",)
    layout = "one square patch grid per picture, before the prompt; image and prompt one " \
             "bidirectional prefix"
    tiny_attention = "eager"  # Gemma 2's soft cap: sdpa refuses it
    tiny = TinySpec(
        tokens={"<image>": IMAGE_TOKEN, "<eos>": EOS, "<bos>": MARKER_IDS[0]},
        chat_template=llava_template(), effects={"paligemma": ("mask",)},
        geometry_waiver="one fixed square patch grid per picture (the SigLIP tower's input), "
                        "before the prompt: the contract's tr.images test covers it")

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        return square_pictures(WHO, inputs, self.image_token_ids(config),
                               patches_per_side(config.vision_config))

    def prompt_types(self, model, is_image: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"token_type_ids": torch.zeros_like(is_image, dtype=torch.int64)}

    def answer_type(self, name: str) -> int:
        return 1  # generated tokens are the causal suffix

    def final_softcap(self, config) -> Optional[float]:
        return getattr(config.get_text_config(), "final_logit_softcapping", None)

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        return tiny_paligemma_config(text, vision_hidden, ids)

    tiny_image = Llava.tiny_image  # one square patch grid per picture, no markers


def tiny_paligemma_config(text: Dict[str, Any], vision_hidden: int, ids: Dict[str, int]):
    """A tiny PaliGemma 2 (text ``model_type`` ``"gemma2"``, the default: a window of 8 in
    every other layer, soft caps) or PaliGemma (``"gemma"``) config and its model class."""
    import transformers as tf
    # larger weights than the default 0.02: the tiny decoder's attention would otherwise be
    # nearly uniform, where VAS's correlations are ill-conditioned (float32 vs float64)
    text = dict({"model_type": "gemma2", "initializer_range": 0.1}, **text,
                query_pre_attn_scalar=text["head_dim"])
    if text["model_type"] == "gemma2":
        text.update(sliding_window=8, layer_types=alternating_layers(text["num_hidden_layers"]))
    vision = dict(model_type="siglip_vision_model", hidden_size=vision_hidden,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=32, patch_size=8)
    return tf.PaliGemmaConfig(text_config=text, vision_config=vision,
                              image_token_index=ids["image_token_id"],
                              projection_dim=text["hidden_size"],
                              hidden_size=text["hidden_size"]), \
        tf.PaliGemmaForConditionalGeneration
