"""The tests' side of PaliGemma and PaliGemma 2 (``headscope.hf.families.paligemma``): the tiny
random models, one picture's prompt as the processor lays it out, the real processor sized
to the tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict

from ...families.paligemma import PaliGemma
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS
from .gemma3 import alternating_layers
from .llava import TinyLlava


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


@register_tiny(PaliGemma)
class TinyPaliGemma(TinyFamily):
    attention = "eager"  # Gemma 2's soft cap: sdpa refuses it

    spec = TinySpec(
        tokens={"<image>": IMAGE_TOKEN, "<eos>": EOS, "<bos>": MARKER_IDS[0]},
        chat_template=llava_template(), effects={"paligemma": ("mask",)},
        geometry_waiver="one fixed square patch grid per picture (the SigLIP tower's input), "
                        "before the prompt: the contract's tr.images test covers it")

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        return tiny_paligemma_config(text, vision_hidden, ids)

    image = TinyLlava.image  # one square patch grid per picture, no markers
