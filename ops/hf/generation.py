"""The generation side of :class:`~headscope.hf.Tracer`, a component it holds:
:class:`Generation` runs ``model.generate`` with a streamer that cuts each row's answer
into spans and makes each span (pooled features from the tracer's query rows, head
scores, text) as it ends; then keeps the final sequence's inputs for the answer's VAS.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Sequence

import torch

from .families.base import TYPE_INPUTS
from .stream import Span, SpanCutter, iterate_spans, special_only

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


@dataclass
class Answer:
    """What a finished ``generate`` leaves for the answer's VAS: the model inputs of the
    final sequence (the prompt's, with each row's answer tokens up to and including its
    end-of-sequence token kept in the mask) and the prompt's length."""
    inputs: Dict[str, torch.Tensor]
    prompt_length: int
    pending: bool = True  # its forward has not run yet


class Generation:
    """A tracer's ``generate`` and ``generate_with``, and what the last generation left:
    :attr:`sequences` and its :class:`Answer`. It reads the tracer's public attributes
    (model, family, splitter, head, tokenizer, vas, feature_width, num_regions, rows);
    the tracer gives it ``run_model(kwargs, streamer)``, which runs ``model.generate`` in
    the tracer's generation phases, and ``paused()``, the phase while a span's consumer
    runs (the model must not be called then)."""

    def __init__(self, tracer, run_model: Callable[[dict, SpanCutter], torch.Tensor],
                 paused: Callable[[], ContextManager]):
        self.tracer = tracer
        self._run_model = run_model
        self._paused = paused
        self.thread: Optional[int] = None  # ident of the thread running generate
        self.sequences: Optional[torch.Tensor] = None
        self.answer: Optional[Answer] = None
        self._head_device = None

    def spans(self, kwargs) -> Iterator[Span]:
        """``Tracer.generate``: the spans, on the caller's thread."""
        self._check(kwargs)
        return self._spans(kwargs)

    def _spans(self, kwargs) -> Iterator[Span]:
        def run(emit: Callable[[Span], None]) -> tuple:
            cutter, P, eos = self._start(kwargs, emit)
            return self._run(kwargs, cutter), P, eos

        sequences, P, eos = yield from iterate_spans(run)
        self._end(kwargs, sequences, P, eos)

    def run_with(self, on_span: Callable[[Span], None], kwargs) -> torch.Tensor:
        """``Tracer.generate_with``: each span to ``on_span``; generate's output."""
        self._check(kwargs)
        cutter, P, eos = self._start(kwargs, on_span)
        sequences = self._run(kwargs, cutter)
        self._end(kwargs, sequences, P, eos)
        return sequences

    def _check(self, kwargs) -> None:
        model = self.tracer.model
        for name, allowed in _UNSUPPORTED_GENERATE.items():
            value = kwargs.get(name, getattr(model.generation_config, name, allowed))
            if value not in (allowed, None):
                raise NotImplementedError(f"headscope.hf.Tracer.generate: {name}={value!r} is "
                                          f"not supported (one sequence per prompt)")
        if not self.tracer.attached:
            raise RuntimeError("headscope.hf.Tracer.generate: the tracer is detached")
        if model.device.type == "mps":  # generate streams tokens a step late there
            raise NotImplementedError("headscope.hf.Tracer.generate: not supported on MPS")
        if self.thread is not None:
            raise RuntimeError("headscope.hf.Tracer.generate: a generation is already running")

    def _eos_ids(self, kwargs) -> List[int]:
        config = kwargs.get("generation_config") or self.tracer.model.generation_config
        # as generate: an eos_token_id argument, None included, overrides the config's
        eos = kwargs["eos_token_id"] if "eos_token_id" in kwargs else config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else
                                 eos if isinstance(eos, (list, tuple)) else [eos])]

    def _start(self, kwargs, emit: Callable[[Span], None]) -> tuple:
        """The streamer that cuts spans and hands them to ``emit``, during which the model
        must not be called."""
        ids = kwargs.get("input_ids")
        if ids is None:
            raise ValueError("headscope.hf.Tracer.generate: pass the prompt's input_ids")
        B, P = ids.shape
        eos = self._eos_ids(kwargs)
        # the tokenizer's special tokens; a duck tokenizer without them, or none: end-of-text
        self._special_ids = getattr(self.tracer.tokenizer, "all_special_ids", None) or eos

        def paused_emit(span: Span) -> None:
            with self._paused():
                emit(span)

        cutter = SpanCutter(self._make_span, paused_emit, B, self.tracer.splitter, eos,
                            inner=kwargs.pop("streamer", None))
        self.sequences, self.answer = None, None
        self._head_device = head_device(self.tracer.head, self.tracer.model)
        return cutter, P, eos

    def _run(self, kwargs, cutter: SpanCutter) -> torch.Tensor:
        self.thread = threading.get_ident()
        try:
            with cutter.interrupts:
                return self._run_model(kwargs, cutter)
        finally:
            self.thread = None

    def _end(self, kwargs, sequences: torch.Tensor, P: int, eos: List[int]) -> None:
        self.sequences = sequences
        if self.tracer.vas:
            self.answer = Answer(self._final_inputs(kwargs, sequences, P, eos), P)

    def _make_span(self, b: int, start: int, token_ids: List[int], finished: bool) -> Span:
        """Row b's open span, on the generating thread: its pooled features (K_b, F) (F the
        tracer's feature_width), the head's scores and its text."""
        tracer = self.tracer
        if tracer.rows is None:
            features = torch.zeros(0, tracer.feature_width)
        else:
            features = tracer.rows.pool(b, len(token_ids), finished)
            features = features[:tracer.num_regions[b]]
        scores = None
        if tracer.head is not None and features.shape[0] > 0:
            scores = tracer.head(features.to(self._head_device)).float().cpu()
        text = tracer.tokenizer.decode(token_ids) if tracer.tokenizer is not None else None
        return Span(b, start, start + len(token_ids), torch.tensor(token_ids, dtype=torch.int64),
                    features.float().cpu(), scores, text,
                    special_only(token_ids, self._special_ids))

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
        for name in TYPE_INPUTS:
            types = kwargs.get(name)
            if types is not None:
                final[name] = torch.nn.functional.pad(types, (0, answer.shape[1]),
                                                      value=self.tracer.family.answer_type(name))
        return final


def check_head(head, features: str, width: int, device) -> None:
    """A head must map a span's (K, F) features (F = ``width``: L*H, 2*L*H for
    features="both") to (K,) scores: tried once on zeros, so that a head that does not fit
    fails when the tracer is made, not inside generation."""
    if head is None:
        return
    F = "2*L*H" if features == "both" else "L*H"
    if not callable(head):
        raise TypeError(f"headscope.hf.Tracer: argument 'head' must be an AttributionHead "
                        f"or a callable (K, {F}) -> (K,), got {type(head).__name__}")
    probe = torch.zeros(2, width, device=device)
    try:
        with torch.no_grad():
            scores = head(probe)
    except Exception as e:
        raise ValueError(f"headscope.hf.Tracer: argument 'head' must map features (K, {F} = "
                         f"{width}) to scores (K,); on (2, {width}) zeros it raised "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (2,):
        raise ValueError(f"headscope.hf.Tracer: argument 'head' must map features (K, {F} = "
                         f"{width}) to scores (K,); on (2, {width}) zeros it returned "
                         + (f"shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor)
                            else type(scores).__name__))


def head_device(head, model):
    """Where a head's parameters are (the model's device for a head without any)."""
    for t in getattr(head, "parameters", lambda: iter(()))():
        return t.device
    return model.device
