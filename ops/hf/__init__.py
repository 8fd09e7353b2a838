"""headscope inside a running transformers VLM: :class:`Tracer` computes VAS features
and span-to-region attribution during ``forward`` and ``generate``;
:func:`region_effects` measures the ground truth the attribution head is fitted to.

Needs ``transformers`` (``pip install headscope[hf]``); ``import headscope`` alone never
imports it.
"""
from .effects import region_effects
from .regions import grid_regions
from .stream import Span
from .tracer import Tracer, sentence_end
from .value_norm import value_norm_factors, value_norms

__all__ = ["Span", "Tracer", "grid_regions", "region_effects", "sentence_end",
           "value_norm_factors", "value_norms"]
