"""One ``generate`` under a :class:`~headscope.hf.Tracer` and what it leaves
(:class:`Generation`): the per-generation state. It runs ``model.generate`` as the
streamer of its tokens, keeps the query rows of its spans (a
:class:`~headscope.hf.rows.SpanRows` over its own table of the prompt's region ids), cuts
each row's answer into spans and makes each span (pooled features, head scores, text) as
it ends, then keeps the final sequence and its model inputs for the answer's VAS.

The tracer drives it from its hooks, calling down only: :meth:`Generation.begin_prompt`
as generate's first forward starts, :meth:`Generation.begin_step` before each decode step,
and the rows' ``start`` and ``add`` from each layer's attention call, as
:attr:`Generation.phase` says.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..features import feature_blocks
from .answer import continue_inputs, end_tokens
from .phase import Phase
from .rows import KeyTable, SpanRows
from .stream import Cut, Span, SpanCutter, special_only

_UNSUPPORTED_GENERATE = {"num_beams": 1, "num_return_sequences": 1, "assistant_model": None,
                         "prompt_lookup_num_tokens": None}


@dataclass
class Answer:
    """What a finished ``generate`` leaves for the answer's VAS: the model inputs of the
    final sequence (the prompt's, with each row's answer tokens up to and including its
    end-of-sequence token kept in the mask) and the prompt's length."""
    inputs: Dict[str, torch.Tensor]
    prompt_length: int
    pending: bool = True  # its forward has not run yet


def check_generate_kwargs(model, kwargs) -> None:
    """Refuses what makes more than one sequence per prompt."""
    for name, allowed in _UNSUPPORTED_GENERATE.items():
        value = kwargs.get(name, getattr(model.generation_config, name, allowed))
        if value not in (allowed, None):
            raise NotImplementedError(f"headscope.hf.Tracer.generate: {name}={value!r} is "
                                      f"not supported (one sequence per prompt)")


