"""The ablation runner of :func:`~headscope.hf.region_effects`: the vision tower runs once
(one forward of the model stopped at its text decoder takes the decoder's inputs), the
decoder runs the prefix before the first ablated position once, and every batch of
ablations continues from a copy of that key cache expanded over the batch; only the
positions that predict the answer go through the output layer."""
from __future__ import annotations

import copy

import torch

from .decoder import decoder_inputs
from .families import family_of
from .keymask import KeyMask
from .structure import other_mixers

# per-position decoder inputs, the same under every ablation: ERNIE 4.5-VL's types, which
# route image tokens (markers included) to experts of their own; Gemma 4's inputs to every
# layer (the tokens' own part: the decoder adds the ablated embeddings' part itself)
_PER_POSITION_KEYS = {"moe_mm_token_type_ids", "per_layer_inputs"}
_DECODER_KEYS = {"inputs_embeds", "attention_mask", "position_ids", "visual_pos_masks",
                 "deepstack_visual_embeds"} | _PER_POSITION_KEYS
_IGNORED_KEYS = {"input_ids", "cache", "past_key_values", "use_cache", "return_dict",
                 "output_attentions", "output_hidden_states"}


class AblationRunner:
    """The text decoder's inputs for the whole sequence, the prefix's key cache, and
    batched forwards of ablations over the rest. ``keymask`` is bound to the decoder's
    config (the "mask" ablation sets its removed keys); ``rid`` the prompt's (P,) region
    ids; ``who`` names the caller in messages and the progress bar."""

    def __init__(self, model, keymask: KeyMask, inputs, sequences, rid, ablation, P, N,
                 who: str):
        self.model, self.ablation, self.P, self.N, self.who = model, ablation, P, N, who
        family = family_of(model, who)
        self.decoder = family.decoder(model)
        self.head = model.get_output_embeddings()
        self.final_softcap = family.final_softcap(model.config)
        got = decoder_inputs(model, inputs, sequences, who)
        unknown = sorted(k for k, v in got.items() if k not in _DECODER_KEYS | _IGNORED_KEYS
                         and v is not None and not isinstance(v, (bool, int, float, str)))
        if unknown:
            raise NotImplementedError(f"{who}: the text decoder of {type(model).__name__} "
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
        with tqdm(total=A, desc=self.who, unit="ablation", disable=not progress,
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
