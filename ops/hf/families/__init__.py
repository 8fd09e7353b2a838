"""One module per family of VLMs behind one interface (:class:`Family`): the Tracer,
``region_effects`` and the commands ask :func:`family_of` and know no family by name.
Each module registers its family with ``@register``; importing this package imports every
module in it, so :data:`FAMILIES`, :func:`supported_model_types`, the tiny test models,
their processors and the tests' parametrisations all come from those modules. Adding a
family: docs/DEVELOPING.md."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Tuple

from .base import REGISTRY, Family, TinySpec, register
from .layout import WHOLE, ImageTokens, View
from .unsupported import unsupported_reason

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

# every registered family, by name
FAMILIES: Tuple[Family, ...] = tuple(sorted(REGISTRY, key=lambda f: f.name))


def supported_model_types() -> Tuple[str, ...]:
    return tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_or_config, who: str = "headscope.hf") -> Family:
    """The family of a model (or its config); a clear error for any other model, naming
    what headscope does not support in it where that is known."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"{who}: {type(model_or_config).__name__} (model_type "
                         f"{model_type!r}) is not supported: {reason}")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(f"{who}: {type(model_or_config).__name__} (model_type {model_type!r}) is "
                     f"not a supported VLM; supported model types: "
                     f"{', '.join(supported_model_types())}")


__all__ = ["FAMILIES", "Family", "ImageTokens", "TinySpec", "View", "WHOLE", "family_of",
           "register", "supported_model_types"]
