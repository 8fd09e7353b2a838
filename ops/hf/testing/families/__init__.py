"""The tests' side of every family of ``headscope.hf.families``: one module per family
module, of the same name, registering a :class:`~headscope.hf.testing.spec.TinyFamily`
with ``@register_tiny(FamilyClass)``. Importing this package imports every module in it
and refuses a registered family that has none (:func:`check_every_family_tested`)."""
from __future__ import annotations

import importlib
import pkgutil
from types import SimpleNamespace
from typing import Sequence

from ...families import FAMILIES, Family, family_of
from ..spec import TINY, TinyFamily

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def check_every_family_tested(families: Sequence[Family]) -> None:
    """Raises for a family of ``families`` whose tests' side is missing."""
    missing = [type(f).__name__ for f in families if type(f) not in TINY]
    if missing:
        raise TypeError(f"headscope.hf.testing.families: no module registers the tests' side "
                        f"(@register_tiny) of the families {missing}: add "
                        f"ops/hf/testing/families/<module>.py beside each family module")


check_every_family_tested(FAMILIES)


def tiny_of(family) -> TinyFamily:
    """The tests' side of a family: ``family`` a registered :class:`Family`, a model or
    config of one, or a model type."""
    if isinstance(family, str):
        family = SimpleNamespace(model_type=family)
    if not isinstance(family, Family):
        family = family_of(family)
    return TINY[type(family)]


__all__ = ["TINY", "check_every_family_tested", "tiny_of"]
