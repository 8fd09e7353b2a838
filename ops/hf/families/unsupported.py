"""Models headscope cannot read, each with the reason: :func:`family_of` raises it instead
of trying the generic reading, so a user learns what is missing, not only that something
is. Only what cannot be traced is here (a model type whose pictures never enter the
sequence); a decoder with no softmax attention layer is refused by the Tracer, from its
structure."""
from __future__ import annotations

from typing import Optional

# model_type -> why its pictures have no image tokens to trace
NO_IMAGE_TOKENS = {
    "mllama": ("Llama 3.2 Vision (mllama) reads its pictures through cross-attention layers "
               "to the vision features; its sequence holds one <|image|> placeholder per "
               "picture, not one token per part of the picture, so its self-attention never "
               "attends to image tokens and headscope has no regions to attribute to"),
}


def unsupported_reason(config) -> Optional[str]:
    """Why headscope cannot trace a model of ``config``, or None if nothing known stops it."""
    return NO_IMAGE_TOKENS.get(getattr(config, "model_type", None))
