"""Models headscope cannot read, each with the reason: :func:`family_of` raises it instead
of the generic "not a supported VLM", so a user learns what is missing, not only that
something is."""
from __future__ import annotations

from typing import Optional

# model_type -> why its pictures have no image tokens to trace
NO_IMAGE_TOKENS = {
    "mllama": ("Llama 3.2 Vision (mllama) reads its pictures through cross-attention layers "
               "to the vision features; its sequence holds one <|image|> placeholder per "
               "picture, not one token per part of the picture, so its self-attention never "
               "attends to image tokens and headscope has no regions to attribute to"),
}


def linear_attention_layers(config) -> list:
    """The indices of the decoder's linear-attention layers (Qwen3-Next's and Qwen3.5's
    gated delta net): ``layer_types`` entries ``"linear_attention"``."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None) or []
    return [i for i, t in enumerate(types) if t == "linear_attention"]


def unsupported_reason(config) -> Optional[str]:
    """Why headscope cannot trace a model of ``config``, or None if nothing known stops it."""
    model_type = getattr(config, "model_type", None)
    if model_type in NO_IMAGE_TOKENS:
        return NO_IMAGE_TOKENS[model_type]
    linear = linear_attention_layers(config)
    if linear:
        return (f"its decoder layers {linear} are linear-attention layers (a gated delta net "
                f"with a recurrent state, as in Qwen3-Next and Qwen3.5), which form no "
                f"attention weights from each token to the image tokens; headscope reads "
                f"softmax attention only")
    return None
