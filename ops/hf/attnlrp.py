"""AttnLRP (Achtibat et al., ICML 2024): layer-wise relevance propagation through a VLM's
text decoder, as a post-hoc baseline for region attribution.

The rules are gradient modifications, so that input x gradient of the modified backward
is the relevance (the "Gradient*Input" form of LRP): a rule changes how the gradient
passes one operation and leaves the forward as it is.

- linear layers: epsilon-LRP (the output gradient times ``z / (z + eps sign z)``; the
  bias keeps its share);
- RMSNorm and LayerNorm: the identity rule on the normaliser (it is held constant);
- elementwise activations (the gated MLP's, soft caps): the identity rule (the gradient
  times ``f(x) / x``);
- products of two factors (the gated MLP's, both attention matmuls): the uniform rule
  (each factor gets half the relevance: half the gradient);
- softmax: AttnLRP's rule ``R_in = x (R_out - s sum R_out)``, which is input x gradient of
  the softmax itself: the plain gradient. It does not conserve relevance; the share it
  loses is measured by :class:`Ledger`.

Attention runs as an eager computation of its own (grouped-query heads, the scale, a soft
cap) on the additive masks transformers builds for eager attention, so every mask pattern
the model builds applies. The rules are bound to a model's modules for the duration of a
``with`` block (:class:`AttnLRP`); nothing of the model is changed afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from .checks import check_region_ids, check_sequence
from .gradient import region_sums, span_gradients
from .keymask import KeyMask

WHO = "headscope.hf.attnlrp_scores"
EPSILON = 1e-6


def identity_rule(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``output`` (an elementwise function of ``input``) whose gradient reaches ``input``
    multiplied by ``output / input`` (0 where the input is 0): the identity rule."""
    ratio = torch.where(input == 0, 0, output / input).detach()
    return output.detach() + (input - input.detach()) * ratio


def uniform_rule(product: torch.Tensor) -> torch.Tensor:
    """``product`` (of two factors) with half its gradient: the uniform rule."""
    return product * 0.5 + product.detach() * 0.5


@dataclass
class Ledger:
    """Relevance not passed on to the inputs, summed over the backward passes while
    attached to an :class:`AttnLRP`: ``softmax`` lost by the softmax rule, ``bias``
    absorbed by linear layers' biases and the epsilon stabiliser."""
    softmax: float = 0.0
    bias: float = 0.0


class _LedgerSoftmax(torch.autograd.Function):
    """Softmax in float32 with the plain gradient, recording the relevance the rule loses:
    ``sum s g_s - sum x g_x`` (over the entries a row attends to)."""

    @staticmethod
    def forward(ctx, scores, ledger):
        probs = scores.float().softmax(-1)
        ctx.save_for_backward(scores, probs)
        ctx.ledger = ledger
        return probs

    @staticmethod
    def backward(ctx, grad):
        scores, probs = ctx.saved_tensors
        grad_in = probs * (grad - (probs * grad).sum(-1, keepdim=True))
        into = torch.where(probs > 0, scores.double() * grad_in.double(), 0).sum()
        ctx.ledger.softmax += float((probs.double() * grad.double()).sum() - into)
        return grad_in.to(scores.dtype), None


class _LedgerLinear(torch.autograd.Function):
    """A linear layer's output ``z`` with the epsilon rule's gradient, recording what the
    bias and the stabiliser keep: ``sum z g - sum (z - b) g'``."""

    @staticmethod
    def forward(ctx, z, bias, epsilon, ledger):
        ctx.save_for_backward(z, bias)
        ctx.epsilon, ctx.ledger = epsilon, ledger
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad):
        z, bias = ctx.saved_tensors
        rescaled = grad * _epsilon_factor(z, ctx.epsilon)
        kept = (z.double() * grad.double()).sum()
        passed = ((z if bias is None else z - bias).double() * rescaled.double()).sum()
        ctx.ledger.bias += float(kept - passed)
        return rescaled, None, None, None


