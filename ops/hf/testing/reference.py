"""The way attention is inspected without headscope, the reference the tests hold the
Tracer to: a model loaded with eager attention, its attention weights and per-head
writes."""
from __future__ import annotations

from typing import Dict

import torch

from ..families import family_of
from ..structure import output_projection, softmax_attention_layers


def eager_reference(model_eager, inputs: Dict[str, torch.Tensor], **forward_kwargs):
    """The way attention is inspected without headscope: a model loaded with eager
    attention, run with ``output_attentions=True`` and forward hooks on the o_proj inputs.
    Returns ``(output, attentions, head_writes)``: per softmax attention layer of the
    decoder (all of them but a hybrid's other mixers) its ``(B, H, T, T)`` attention and
    ``(B, H, T, Dh)`` per-head outputs (before an output gate, where the layer has one)."""
    decoder = family_of(model_eager).decoder(model_eager)
    H = decoder.config.num_attention_heads
    writes, gates, hooks = [], [], []

    def grab(module, args):
        x = args[0]
        if gates:  # o_proj gets the attention output times sigmoid(gate): divide it out
            x = x / torch.sigmoid(gates.pop())
        writes.append(x.reshape(*x.shape[:2], H, -1).transpose(1, 2))

    def gate(module, args, out):  # q_proj gives (query, gate) per head (Qwen3.5's)
        gates.append(out.reshape(*out.shape[:2], H, -1).chunk(2, -1)[1]
                     .reshape(*out.shape[:2], -1))

    for attention in softmax_attention_layers(decoder):
        hooks.append(output_projection(attention).register_forward_pre_hook(grab))
        query, head_dim = getattr(attention, "q_proj", None), getattr(attention, "head_dim", 0)
        if query is not None and query.out_features == 2 * H * head_dim:
            hooks.append(query.register_forward_hook(gate))
    try:
        with torch.no_grad():
            out = model_eager(**inputs, output_attentions=True, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, list(out.attentions), writes
