"""The ``"headscope"`` attention implementation: transformers' attention and mask
interfaces dispatch to it, and it hands each call to the :class:`Binding` bound to the
layer's config (a :class:`~headscope.hf.Tracer`, or the key mask of
:func:`~headscope.hf.region_effects`), which calls the implementation the model was
loaded with.

Small and stateless by design (transformers' ``integrations/sdpa_attention.py`` is the
model): all state lives in the binding, found through ``module.config``; a config with
no binding is an error, never a silent pass-through.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict

import torch

NAME = "headscope"

_BOUND: Dict[int, "Binding"] = {}  # id(text config) -> binding


def _unbound():
    raise RuntimeError(
        f"headscope.hf: the model's attention implementation is {NAME!r} but no Tracer is "
        f"attached to it (a copy of a traced model?); set `config._attn_implementation` "
        f"back to the one it was loaded with")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, **kwargs):
    # the lookup inline: this runs once per layer and step
    binding = _BOUND.get(id(module.config)) or _unbound()
    return binding.attention(module, query, key, value, attention_mask, **kwargs)


def mask_interface(*args, **kwargs):
    binding = _BOUND.get(id(kwargs.get("config"))) or _unbound()
    return binding.mask(*args, **kwargs)


def base_functions(name: str, who: str) -> tuple:
    """(attention function or None for the modeling file's eager one, mask function) of
    the implementation ``name``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if name == NAME:
        raise RuntimeError(f"{who}: the model is already traced (a Tracer or region_effects "
                           f"is attached to it)")
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"{who}: the attention implementation {name!r} has no "
                         f"mask function in transformers' AttentionMaskInterface; load the "
                         f"model with sdpa, eager or flash attention")
    attention = None if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
    return attention, ALL_MASK_ATTENTION_FUNCTIONS[name]


def eager_function(module: torch.nn.Module, who: str) -> Callable:
    """The modeling file's own ``eager_attention_forward`` (transformers keeps one per
    model, not in the interface)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{who}: {type(module).__name__} has no eager_attention_forward in "
                         f"its modeling file")
    return fn


def register() -> None:
    """Registers the implementation under :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_interface)


class Binding:
    """Puts a text decoder (its ``config``) on the ``"headscope"`` implementation while
    bound and receives its attention and mask calls; by default they go to the
    implementation the model was loaded with, unchanged. ``who`` names the owner in
    error messages."""

    who = "headscope.hf"

    def bind(self, config) -> None:
        register()
        base_name = config._attn_implementation_internal
        self._base_attention, self.base_mask = base_functions(base_name, self.who)
        self._base_name = base_name
        _BOUND[id(config)] = self
        config._attn_implementation_internal = NAME

    def unbind(self, config) -> None:
        config._attn_implementation_internal = self._base_name
        _BOUND.pop(id(config), None)

    def base_attention(self, module) -> Callable:
        return self._base_attention or eager_function(module, self.who)

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        return self.base_attention(module)(module, query, key, value, attention_mask, **kwargs)

    def mask(self, *args, **kwargs):
        return self.base_mask(*args, **kwargs)
