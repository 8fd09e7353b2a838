"""Ground-truth region ablation effects: how much each generated span's log-likelihood
drops when an image region is ablated, teacher-forced on the generated sequence (the
targets the vStream head is fitted to).

The vision tower runs once: one forward of the model is stopped at its text decoder to
take the decoder's inputs (embeddings, positions, mask). The decoder then runs the prefix
before the first ablated position once, and every batch of ablations continues from a
copy of that key cache expanded over the batch; only the positions that predict the
answer go through the output layer.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from .families import family_of
from .keymask import KeyMask
from .structure import softmax_attention_layers

ABLATIONS = ("mask", "mean", "zero")
WHO = "headscope.hf.region_effects"
# per-position decoder inputs, the same under every ablation: ERNIE 4.5-VL's types, which
# route image tokens (markers included) to experts of their own; Gemma 4's inputs to every
# layer (the tokens' own part: the decoder adds the ablated embeddings' part itself)
_PER_POSITION_KEYS = {"moe_mm_token_type_ids", "per_layer_inputs"}
_DECODER_KEYS = {"inputs_embeds", "attention_mask", "position_ids", "visual_pos_masks",
                 "deepstack_visual_embeds"} | _PER_POSITION_KEYS
_IGNORED_KEYS = {"input_ids", "cache", "past_key_values", "use_cache", "return_dict",
                 "output_attentions", "output_hidden_states"}


def region_effects(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                   spans: Sequence, region_ids: torch.Tensor,
                   subsets: Optional[torch.Tensor] = None, ablation: str = "mask",
                   batch_size: int = 8, progress: bool = True
                   ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The effect of ablating each image region on each span of a generated answer.

    ``inputs``: one prompt's model inputs (batch 1, as the processor returns them);
    ``sequences`` ``(1, P + N)``: what ``generate`` returned for them; ``spans``: objects
    with ``start`` and ``end`` (such as :class:`~headscope.hf.Span`) or ``(start, end)``
    pairs of generated-token indices; ``region_ids`` ``(1, P)`` or ``(P,)`` int64, the
    region of each prompt position (-1: not an image token), K = max + 1.

    The effect of region k on span S is ``sum_{t in S} log p(y_t | x, y_<t) -
    log p(y_t | ablate(x, R_k), y_<t)`` (natural log). ``ablation``: ``"mask"`` removes
    the region's tokens from every query's attention in every decoder layer; ``"zero"``
    and ``"mean"`` replace their input embeddings with zeros or with the mean embedding of
    the prompt's image tokens (Qwen3-VL: its deepstack features likewise). Returns a
    ``(num_spans, K)`` float32 tensor; with ``subsets`` (an ``(M, K)`` bool tensor of
    region sets) a pair of it and the ``(num_spans, M)`` effects of ablating each set.
    ``batch_size`` ablations run per forward; ``progress`` shows a tqdm bar.
    """
    if ablation not in ABLATIONS:
        raise ValueError(f"{WHO}: argument 'ablation' must be one of {ABLATIONS}, got "
                         f"{ablation!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{WHO}: argument 'batch_size' must be an int >= 1, got {batch_size!r}")
    P, N = check_sequence(inputs, sequences)
    bounds = span_bounds(spans, N)
    rid = check_region_ids(region_ids, P)
    K = int(rid.max()) + 1
    if subsets is not None:
        if not isinstance(subsets, torch.Tensor) or subsets.dtype != torch.bool \
                or subsets.dim() != 2 or subsets.shape[1] != K:
            raise ValueError(f"{WHO}: argument 'subsets' must be a bool tensor (M, K = {K}), "
                             f"got {_describe(subsets)}")
    ablated = torch.eye(K, dtype=torch.bool)
    if subsets is not None:
        ablated = torch.cat([ablated, subsets.cpu()])
    # row 0 keeps every region: the reference runs in the same batches, the same way
    ablated = torch.cat([torch.zeros(1, K, dtype=torch.bool), ablated])
    in_region = rid.unsqueeze(0) == torch.arange(K).unsqueeze(1)  # (K, P)
    removed = (ablated.to(torch.int64) @ in_region.to(torch.int64)) > 0  # (A, P)

    decoder = family_of(model, WHO).decoder(model)
    if ablation == "mask":
        check_all_softmax(decoder)
    with torch.no_grad(), KeyMask(decoder.config) as keymask:
        runner = _Runner(model, keymask, inputs, sequences, rid, ablation, P, N)
        logp = runner.log_probs(removed, batch_size, progress)  # (A, N) float64
    drop = logp[:1] - logp[1:]
    cum = torch.nn.functional.pad(drop.cumsum(1), (1, 0))
    per_span = (cum[:, bounds[:, 1]] - cum[:, bounds[:, 0]]).T.to(torch.float32)  # (S, A-1)
    effects = per_span[:, :K].contiguous()
    if subsets is None:
        return effects
    return effects, per_span[:, K:].contiguous()


