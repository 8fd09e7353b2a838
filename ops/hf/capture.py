"""A forward of the model stopped at its text decoder, for the keyword arguments the
decoder gets (its input embeddings with the image features in place, positions, masks):
``region_effects``, the gradient baselines and the generic family's marker probe read the
decoder's inputs so. While one runs, :func:`capturing` tells a tracer bound to the model
that the forward is none of its own."""
from __future__ import annotations

from typing import Dict

import torch

_CAPTURING: set = set()  # ids of the models a capture runs on


class _Captured(Exception):
    """Stops the model's forward at its text decoder, once the inputs are taken."""


def capturing(model) -> bool:
    """Whether ``model`` runs a forward of :func:`decoder_kwargs` now."""
    return id(model) in _CAPTURING


def decoder_kwargs(model, decoder: torch.nn.Module, inputs: Dict[str, torch.Tensor]) -> dict:
    """The keyword arguments ``decoder`` (the model's text decoder) gets on a forward of
    ``model`` over ``inputs`` (no cache); the model's forward stops at the decoder."""
    got = {}

    def grab(module, args, kwargs):
        got.update(kwargs)
        raise _Captured()

    handle = decoder.register_forward_pre_hook(grab, with_kwargs=True)
    _CAPTURING.add(id(model))
    try:
        model(**inputs, use_cache=False)
    except _Captured:
        pass
    finally:
        _CAPTURING.discard(id(model))
        handle.remove()
    return got
