"""Spans out of a running ``generate``: :class:`SpanCutter` cuts each row's answer into
spans as the tokens come (the generation makes each span, pooled features, head scores and
text, and hands it on, all on the thread that runs the model).

:func:`iterate_spans` turns such a run into an iterator without a second thread: the run
goes in a greenlet on the caller's thread and pauses at each span until the loop asks for
the next one, so the model and the loop take turns. A second thread would compete with
generation for the GIL at every span (a hand-off costs more than a span's own work on a
small model) and, on the CPU, for the intra-op threads.
"""
from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import (Callable, Dict, Generator, Iterator, List, NamedTuple, Optional, Sequence,
                    TypeVar)

import torch

T = TypeVar("T")


@dataclass
class Span:
    """A span of one row's generated tokens, with its region features and scores.

    ``start``/``end``: the range ``[start, end)`` of generated-token indices (0 is the
    first generated token). ``features`` ``(K, L*H)`` float32 on the CPU: the attention
    mass layer l, head h put on region k (index ``l*H + h``), averaged over the query rows
    that predicted the span's tokens; with the tracer's ``features="attention*value_norm"``
    each key's weight times its value norm instead, with ``"both"`` ``(K, 2*L*H)``, the
    attention columns then the weighted ones. ``scores`` ``(K,)``: the head's predicted effect of
    ablating each region (None without a head). ``text``: the span decoded (None without a
    tokenizer). ``special``: every token is a special one (the tokenizer's
    ``all_special_ids``, or the generation's end-of-sequence ids without a tokenizer), such
    as the end-of-text span, which names nothing of the image.
    """
    batch_index: int
    start: int
    end: int
    token_ids: torch.Tensor
    features: torch.Tensor
    scores: Optional[torch.Tensor] = None
    text: Optional[str] = None
    special: bool = False


def special_only(token_ids: Sequence[int], special_ids: Sequence[int]) -> bool:
    """Whether every token of a span is a special token, such as the end-of-text span:
    such a span names nothing of the image, so fitting and scoring the head leave it out."""
    special = set(int(t) for t in special_ids)
    return all(int(t) in special for t in token_ids)


class InterruptLatch:
    """Ctrl-C stops a generation whatever the timing. While entered on the main thread
    (with Python's default SIGINT handler in place), SIGINT raises KeyboardInterrupt as
    usual and also sets :attr:`pending`; :meth:`check`, called once per step, raises it
    again when the first one was swallowed, and leaving the latch without an exception
    raises it too. A KeyboardInterrupt raised inside a finaliser, a GC callback, or C code
    that clears errors is lost to the code that runs: without the latch, a generation that
    should have stopped would run on."""

    def __init__(self):
        self.pending = False
        self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        self.pending = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.pending:
            raise KeyboardInterrupt

    def __enter__(self) -> "InterruptLatch":
        self.pending = False
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if exc_type is None:
            self.check()


class Cut(NamedTuple):
    """A span that ends: row ``batch_index``'s generated tokens ``[start, start +
    len(token_ids))``; ``finished``: the row generates no more."""
    batch_index: int
    start: int
    token_ids: List[int]
    finished: bool


class SpanCutter:
    """Cuts each row's answer into spans as ``generate`` hands over its tokens:
    :meth:`put` takes one step's new tokens (B,) and yields each span they end,
    :meth:`end` the spans still open when generation ends. Each step first checks
    ``interrupts``, so an interrupt that was swallowed still stops the generation at the
    next step; ``inner``, a streamer of the caller's, gets every call too."""

    def __init__(self, batch_size: int, ends_span: Optional[Callable[[Sequence[int]], bool]],
                 eos: Sequence[int], inner=None):
        self.interrupts = InterruptLatch()  # entered around generate by its caller
        self.ends_span = ends_span
        self.eos = set(int(e) for e in eos)
        self.inner = inner
        self.prompt_seen = False
        self.generated: List[List[int]] = [[] for _ in range(batch_size)]
        self.span_start = [0] * batch_size
        self.done = [False] * batch_size

    def put(self, value: torch.Tensor) -> Iterator[Cut]:
        self.interrupts.check()
        if self.inner is not None:
            self.inner.put(value)
        if not self.prompt_seen:  # generate's first call hands over the prompt
            self.prompt_seen = True
            return
        for b, token in enumerate(value.reshape(-1).tolist()):
            if self.done[b]:
                continue
            ids = self.generated[b]
            ids.append(token)
            eos = token in self.eos
            if eos or (self.ends_span is not None and self.ends_span(ids)):
                yield self._cut(b, finished=eos)
            self.done[b] = eos

    def end(self) -> Iterator[Cut]:
        if self.inner is not None:
            self.inner.end()
        for b in range(len(self.generated)):
            if not self.done[b] and len(self.generated[b]) > self.span_start[b]:
                yield self._cut(b, finished=True)
            self.done[b] = True

    def _cut(self, b: int, finished: bool) -> Cut:
        """Ends row b's open span."""
        start, end = self.span_start[b], len(self.generated[b])
        self.span_start[b] = end
        return Cut(b, start, self.generated[b][start:end], finished)


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


def iterate_spans(run: Callable[[Callable[[Span], None]], T]) -> Generator[Span, None, T]:
    """Yields the spans ``run(emit)`` hands to ``emit``, in order, and returns ``run``'s
    result. ``run`` runs in a greenlet on this thread, paused in ``emit`` until the loop
    asks for the next span. Leaving the loop early (``break``, an exception,
    KeyboardInterrupt, ``close()``) raises GreenletExit in the paused ``emit``, which ends
    ``run``; an exception in ``run`` is raised in the loop. Each side keeps its own grad
    mode (torch keeps it per thread, and the greenlet shares the thread)."""
    import greenlet

    def emit(span: Span) -> None:
        grad = torch.is_grad_enabled()
        try:
            greenlet.getcurrent().parent.switch(span)  # to the loop that asked for it
        finally:
            torch.set_grad_enabled(grad)

    worker = greenlet.greenlet(lambda: run(emit))
    try:
        while True:
            grad = torch.is_grad_enabled()
            worker.parent = greenlet.getcurrent()  # the loop may run in another greenlet
            try:
                item = worker.switch()
            finally:
                torch.set_grad_enabled(grad)
            if worker.dead:
                return item
            yield item
    finally:
        if not worker.dead:
            worker.throw()  # GreenletExit in the paused emit: generate unwinds
