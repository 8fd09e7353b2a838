"""The way attention is inspected without headscope, the reference the tests hold the
Tracer to: a model loaded with eager attention, its attention weights and per-head
writes (:func:`eager_reference`); or any model's attention calls as they run, their q, k,
mask, output and what each head writes (:func:`recorded_attention`)."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch

from ..families import family_of
from ..structure import output_projection, softmax_attention_layers


# model types whose attention multiplies each head's output by sigmoid(gate) before the
# output projection, the gate the second half of q_proj's output per head (Qwen3.5's
# decoder); in every other family the projection reads the attention output as it is
# (docs/hf.md, "What a head writes")
GATED = frozenset({"qwen3_5", "qwen3_5_moe", "minicpmv4_6"})


def eager_reference(model_eager, inputs: Dict[str, torch.Tensor], **forward_kwargs):
    """The way attention is inspected without headscope: a model loaded with eager
    attention, run with ``output_attentions=True`` and forward pre-hooks on the output
    projections. Returns ``(output, attentions, head_writes)``: per softmax attention layer
    of the decoder (all of them but a hybrid's other mixers) its ``(B, H, T, T)`` attention
    and ``(B, H, T, Dh)`` per-head writes, each head's block of its output projection's
    input (after an output gate, where the layer has one: what the head writes into the
    residual stream)."""
    decoder = family_of(model_eager).decoder(model_eager)
    H = decoder.config.num_attention_heads
    writes, hooks = [], []

    def grab(module, args):
        x = args[0]
        writes.append(x.reshape(*x.shape[:2], H, -1).transpose(1, 2))

    for attention in softmax_attention_layers(decoder):
        hooks.append(output_projection(attention).register_forward_pre_hook(grab))
    try:
        with torch.no_grad():
            out = model_eager(**inputs, output_attentions=True, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, list(out.attentions), writes


@dataclass
class AttentionCall:
    """One call of a traced layer's attention: ``query`` ``(B, H, Tq, D)`` after rotary,
    ``key`` ``(B, Hkv, Tk, D)`` (the cache), the ``mask`` the model passed (None, bool
    True = seen, or additive), ``scale``, ``softcap``, the ``weights`` an eager
    implementation formed, its ``output`` ``(B, Tq, H, Dh)``, and ``writes``
    ``(B, H, Tq, Dh)``: each head's block of the output projection's input."""
    layer: int
    query: torch.Tensor
    key: torch.Tensor
    mask: Optional[torch.Tensor]
    scale: float
    softcap: Optional[float]
    weights: Optional[torch.Tensor]
    output: torch.Tensor
    writes: Optional[torch.Tensor] = field(default=None)


@contextlib.contextmanager
def recorded_attention(model) -> Iterator[List[AttentionCall]]:
    """Records each call of the text decoder's softmax attention layers, in order, while
    the block runs. Enter it before a Tracer is made on ``model`` (a Tracer keeps the
    attention function it finds when it attaches)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    decoder = family_of(model).decoder(model)
    layers = softmax_attention_layers(decoder)
    index = {id(m): i for i, m in enumerate(layers)}
    H = decoder.config.num_attention_heads
    calls: List[AttentionCall] = []
    last: Dict[int, AttentionCall] = {}

    def recording(function):
        def record(module, query, key, value, attention_mask, **kwargs):
            out, weights = function(module, query, key, value, attention_mask, **kwargs)
            layer = index.get(id(module))
            if layer is not None:
                scale = kwargs.get("scaling")
                call = AttentionCall(layer, query, key, attention_mask,
                                     query.shape[-1] ** -0.5 if scale is None else float(scale),
                                     kwargs.get("softcap"), weights, out)
                calls.append(call)
                last[layer] = call
            return out, weights
        return record

    def written(layer):
        def hook(module, args):
            x = args[0]
            last.pop(layer).writes = x.unflatten(-1, (H, -1)).transpose(1, 2)
        return hook

    name = decoder.config._attn_implementation
    hooks = [output_projection(m).register_forward_pre_hook(written(i))
             for i, m in enumerate(layers)]
    modules = {sys.modules[type(m).__module__] for m in layers}
    saved = {module: module.eager_attention_forward for module in modules} \
        if name == "eager" else {}
    previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(name)  # a local override
    try:
        if name == "eager":
            for module, function in saved.items():
                module.eager_attention_forward = recording(function)
        else:
            ALL_ATTENTION_FUNCTIONS[name] = recording(ALL_ATTENTION_FUNCTIONS[name])
        yield calls
    finally:
        for hook in hooks:
            hook.remove()
        for module, function in saved.items():
            module.eager_attention_forward = function
        if name != "eager" and previous is not None:
            ALL_ATTENTION_FUNCTIONS[name] = previous
        elif name != "eager":
            del ALL_ATTENTION_FUNCTIONS[name]
