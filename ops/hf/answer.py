"""A prompt followed by its answer as one model input, and the tokens that end an answer:
what a generation's final sequence (the answer's VAS), ``region_effects``' teacher-forced
forward and the ``vas`` command feed the model."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .families.base import TYPE_INPUTS


def end_tokens(model, tokenizer=None, generate_kwargs: Optional[dict] = None) -> List[int]:
    """The end-of-sequence ids generation stops at: ``generate_kwargs``' ``eos_token_id``
    (None included, as ``generate`` reads it) or its ``generation_config``'s, else the
    model's generation config's; where none is set, the ``tokenizer``'s (None: no end)."""
    kwargs = generate_kwargs or {}
    config = kwargs.get("generation_config") or model.generation_config
    eos = kwargs["eos_token_id"] if "eos_token_id" in kwargs else config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else
                             eos if isinstance(eos, (list, tuple)) else [eos])]


def continue_inputs(family, inputs: Dict[str, torch.Tensor], answer: torch.Tensor,
                    answer_mask: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """The model inputs of the prompt ``inputs`` followed by ``answer`` ``(B, N)`` token
    ids, as the model's ``generate`` extends them: ``input_ids`` continued by the answer,
    the ``attention_mask`` (where the prompt has one, or ``answer_mask`` is given) by
    ``answer_mask`` ``(B, N)`` (default: ones), and each per-position type input
    (:data:`~headscope.hf.families.base.TYPE_INPUTS`) by the family's ``answer_type``;
    every other input as it is."""
    ids = inputs["input_ids"]
    (B, P), N = ids.shape, answer.shape[1]
    full = dict(inputs)
    full["input_ids"] = torch.cat([ids, answer.to(ids)], 1)
    mask = inputs.get("attention_mask")
    if mask is not None or answer_mask is not None:
        if mask is None:
            mask = torch.ones(B, P, dtype=torch.int64, device=ids.device)
        keep = torch.ones(B, N, dtype=mask.dtype, device=mask.device) if answer_mask is None \
            else answer_mask.to(mask.dtype)
        full["attention_mask"] = torch.cat([mask, keep], 1)
    for name in TYPE_INPUTS:
        types = inputs.get(name)
        if types is not None:
            full[name] = torch.nn.functional.pad(types, (0, N), value=family.answer_type(name))
    return full