def _epsilon_factor(z: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``z / (z + epsilon sign z)``, sign 0 counted as +."""
    return z / (z + epsilon * torch.where(z < 0, -1.0, 1.0).to(z.dtype))


def _norm_kind(module: torch.nn.Module) -> Optional[str]:
    """"layer" (mean-centred), "scale" (a per-row scale times a per-channel gain: RMSNorm,
    L2 norms) or None (not a norm)."""
    if isinstance(module, torch.nn.LayerNorm):
        return "layer"
    name = type(module).__name__
    if name.endswith("RMSNorm") or name.endswith("L2Norm"):
        return "scale"
    return None


class AttnLRP(KeyMask):
    """Binds AttnLRP's rules to ``model``'s text decoder (its config's attention calls, its
    linear layers, norms and MLPs) and output layer inside a ``with`` block; the model's
    outputs are unchanged, its gradients are the rules'. ``epsilon``: the epsilon rule's
    stabiliser (0: the plain gradient); ``ledger``: a :class:`Ledger` to record the
    relevance the backward passes do not conserve (slower; None: not recorded).

    Raises NotImplementedError for a decoder with parameters in modules it has no rule for
    (mixture-of-experts layers) or attention with sinks."""

    who = WHO

    def __init__(self, model, epsilon: float = EPSILON, ledger: Optional[Ledger] = None):
        from .families import family_of
        self.model = model
        self.decoder = family_of(model, self.who).decoder(model)
        super().__init__(self.decoder.config)
        self.epsilon, self.ledger = float(epsilon), ledger
        self._handles: List = []

    def __enter__(self) -> "AttnLRP":
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        modules = list(self.decoder.modules()) + [self.model.get_output_embeddings()]
        self._check(modules)
        super().__enter__()
        self.base_mask = ALL_MASK_ATTENTION_FUNCTIONS["eager"]  # additive float masks
        try:
            for module in modules:
                self._bind_module(module)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        super().__exit__(*exc)

    def _check(self, modules) -> None:
        for module in modules:
            if next(module.parameters(recurse=False), None) is None:
                continue
            if not (isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
                    or _norm_kind(module) is not None):
                raise NotImplementedError(f"{self.who}: no AttnLRP rule for the parameters of "
                                          f"{type(module).__name__} in the text decoder")

    def _bind_module(self, module: torch.nn.Module) -> None:
        hooks = self._handles
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(self._linear))
        kind = _norm_kind(module)
        if kind == "scale":
            hooks.append(module.register_forward_hook(
                lambda m, args, out: identity_rule(out, args[0])))
        elif kind == "layer":
            hooks.append(module.register_forward_hook(_layer_norm_rule))
        activation = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
        down = getattr(module, "down_proj", None)
        if isinstance(activation, torch.nn.Module) and isinstance(down, torch.nn.Linear):
            hooks.append(activation.register_forward_hook(
                lambda m, args, out: identity_rule(out, args[0])))
            if hasattr(module, "gate_proj") or hasattr(module, "gate_up_proj"):
                # down_proj's input is the product activation(gate) * up
                hooks.append(down.register_forward_pre_hook(
                    lambda m, args: (uniform_rule(args[0]),) + tuple(args[1:])))

    def _linear(self, module, args, z):
        if self.ledger is not None:
            return _LedgerLinear.apply(z, module.bias, self.epsilon, self.ledger)
        if self.epsilon == 0:
            return z
        factor = _epsilon_factor(z, self.epsilon).detach()
        return z.detach() + (z - z.detach()) * factor

    def final_cap(self, capped: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The output logits' soft cap, under the identity rule."""
        return identity_rule(capped, logits)

    def attention(self, module, query, key, value, attention_mask, dropout=0.0,
                  scaling=None, softcap=None, **kwargs):
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError(f"{self.who}: attention with sinks ('s_aux') has no "
                                      f"AttnLRP rule here")
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, 1)
        value = value.repeat_interleave(groups, 1)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores = uniform_rule(query @ key.transpose(2, 3)) * scaling
        if softcap is not None:
            scores = identity_rule(torch.tanh(scores / softcap) * softcap, scores)
        if attention_mask is not None:
            scores = scores + attention_mask[..., :key.shape[2]]
        if self.ledger is not None:
            probs = _LedgerSoftmax.apply(scores, self.ledger)
        else:
            probs = scores.float().softmax(-1)
        out = uniform_rule(probs.to(value.dtype) @ value)
        return out.transpose(1, 2).contiguous(), None


def _layer_norm_rule(module: torch.nn.LayerNorm, args, out):
    """LayerNorm with its standard deviation held constant (the mean stays a linear map)."""
    x = args[0]
    centred = x - x.mean(-1, keepdim=True)
    std = (centred.square().mean(-1, keepdim=True) + module.eps).sqrt().detach()
    y = centred / std
    if module.weight is not None:
        y = y * module.weight
    if module.bias is not None:
        y = y + module.bias
    return out.detach() + (y - y.detach())


def attnlrp_relevance(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                      spans: Sequence, *, target: str = "log_prob", epsilon: float = EPSILON,
                      ledger: Optional[Ledger] = None) -> torch.Tensor:
    """AttnLRP relevance of each span's target at every position of the text decoder's
    input (prompt and teacher-forced answer): ``(num_spans, P + N)`` float64. Arguments
    as for :func:`attnlrp_scores`."""
    return span_gradients(model, inputs, sequences, spans, lambda g, e: (g * e).sum(-1), WHO,
                          target=target, binding=AttnLRP(model, epsilon, ledger))


def attnlrp_scores(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                   spans: Sequence, region_ids: torch.Tensor, *, target: str = "log_prob",
                   epsilon: float = EPSILON, ledger: Optional[Ledger] = None
                   ) -> torch.Tensor:
    """AttnLRP relevance of each span's target at the text decoder's input embeddings,
    summed over each region's image tokens.

    Arguments as for :func:`~headscope.hf.region_effects`. ``target``: ``"log_prob"``
    (the sum of the span's tokens' log-probabilities under teacher forcing) or ``"logit"``
    (the sum of their logits; the relevance over all input positions then adds up to it
    but for what the softmax rule and the biases keep, which a :class:`Ledger` records).
    ``epsilon``: the epsilon rule's stabiliser on linear layers. One forward over the
    sequence and one backward per span. Returns a ``(num_spans, K)`` float32 tensor."""
    P, _ = check_sequence(inputs, sequences, WHO)
    rid = check_region_ids(region_ids, P, WHO)
    relevance = attnlrp_relevance(model, inputs, sequences, spans, target=target,
                                  epsilon=epsilon, ledger=ledger)
    return region_sums(relevance[:, :P], rid).float()
