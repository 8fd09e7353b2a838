"""The generation side of :class:`~headscope.hf.Tracer`: ``generate`` and
``generate_with`` run ``model.generate`` with a streamer that cuts each row's answer into
spans and makes each span (pooled features from the tracer's query rows, head scores,
text) as it ends; then the final sequence's inputs for VAS.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Iterator, List, Sequence

import torch

from .stream import Span, SpanCutter, iterate_spans

_UNSUPPORTED_GENERATE = {"num_beams": 1, "num_return_sequences": 1, "assistant_model": None,
                         "prompt_lookup_num_tokens": None}


def sentence_end(tokenizer) -> Callable[[Sequence[int]], bool]:
    """The default splitter: a span ends after a token whose text ends with '.', '!' or
    '?', or holds a newline."""
    ends_text: Dict[int, bool] = {}  # per token id: decoding costs more than a step here

    def ends(ids: Sequence[int]) -> bool:
        last = ids[-1]
        if last not in ends_text:
            text = tokenizer.decode([last])
            ends_text[last] = "\n" in text or text.rstrip(" ").endswith((".", "!", "?"))
        return ends_text[last]
    return ends


class Generation:
    """The Tracer's generation methods (a mixin: the state they use is the Tracer's)."""


    def generate(self, **kwargs) -> Iterator[Span]:
        """Runs ``model.generate(**kwargs)`` and yields each row's spans as they end, in
        order. The model runs on the caller's thread and pauses at each span while the loop
        body runs (no second thread). ``tr.sequences`` holds generate's output once the
        iterator is exhausted; leaving the loop early stops generation."""
        self._check_generate(kwargs)
        return self._generate(kwargs)

    def generate_with(self, on_span: Callable[[Span], None], **kwargs) -> torch.Tensor:
        """Runs ``model.generate(**kwargs)`` and calls ``on_span`` with each span, in order,
        as it ends (between two decode steps: generation waits for it); returns generate's
        output (also ``tr.sequences``). An exception in ``on_span`` stops generation and
        propagates."""
        self._check_generate(kwargs)
        cutter, P, eos = self._start_generation(kwargs, on_span)
        sequences = self._run_generate(kwargs, cutter)
        self._end_generation(kwargs, sequences, P, eos)
        return sequences

    def _check_generate(self, kwargs) -> None:
        for name, allowed in _UNSUPPORTED_GENERATE.items():
            value = kwargs.get(name, getattr(self.model.generation_config, name, allowed))
            if value not in (allowed, None):
                raise NotImplementedError(f"headscope.hf.Tracer.generate: {name}={value!r} is "
                                          f"not supported (one sequence per prompt)")
        if not self._attached:
            raise RuntimeError("headscope.hf.Tracer.generate: the tracer is detached")
        if self.model.device.type == "mps":  # generate streams tokens a step late there
            raise NotImplementedError("headscope.hf.Tracer.generate: not supported on MPS")
        if self._generating is not None:
            raise RuntimeError("headscope.hf.Tracer.generate: a generation is already running")

    def _eos_ids(self, kwargs) -> List[int]:
        config = kwargs.get("generation_config") or self.model.generation_config
        # as generate: an eos_token_id argument, None included, overrides the config's
        eos = kwargs["eos_token_id"] if "eos_token_id" in kwargs else config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else
                                 eos if isinstance(eos, (list, tuple)) else [eos])]

    def _start_generation(self, kwargs, emit: Callable[[Span], None]) -> tuple:
        """The streamer that cuts spans and hands them to ``emit``, during which the model
        must not be called."""
        ids = kwargs.get("input_ids")
        if ids is None:
            raise ValueError("headscope.hf.Tracer.generate: pass the prompt's input_ids")
        B, P = ids.shape
        eos = self._eos_ids(kwargs)

        def paused_emit(span: Span) -> None:
            self._paused = True
            try:
                emit(span)
            finally:
                self._paused = False

        cutter = SpanCutter(self._make_span, paused_emit, B, self.splitter, eos,
                            inner=kwargs.pop("streamer", None))
        self.sequences, self._final = None, None
        self._head_device = self._find_head_device()
        return cutter, P, eos

    def _run_generate(self, kwargs, cutter) -> torch.Tensor:
        self._generating = threading.get_ident()
        self._mode = "generate"
        # What the model hook would note, from generate's inputs (its forwards may not get
        # them all: Qwen's get the vision output, not the grid); off for the generation, it
        # costs nothing per step.
        self._note_inputs(kwargs)
        self._model_hook.remove()
        try:
            with cutter.interrupts:
                return self.model.generate(**self.family.model_inputs(kwargs), streamer=cutter)
        finally:
            self._mode = "forward"
            self._rows = None
            self._decoding = False
            self._generating = None
            if self._attached:  # (a callback may have detached the tracer)
                self._model_hook = self._hook_model()

    def _end_generation(self, kwargs, sequences: torch.Tensor, P: int, eos: List[int]) -> None:
        self.sequences = sequences
        if self.vas:
            self._final = (self._final_inputs(kwargs, sequences, P, eos), P)

    def _generate(self, kwargs) -> Iterator[Span]:
        def run(emit: Callable[[Span], None]) -> tuple:
            cutter, P, eos = self._start_generation(kwargs, emit)
            return self._run_generate(kwargs, cutter), P, eos

        sequences, P, eos = yield from iterate_spans(run)
        self._end_generation(kwargs, sequences, P, eos)

    def _make_span(self, b: int, start: int, token_ids: List[int], finished: bool) -> Span:
        """Row b's open span, on the generating thread: its pooled features (K_b, F) (F the
        tracer's feature_width), the head's scores and its text."""
        if self._rows is None:
            features = torch.zeros(0, self.feature_width)
        else:
            features = self._rows.pool(b, len(token_ids), finished)
            features = features[:self.num_regions[b]]
        scores = None
        if self.head is not None and features.shape[0] > 0:
            scores = self.head(features.to(self._head_device)).float().cpu()
        text = self.tokenizer.decode(token_ids) if self.tokenizer is not None else None
        return Span(b, start, start + len(token_ids), torch.tensor(token_ids, dtype=torch.int64),
                    features.float().cpu(), scores, text)

    def _check_head(self, head) -> None:
        """A head must map a span's (K, F) features (F = L*H, 2*L*H for features="both")
        to (K,) scores: tried once here on zeros, so that a head that does not fit fails
        now, not inside generation."""
        if head is None:
            return
        F = "2*L*H" if self.features == "both" else "L*H"
        if not callable(head):
            raise TypeError(f"headscope.hf.Tracer: argument 'head' must be an AttributionHead "
                            f"or a callable (K, {F}) -> (K,), got {type(head).__name__}")
        LH = self.feature_width
        probe = torch.zeros(2, LH, device=self._find_head_device(head))
        try:
            with torch.no_grad():
                scores = head(probe)
        except Exception as e:
            raise ValueError(f"headscope.hf.Tracer: argument 'head' must map features (K, {F} = "
                             f"{LH}) to scores (K,); on (2, {LH}) zeros it raised "
                             f"{type(e).__name__}: {e}") from e
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (2,):
            raise ValueError(f"headscope.hf.Tracer: argument 'head' must map features (K, {F} = "
                             f"{LH}) to scores (K,); on (2, {LH}) zeros it returned "
                             + (f"shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor)
                                else type(scores).__name__))

    def _find_head_device(self, head=None):
        for t in getattr(head if head is not None else self.head, "parameters",
                         lambda: iter(()))():
            return t.device
        return self.model.device

    def _final_inputs(self, kwargs, sequences: torch.Tensor, P: int, eos: List[int]
                      ) -> Dict[str, torch.Tensor]:
        """The model inputs of the whole final sequence: the prompt's, with the answer's
        tokens up to each row's end-of-sequence token kept in the mask."""
        answer = sequences[:, P:]
        keep = torch.ones_like(answer, dtype=torch.bool)
        if eos and answer.shape[1] > 0:
            is_eos = torch.isin(answer, torch.tensor(eos, device=answer.device))
            after = (is_eos.to(torch.int64).cumsum(1) - is_eos.to(torch.int64)) > 0
            keep = ~after
        mask = kwargs.get("attention_mask")
        mask = torch.ones(sequences.shape[0], P, dtype=torch.int64, device=sequences.device) \
            if mask is None else mask
        final = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        final["input_ids"] = sequences
        final["attention_mask"] = torch.cat([mask, keep.to(mask.dtype)], 1)
        for name in ("mm_token_type_ids", "token_type_ids"):
            types = kwargs.get(name)
            if types is not None:
                final[name] = torch.nn.functional.pad(types, (0, answer.shape[1]),
                                                      value=self.family.answer_type(name))
        return final