class Generation:
    """One ``model.generate(**kwargs)`` of a tracer's model, its spans handed to a consumer
    as they end, and what it leaves: :attr:`sequences` and, with ``keep_answer``, its
    :class:`Answer`. ``family``: the model's family; ``splitter``, ``head``,
    ``tokenizer``: the tracer's; ``features``, ``num_layers``, ``num_heads``: what a
    span's features hold. :attr:`phase` says what the attention calls of the forward
    running now give it."""

    def __init__(self, model, family, kwargs: dict, *, splitter, head, tokenizer,
                 features: str, num_layers: int, num_heads: int, keep_answer: bool):
        self.model, self.family, self.kwargs = model, family, kwargs
        self.splitter, self.head, self.tokenizer = splitter, head, tokenizer
        self.features, self.num_layers, self.num_heads = features, num_layers, num_heads
        self.feature_width = feature_blocks(features) * num_layers * num_heads
        self.keep_answer = keep_answer
        self.phase = Phase.GENERATING
        self.thread: Optional[int] = None  # ident of the thread running generate
        self.rows: Optional[SpanRows] = None  # the query rows of the spans, while it runs
        self.num_regions: Optional[List[int]] = None  # per row, of its prompt
        self.sequences: Optional[torch.Tensor] = None
        self.answer: Optional[Answer] = None
        self._cutter: Optional[SpanCutter] = None
        self._consumer: Optional[Callable[[Span], None]] = None
        self._special_ids: Sequence[int] = ()
        self._head_device = None

    def run(self, consumer: Callable[[Span], None]) -> torch.Tensor:
        """Runs ``model.generate`` on this thread, handing each span to ``consumer`` as it
        ends (generation waits meanwhile: :attr:`phase` is PAUSED); returns generate's
        output, also kept as :attr:`sequences`."""
        kwargs = self.kwargs
        ids = kwargs.get("input_ids")
        if ids is None:
            raise ValueError("headscope.hf.Tracer.generate: pass the prompt's input_ids")
        B, P = ids.shape
        eos = end_tokens(self.model, generate_kwargs=kwargs)
        # the tokenizer's special tokens; a duck tokenizer without them, or none: end-of-text
        self._special_ids = getattr(self.tokenizer, "all_special_ids", None) or eos
        self._cutter = SpanCutter(B, self.splitter, eos, inner=kwargs.pop("streamer", None))
        self._consumer = consumer
        self._head_device = head_device(self.head, self.model)
        self.thread = threading.get_ident()
        try:
            with self._cutter.interrupts:
                sequences = self.model.generate(**self.family.model_inputs(kwargs),
                                                streamer=self)
        finally:
            self.rows = None
        self.sequences = sequences
        if self.keep_answer:
            self.answer = Answer(self._final_inputs(sequences, P, eos), P)
        return sequences

    # ---- the tracer's hooks, as each forward starts ------------------------------------

    def begin_prompt(self, region_ids: Optional[torch.Tensor],
                     num_regions: Optional[List[int]]) -> None:
        """generate's first forward (no key cache) starts; ``region_ids`` ``(B, P)`` the
        prompt's (None: no regions), ``num_regions`` each row's count: the rows keep their
        query rows from here on where any row has a region."""
        self.rows = None
        if region_ids is not None and max(num_regions) > 0:
            self.num_regions = num_regions
            self.rows = SpanRows(self.num_layers, self.num_heads, KeyTable(region_ids, -1),
                                 max(num_regions), self.features)
        self.phase = Phase.PREFILL if self.rows is not None else Phase.GENERATING

    def begin_step(self) -> None:
        """A decode step starts (a forward on the key cache)."""
        if self.rows is not None:
            self.rows.begin_step()
            self.phase = Phase.DECODE

    # ---- the streamer generate calls -----------------------------------------------------

    def put(self, value: torch.Tensor) -> None:
        for cut in self._cutter.put(value):
            self._hand_over(cut)

    def end(self) -> None:
        for cut in self._cutter.end():
            self._hand_over(cut)

    def _hand_over(self, cut: Cut) -> None:
        """Makes the span and hands it to the consumer, paused meanwhile (the model must
        not be called)."""
        span = self._make_span(cut)
        phase, self.phase = self.phase, Phase.PAUSED
        try:
            self._consumer(span)
        finally:
            self.phase = phase

    def _make_span(self, cut: Cut) -> Span:
        """Row b's span that ends, on the generating thread: its pooled features (K_b, F) (F
        the :attr:`feature_width`), the head's scores and its text."""
        b, start, token_ids, finished = cut
        if self.rows is None:
            features = torch.zeros(0, self.feature_width)
        else:
            features = self.rows.pool(b, len(token_ids), finished)
            features = features[:self.num_regions[b]]
        scores = None
        if self.head is not None and features.shape[0] > 0:
            scores = self.head(features.to(self._head_device)).float().cpu()
        text = self.tokenizer.decode(token_ids) if self.tokenizer is not None else None
        return Span(b, start, start + len(token_ids), torch.tensor(token_ids, dtype=torch.int64),
                    features.float().cpu(), scores, text,
                    special_only(token_ids, self._special_ids))

    def _final_inputs(self, sequences: torch.Tensor, P: int, eos: List[int]
                      ) -> Dict[str, torch.Tensor]:
        """The model inputs of the whole final sequence: the prompt's, with the answer's
        tokens up to each row's end-of-sequence token kept in the mask."""
        answer = sequences[:, P:]
        keep = torch.ones_like(answer, dtype=torch.bool)
        if eos and answer.shape[1] > 0:
            is_eos = torch.isin(answer, torch.tensor(eos, device=answer.device))
            after = (is_eos.to(torch.int64).cumsum(1) - is_eos.to(torch.int64)) > 0
            keep = ~after
        prompt = {k: v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)}
        return continue_inputs(self.family, prompt, answer, keep)


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
