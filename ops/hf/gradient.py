"""A gradient baseline for region attribution: input x gradient of each span's
log-probability with respect to the image-token embeddings as they enter the text
decoder (after the vision tower's merge), summed per region; and the gradient's norm per
region. Works on any model :func:`~headscope.hf.region_effects` takes, with its
arguments. :func:`span_gradients` is the driver it shares with
:func:`~headscope.hf.attnlrp_scores`."""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from .checks import check_region_ids, check_sequence, span_bounds
from .decoder import decoder_inputs
from .families import family_of
from .keymask import KeyMask

WHO = "headscope.hf.gradient_scores"
TARGETS = ("log_prob", "logit")
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


def answer_targets(model, embeds: torch.Tensor, got: dict, targets: torch.Tensor, P: int,
                   target: str = "log_prob",
                   cap: Optional[Callable] = None) -> torch.Tensor:
    """``(N,)`` log-probabilities (``target="log_prob"``) or logits (``"logit"``) of the
    answer ``targets`` given the decoder inputs ``got`` with ``embeds`` in place of its
    ``inputs_embeds``, the logits soft-capped as the model's forward caps them (``cap``:
    how the cap is applied, ``cap(capped, logits)``; None: as it is)."""
    kwargs = {k: got[k] for k in _PASSED if got.get(k) is not None}
    hidden = family_of(model).decoder(model)(inputs_embeds=embeds, use_cache=False,
                                             **kwargs).last_hidden_state
    logits = model.get_output_embeddings()(hidden[0, P - 1:P - 1 + len(targets)])
    softcap = family_of(model).final_softcap(model.config)
    if softcap is not None:
        capped = torch.tanh(logits / softcap) * softcap
        logits = capped if cap is None else cap(capped, logits)
    logits = logits.float()
    if target == "log_prob":
        logits = logits.log_softmax(-1)
    return logits.gather(1, targets.unsqueeze(1)).squeeze(1)


def span_gradients(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                   spans: Sequence, reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   who: str, *, target: str = "log_prob", binding=None) -> torch.Tensor:
    """The gradient of each span's target (the sum of its tokens' :func:`answer_targets`)
    with respect to the decoder's input embeddings, one forward and one backward per
    span, each reduced at once: ``reduce(grad, embeds)`` of the ``(T, C)`` gradient and
    embeddings (float64, CPU) gives a ``(T, ...)`` tensor. ``binding``: a
    :class:`~headscope.hf.keymask.KeyMask` (or a subclass changing the backward) of the
    decoder's config; a plain one by default, which keeps the bidirectional blocks of the
    VLM's masks when the decoder runs alone. Returns ``(num_spans, T, ...)`` float64."""
    if target not in TARGETS:
        raise ValueError(f"{who}: argument 'target' must be one of {TARGETS}, got {target!r}")
    decoder = family_of(model, who).decoder(model)
    binding = binding if binding is not None else KeyMask(decoder.config)
    with binding, torch.enable_grad(), _frozen(model):
        got = decoder_inputs(model, inputs, sequences, who)
        P = inputs["input_ids"].shape[1]
        bounds = span_bounds(spans, sequences.shape[1] - P, who)
        embeds = got["inputs_embeds"].detach().requires_grad_(True)
        answer = sequences[0, P:].to(embeds.device)
        scores = answer_targets(model, embeds, got, answer, P, target,
                                getattr(binding, "final_cap", None))
        kept = embeds[0].detach().double().cpu()
        out = []
        for s, (start, end) in enumerate(bounds.tolist()):
            (grad,) = torch.autograd.grad(scores[start:end].sum(), embeds,
                                          retain_graph=s < len(bounds) - 1)
            out.append(reduce(grad[0].double().cpu(), kept))
    return torch.stack(out)


def region_sums(per_token: torch.Tensor, region_ids: torch.Tensor) -> torch.Tensor:
    """``(S, T, ...)`` values per decoder input position -> ``(S, K, ...)`` sums over each
    region's image tokens (``region_ids``: the prompt's ``(P,)`` checked ids)."""
    image = (region_ids >= 0).nonzero().squeeze(1)
    out = per_token.new_zeros(per_token.shape[0], int(region_ids.max()) + 1,
                              *per_token.shape[2:])
    return out.index_add_(1, region_ids[image], per_token[:, image])


def gradient_scores(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                    spans: Sequence, region_ids: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per span S and region k: ``sum over k's tokens i of e_i . d(sum_{t in S} log p(y_t))
    / d e_i`` (input x gradient; ``e_i`` the embedding of image token i as the decoder gets
    it) and the L2 norm of the gradient over k's tokens. Arguments as for
    :func:`~headscope.hf.region_effects`; one forward and one backward pass per span.
    Returns two ``(num_spans, K)`` float32 tensors."""
    P, _ = check_sequence(inputs, sequences, WHO)
    rid = check_region_ids(region_ids, P, WHO)
    both = region_sums(span_gradients(
        model, inputs, sequences, spans,
        lambda g, e: torch.stack([(g * e).sum(-1), g.square().sum(-1)], -1), WHO), rid)
    return both[..., 0].float(), both[..., 1].sqrt().float()
