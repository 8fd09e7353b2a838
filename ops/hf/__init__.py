"""headscope inside a running transformers VLM: :class:`Tracer` computes VAS features
and span-to-region attribution during ``forward`` and ``generate``.

Needs ``transformers`` (``pip install headscope[hf]``); ``import headscope`` alone never
imports it.
"""
from .stream import Span
from .tracer import Tracer, sentence_end

__all__ = ["Span", "Tracer", "sentence_end"]
