"""The text decoder's inputs on one forward over a prompt and its answer (the embeddings
with the image features in place, positions, masks), as ``region_effects`` and the
gradient baselines run the decoder alone on them."""
from __future__ import annotations

from typing import Dict

import torch

from .answer import continue_inputs
from .capture import decoder_kwargs
from .checks import check_sequence
from .families import family_of

WHO = "headscope.hf.decoder_inputs"


def decoder_inputs(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                   who: str = WHO) -> dict:
    """The keyword arguments the model's text decoder gets on one forward over
    ``sequences`` (one prompt's ``inputs`` continued by its generated answer): its
    ``inputs_embeds`` (the image tokens' embeddings as the vision tower hands them over),
    ``position_ids``, ``attention_mask`` and whatever else the model passes. The model's
    forward stops at the decoder."""
    P, N = check_sequence(inputs, sequences, who)
    family = family_of(model, who)
    family.check_answer(model.config, sequences[:, P:], who)
    full = continue_inputs(family, family.model_inputs(inputs), sequences[:, P:])
    mask = full.get("attention_mask")
    if mask is not None:
        # Holes in the mask hide keys but do not move positions (Qwen-VL's rope index
        # takes only padding at the ends): positions come from the mask without them.
        kept = mask[0].nonzero()
        if len(kept):
            full["attention_mask"] = mask.clone()
            full["attention_mask"][0, int(kept[0]):int(kept[-1]) + 1] = 1
    got = decoder_kwargs(model, family.decoder(model), full)
    if mask is not None and got.get("attention_mask") is not None:
        # the 2-D mask (a VLM may hand its decoder masks built by layer type instead)
        got["attention_mask"] = mask.to(got["inputs_embeds"].device)
    if got.get("inputs_embeds") is None:
        raise NotImplementedError(f"{who}: {type(model).__name__} does not hand its "
                                  f"text decoder inputs_embeds")
    return got
