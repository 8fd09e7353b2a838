"""A gradient baseline for region attribution: input x gradient of each span's
log-probability with respect to the image-token embeddings as they enter the text
decoder (after the vision tower's merge), summed per region; and the gradient's norm per
region. Works on any model :func:`~headscope.hf.region_effects` takes, with its
arguments."""
from __future__ import annotations

import contextlib
from typing import Dict, Sequence, Tuple

import torch

from .effects import check_region_ids, decoder_inputs, span_bounds

WHO = "headscope.hf.gradient_scores"
_PASSED = ("attention_mask", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")


@contextlib.contextmanager
def _frozen(model):
    """No parameter needs a gradient inside (only the embeddings' is wanted)."""
    wanted = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in wanted:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in wanted:
            p.requires_grad_(flag)


def answer_log_probs(model, embeds: torch.Tensor, got: dict, targets: torch.Tensor,
                     P: int) -> torch.Tensor:
    """``(N,)`` log-probabilities of the answer ``targets`` given the decoder inputs
    ``got`` with ``embeds`` in place of its ``inputs_embeds``."""
    kwargs = {k: got[k] for k in _PASSED if got.get(k) is not None}
    hidden = model.get_decoder()(inputs_embeds=embeds, use_cache=False,
                                 **kwargs).last_hidden_state
    logits = model.get_output_embeddings()(hidden[0, P - 1:P - 1 + len(targets)]).float()
    return logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def gradient_scores(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                    spans: Sequence, region_ids: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per span S and region k: ``sum over k's tokens i of e_i . d(sum_{t in S} log p(y_t))
    / d e_i`` (input x gradient; ``e_i`` the embedding of image token i as the decoder gets
    it) and the L2 norm of the gradient over k's tokens. Arguments as for
    :func:`~headscope.hf.region_effects`; one forward and one backward pass per span.
    Returns two ``(num_spans, K)`` float32 tensors."""
    got = decoder_inputs(model, inputs, sequences, WHO)
    P = inputs["input_ids"].shape[1]
    bounds = span_bounds(spans, sequences.shape[1] - P, WHO)
    rid = check_region_ids(region_ids, P, WHO)
    K = int(rid.max()) + 1
    image = (rid >= 0).nonzero().squeeze(1)
    regions = rid[image]
    embeds = got["inputs_embeds"].detach().requires_grad_(True)
    targets = sequences[0, P:].to(embeds.device)
    ixg = torch.zeros(len(bounds), K, dtype=torch.float64)
    norm = torch.zeros(len(bounds), K, dtype=torch.float64)
    with torch.enable_grad(), _frozen(model):
        logp = answer_log_probs(model, embeds, got, targets, P)
        for s, (start, end) in enumerate(bounds.tolist()):
            (grad,) = torch.autograd.grad(logp[start:end].sum(), embeds,
                                          retain_graph=s < len(bounds) - 1)
            g = grad[0, image.to(grad.device)].double().cpu()  # (M, C)
            e = embeds[0, image.to(grad.device)].detach().double().cpu()
            ixg[s].index_add_(0, regions, (g * e).sum(-1))
            norm[s].index_add_(0, regions, g.square().sum(-1))
    return ixg.float(), norm.sqrt().float()
