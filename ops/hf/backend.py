"""The ``"headscope"`` attention implementation: transformers' attention and mask
interfaces dispatch to it, it calls the implementation the model was loaded with and
shows each call to the tracer bound to the layer's config.

Small and stateless by design (transformers' ``integrations/sdpa_attention.py`` is the
model): all state lives in the :class:`~headscope.hf.Tracer`, found through
``module.config``; a config with no tracer bound is an error, never a silent pass-through.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict

import torch

NAME = "headscope"

_BOUND: Dict[int, object] = {}  # id(text config) -> Tracer


def bind(config, tracer) -> None:
    if id(config) in _BOUND:
        raise RuntimeError("headscope.hf.Tracer: this model is already traced; leave the other "
                           "tracer's `with` block (or call its detach()) first")
    _BOUND[id(config)] = tracer


def unbind(config) -> None:
    _BOUND.pop(id(config), None)


def _tracer(config):
    tracer = _BOUND.get(id(config))
    if tracer is None:
        raise RuntimeError(
            f"headscope.hf: the model's attention implementation is {NAME!r} but no Tracer is "
            f"attached to it (a copy of a traced model?); set `config._attn_implementation` "
            f"back to the one it was loaded with")
    return tracer


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, **kwargs):
    tracer = _tracer(module.config)
    out, weights = tracer.base_attention(module)(module, query, key, value, attention_mask,
                                                 **kwargs)
    if tracer.observing:
        tracer.observe(module, query, key, out, weights, kwargs)
    return out, weights


def mask_interface(*args, **kwargs):
    tracer = _tracer(kwargs.get("config"))
    tracer.record_mask(kwargs)
    return tracer.base_mask(*args, **kwargs)


def base_functions(name: str) -> tuple:
    """(attention function or None for the modeling file's eager one, mask function) of
    the implementation ``name``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if name == NAME:
        raise RuntimeError("headscope.hf.Tracer: the model is already traced")
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"headscope.hf.Tracer: the text decoder's attention implementation "
                         f"{name!r} has no mask function in transformers' "
                         f"AttentionMaskInterface; load the model with sdpa, eager or flash "
                         f"attention")
    attention = None if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
    return attention, ALL_MASK_ATTENTION_FUNCTIONS[name]


def eager_function(module: torch.nn.Module) -> Callable:
    """The modeling file's own ``eager_attention_forward`` (transformers keeps one per
    model, not in the interface)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"headscope.hf.Tracer: {type(module).__name__} has no "
                         f"eager_attention_forward in its modeling file")
    return fn


def register() -> None:
    """Registers the implementation under :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_interface)