def other_mixers(decoder) -> list:
    """The decoder layers that mix tokens otherwise than by softmax attention (a hybrid
    decoder's gated delta nets, short convolutions, linear attention)."""
    traced = {m.layer_idx for m in softmax_attention_layers(decoder)}
    return sorted(set(range(int(decoder.config.num_hidden_layers))) - traced)


def check_all_softmax(decoder) -> None:
    """Raises for a hybrid decoder: the "mask" ablation takes the region's keys out of
    softmax attention, and its other mixers would still carry the region on."""
    others = other_mixers(decoder)
    if others:
        raise NotImplementedError(
            f"{WHO}: ablation='mask' removes a region's keys from softmax attention, but "
            f"decoder layers {others} of {type(decoder).__name__} mix tokens otherwise "
            f"(a gated delta net, a short convolution or linear attention) and would still "
            f"carry the region on; use ablation='zero' or 'mean'")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def check_sequence(inputs, sequences, who: str = WHO) -> Tuple[int, int]:
    """(P, N): the prompt's and the answer's lengths, after checking ``sequences``
    continues the one prompt of ``inputs``."""
    if not isinstance(inputs, Mapping):  # a dict, or a processor's BatchFeature
        raise ValueError(f"{who}: argument 'inputs' must be a mapping of model inputs (what a "
                         f"processor returns), got {type(inputs).__name__}")
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"{who}: argument 'inputs' must hold the input_ids of one prompt "
                         f"(1, P), got {_describe(ids)}")
    P = ids.shape[1]
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 \
            or sequences.shape[0] != 1 or sequences.shape[1] <= P:
        raise ValueError(f"{who}: argument 'sequences' must be generate's output (1, P + N) "
                         f"with P = {P} and N >= 1, got {_describe(sequences)}")
    if not torch.equal(sequences[0, :P].to(ids.device), ids[0]):
        raise ValueError(f"{who}: argument 'sequences' must start with the prompt's input_ids")
    return P, sequences.shape[1] - P


def span_bounds(spans, N: int, who: str = WHO) -> torch.Tensor:
    """(S, 2) int64 [start, end) of each span (objects with start and end, or pairs),
    checked against the answer's N tokens."""
    bounds = []
    for i, span in enumerate(spans):
        if hasattr(span, "start") and hasattr(span, "end"):
            start, end = span.start, span.end
        else:
            try:
                start, end = span
            except (TypeError, ValueError):
                raise ValueError(f"{who}: argument 'spans'[{i}] must have start and end or be "
                                 f"a (start, end) pair, got {span!r:.80}") from None
        if not (0 <= int(start) < int(end) <= N):
            raise ValueError(f"{who}: argument 'spans'[{i}] = [{start}, {end}) must satisfy "
                             f"0 <= start < end <= {N} (the answer's tokens)")
        bounds.append((int(start), int(end)))
    if not bounds:
        raise ValueError(f"{who}: argument 'spans' is empty")
    return torch.tensor(bounds, dtype=torch.int64)


def check_region_ids(region_ids, P: int, who: str = WHO) -> torch.Tensor:
    """The prompt's (P,) region ids on the CPU, checked: -1 off the image, at least one
    region."""
    if not isinstance(region_ids, torch.Tensor) or region_ids.dtype != torch.int64 \
            or region_ids.numel() != P or region_ids.dim() not in (1, 2) \
            or (region_ids.dim() == 2 and region_ids.shape[0] != 1):
        raise ValueError(f"{who}: argument 'region_ids' must be an int64 tensor (1, {P}) or "
                         f"({P},), got {_describe(region_ids)}")
    rid = region_ids.reshape(-1).cpu()
    if int(rid.min()) < -1 or int(rid.max()) < 0:
        raise ValueError(f"{who}: argument 'region_ids' must hold -1 (not an image token) or "
                         f"regions >= 0, and at least one region")
    return rid


