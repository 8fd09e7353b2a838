"""What headscope reads of a transformers VLM by its structure alone, for any model type:
the text decoder's softmax attention layers and their output projections, and the
image placeholder tokens the model scatters its image features into.

A softmax attention layer is a module of the decoder, with a ``layer_idx``, whose forward
dispatches through transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``), as
every modeling file's text attention does whatever its projections are called; the
mixers of a hybrid decoder (gated delta nets, short convolutions, linear attention) do
not, and are not traced.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import List, Optional, Tuple

import torch

# what an attention module's output projection is called across modeling files
_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "wo", "c_proj")


@functools.lru_cache(maxsize=None)
def _dispatches_attention(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' attention interface."""
    forward = cls.__dict__.get("forward")
    if forward is None:
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def softmax_attention_layers(decoder: torch.nn.Module) -> List[torch.nn.Module]:
    """The decoder's softmax attention modules in layer order (sorted by ``layer_idx``)."""
    found = [m for m in decoder.modules() if getattr(m, "layer_idx", None) is not None
             and _dispatches_attention(type(m))]
    return sorted(found, key=lambda m: m.layer_idx)


def other_mixers(decoder: torch.nn.Module) -> List[int]:
    """The decoder layers that mix tokens otherwise than by softmax attention (a hybrid
    decoder's gated delta nets, short convolutions, linear attention)."""
    traced = {m.layer_idx for m in softmax_attention_layers(decoder)}
    return sorted(set(range(int(decoder.config.num_hidden_layers))) - traced)


def output_projection(module: torch.nn.Module) -> torch.nn.Linear:
    """The linear layer that maps an attention module's per-head outputs into the residual
    stream (its ``o_proj``, ``out_proj``, ...)."""
    for name in _OUTPUT_PROJECTIONS:
        proj = getattr(module, name, None)
        if isinstance(proj, torch.nn.Linear):
            return proj
    raise ValueError(f"headscope.hf: {type(module).__name__} has no output projection named "
                     f"one of {', '.join(_OUTPUT_PROJECTIONS)}")


def _modeling_module(model_type: str):
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    name = model_type_to_module_name(model_type)
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def placeholder_names(model_type: str) -> Tuple[str, ...]:
    """The config entries a model type's own ``get_placeholder_mask`` compares
    ``input_ids`` with to find where image features go (``image_token_id``, or the
    family's own name); empty if its modeling file has no such method."""
    module = _modeling_module(model_type)
    names: List[str] = []
    for cls in vars(module).values() if module is not None else ():
        method = inspect.isclass(cls) and cls.__dict__.get("get_placeholder_mask")
        if not method:
            continue
        for name in re.findall(r"config\.(\w+)", inspect.getsource(method)):
            if "image" in name and name not in names:
                names.append(name)
    return tuple(names)


def placeholder_token_ids(config) -> Optional[Tuple[int, ...]]:
    """The ids of the image placeholder tokens of a VLM's ``config``: what its
    ``get_placeholder_mask`` reads, else ``image_token_id`` / ``image_token_index``;
    None if it names none."""
    names = placeholder_names(getattr(config, "model_type", "")) or \
        ("image_token_id", "image_token_index")
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,)
    return None
