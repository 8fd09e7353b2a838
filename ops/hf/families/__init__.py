"""One module per family of VLMs behind one interface (:class:`Family`): the Tracer,
``region_effects`` and the commands ask :func:`family_of` and know no family by name.
Adding a family: a module here with a :class:`Family` subclass, its line in
:data:`FAMILIES`, and its model types in the tests' parametrisation
(``headscope.hf.testing.FAMILIES``); see docs/DEVELOPING.md."""
from __future__ import annotations

from typing import Tuple

from .base import Family
from .gemma3 import Gemma3
from .generic import Generic, no_image_tokens
from .glm4v import Glm4v
from .idefics3 import Idefics3
from .internvl import InternVL
from .layout import WHOLE, ImageTokens, View
from .llama4 import Llama4
from .llava import Llava
from .llava_next import LlavaNext
from .llava_onevision import LlavaOnevision
from .mistral3 import Mistral3
from .paligemma import PaliGemma
from .qwen_vl import QwenVL
from .unsupported import unsupported_reason
from ..structure import placeholder_token_ids

FAMILIES: Tuple[Family, ...] = (QwenVL(), Llava(), Idefics3(), LlavaNext(),
                                LlavaOnevision(), Mistral3(), InternVL(), Glm4v(),
                                Llama4(), Gemma3(), PaliGemma())


GENERIC = Generic()


def supported_model_types() -> Tuple[str, ...]:
    return tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_or_config, who: str = "headscope.hf") -> Family:
    """The family of a model (or its config): its family module, else the generic reading
    by structure (:mod:`.generic`); a clear error for a model that cannot be traced,
    naming why."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    reason = unsupported_reason(config)
    if reason is None:
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
        if placeholder_token_ids(config) is None:
            reason = no_image_tokens(config)
    if reason is not None:
        raise ValueError(f"{who}: {type(model_or_config).__name__} (model_type "
                         f"{model_type!r}) is not supported: {reason}")
    return GENERIC


__all__ = ["FAMILIES", "Family", "GENERIC", "ImageTokens", "View", "WHOLE", "family_of",
           "supported_model_types"]