class _Captured(Exception):
    """Stops the model's forward at its text decoder, once the inputs are taken."""


def decoder_inputs(model, inputs: Dict[str, torch.Tensor], sequences: torch.Tensor,
                   who: str = WHO) -> dict:
    """The keyword arguments the model's text decoder gets on one forward over
    ``sequences`` (one prompt's ``inputs`` continued by its generated answer): its
    ``inputs_embeds`` (the image tokens' embeddings as the vision tower hands them over),
    ``position_ids``, ``attention_mask`` and whatever else the model passes. The model's
    forward stops at the decoder."""
    P, N = check_sequence(inputs, sequences, who)
    family_of(model, who).check_answer(model.config, sequences[:, P:], who)
    full = {}
    for name, value in family_of(model, who).model_inputs(inputs).items():
        if name == "input_ids":
            value = sequences
        elif isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == 1 \
                and value.shape[1] == P and not value.is_floating_point():
            # per-position inputs (mask, token types) continue over the answer
            value = torch.nn.functional.pad(value, (0, N), value=1 if name == "attention_mask"
                                            else family_of(model, who).answer_type(name))
        full[name] = value
    mask = full.get("attention_mask")
    if mask is not None:
        # Holes in the mask hide keys but do not move positions (Qwen-VL's rope index
        # takes only padding at the ends): positions come from the mask without them.
        kept = mask[0].nonzero()
        if len(kept):
            full["attention_mask"] = mask.clone()
            full["attention_mask"][0, int(kept[0]):int(kept[-1]) + 1] = 1
    got = decoder_kwargs(model, full, who)
    if mask is not None and got.get("attention_mask") is not None:
        # the 2-D mask (a VLM may hand its decoder masks built by layer type instead)
        got["attention_mask"] = mask.to(got["inputs_embeds"].device)
    if got.get("inputs_embeds") is None:
        raise NotImplementedError(f"{who}: {type(model).__name__} does not hand its "
                                  f"text decoder inputs_embeds")
    return got


