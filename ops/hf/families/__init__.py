"""One module per family of VLMs behind one interface (:class:`Family`): the Tracer,
``region_effects`` and the commands ask :func:`family_of` and know no family by name.
Each module registers its family with ``@register``; importing this package imports every
module in it, so :data:`FAMILIES`, :func:`supported_model_types` and every list of families
come from those modules (the tests' side of each family is its module in
``headscope.hf.testing.families``); a model of no family module is read by its structure
(:mod:`.generic`). Adding a family: docs/DEVELOPING.md."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Tuple

from .base import REGISTRY, Family, register
from .generic import Generic, no_image_tokens
from .layout import WHOLE, ImageTokens, View
from .unsupported import unsupported_reason
from ..structure import placeholder_token_ids

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

# every registered family, by name
FAMILIES: Tuple[Family, ...] = tuple(sorted(REGISTRY, key=lambda f: f.name))
# any other VLM, read by its structure (not registered: it names no model type)
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
           "register", "supported_model_types"]