def decoder_kwargs(model, inputs: Dict[str, torch.Tensor], who: str = WHO) -> dict:
    """The keyword arguments the model's text decoder gets on a forward over ``inputs``
    (no cache); the model's forward stops at the decoder."""
    got = {}

    def grab(module, args, kwargs):
        got.update(kwargs)
        raise _Captured()

    decoder = family_of(model, who).decoder(model)
    handle = decoder.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(**inputs, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    return got


class _Runner:
    """The text decoder's inputs for the whole sequence, the prefix's key cache, and
    batched forwards of ablations over the rest."""

    def __init__(self, model, keymask: KeyMask, inputs, sequences, rid, ablation, P, N):
        self.model, self.ablation, self.P, self.N = model, ablation, P, N
        self.decoder = family_of(model, WHO).decoder(model)
        self.head = model.get_output_embeddings()
        self.final_softcap = family_of(model, WHO).final_softcap(model.config)
        got = decoder_inputs(model, inputs, sequences)
        unknown = sorted(k for k, v in got.items() if k not in _DECODER_KEYS | _IGNORED_KEYS
                         and v is not None and not isinstance(v, (bool, int, float, str)))
        if unknown:
            raise NotImplementedError(f"{WHO}: the text decoder of {type(model).__name__} "
                                      f"takes inputs it does not know how to batch: {unknown}")
        self.embeds = got["inputs_embeds"]  # (1, T, C)
        T = self.embeds.shape[1]
        device = self.embeds.device
        self.mask = got.get("attention_mask")
        self.positions = got.get("position_ids")
        if self.positions is None:
            self.positions = torch.arange(T, device=device).unsqueeze(0)
        self.visual = got.get("visual_pos_masks")
        self.per_position = {k: got[k] for k in _PER_POSITION_KEYS if got.get(k) is not None}
        self.deepstack = got.get("deepstack_visual_embeds")
        self.targets = sequences[0, P:].to(device)
        is_image = (rid >= 0).to(device)
        self.mean = self.embeds[0, :P][is_image].mean(0)
        # The prefix before anything an ablation changes is shared; the row of position
        # P - 1 predicts the first answer token, so it is always recomputed.
        first = int(is_image.to(torch.int8).argmax())
        if self.visual is not None and bool(self.visual.any()):
            first = min(first, int(self.visual[0].to(torch.int8).argmax()))
        self.start = min(first, P - 1)
        block = keymask.first_block_position()
        if block is not None:  # a block's queries see its later keys: not a shared prefix
            self.start = min(self.start, block)
        if other_mixers(self.decoder):  # a recurrent state is not copied over a batch
            self.start = 0
        if self.deepstack is not None:
            self.deepstack_means = [e.mean(0) for e in self.deepstack]
        self.keymask = keymask
        self.prefix = self._prefix_cache() if self.start > 0 else None

    def _decode(self, embeds: torch.Tensor, start: int, cache, deepstack=None
                ) -> torch.Tensor:
        """Decoder hidden states of positions [start, T) for the rows of ``embeds``."""
        rows = embeds.shape[0]
        positions = self.positions[..., start:]
        kwargs = dict(inputs_embeds=embeds,
                      position_ids=positions.expand(*positions.shape[:-2], rows, -1),
                      use_cache=cache is not None, cache=cache)
        if self.mask is not None:
            kwargs["attention_mask"] = self.mask.expand(rows, -1)
        kwargs.update({k: v[:, start:].expand(rows, *[-1] * (v.dim() - 1))
                       for k, v in self.per_position.items()})
        if deepstack is not None:
            kwargs["visual_pos_masks"] = self.visual[:, start:].expand(rows, -1)
            kwargs["deepstack_visual_embeds"] = deepstack
        return self.decoder(**kwargs).last_hidden_state

    def _prefix_cache(self):
        """The key cache of the positions before ``self.start`` (they hold no image token)."""
        from transformers import DynamicCache
        cache = DynamicCache(config=self.model.config)
        end = self.start
        kwargs = dict(inputs_embeds=self.embeds[:, :end], position_ids=self.positions[..., :end],
                      use_cache=True, cache=cache)
        if self.mask is not None:
            kwargs["attention_mask"] = self.mask[:, :end]
        kwargs.update({k: v[:, :end] for k, v in self.per_position.items()})
        self.decoder(**kwargs)
        return cache

    def log_probs(self, removed: torch.Tensor, batch_size: int, progress: bool) -> torch.Tensor:
        """``removed`` ``(A, P)`` bool -> ``(A, N)`` float64 log-probabilities of the answer
        tokens under each ablation."""
        from tqdm.auto import tqdm
        A = removed.shape[0]
        T = self.embeds.shape[1]
        device = self.embeds.device
        removed = torch.nn.functional.pad(removed, (0, T - self.P)).to(device)
        out = torch.empty(A, self.N, dtype=torch.float64)
        first = self.P - 1 - self.start
        with tqdm(total=A, desc=WHO, unit="ablation", disable=not progress,
                     leave=False) as bar:
            for lo in range(0, A, batch_size):
                rows = removed[lo:lo + batch_size]
                hidden = self._forward(rows)[:, first:first + self.N]
                for i in range(rows.shape[0]):
                    logits = self.head(hidden[i])
                    if self.final_softcap is not None:  # as the model's forward caps them
                        logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
                    logits = logits.float()
                    picked = logits.gather(1, self.targets.unsqueeze(1)).squeeze(1)
                    out[lo + i] = (picked - logits.logsumexp(-1)).double().cpu()
                bar.update(rows.shape[0])
        return out

    def _forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Hidden states of positions [start, T) under the ablations ``rows`` (B, T)."""
        B, s = rows.shape[0], self.start
        cache = None
        if self.prefix is not None:
            cache = copy.deepcopy(self.prefix)
            cache.batch_repeat_interleave(B)
        embeds = self.embeds[:, s:].expand(B, -1, -1)
        deepstack = None if self.deepstack is None else [e.repeat(B, 1) for e in self.deepstack]
        if self.ablation == "mask":
            self.keymask.removed = rows
            try:
                return self._decode(embeds, s, cache, deepstack)
            finally:
                self.keymask.removed = None
        embeds = embeds.clone()
        embeds[rows[:, s:]] = 0 if self.ablation == "zero" else self.mean
        if deepstack is not None:
            # Qwen3-VL adds these at the visual positions in later layers: ablated alike
            hit = rows[:, self.visual[0]].flatten()  # rows follow the visual positions
            for e, mean in zip(deepstack, self.deepstack_means):
                e[hit] = 0 if self.ablation == "zero" else mean
        return self._decode(embeds, s, cache, deepstack)
