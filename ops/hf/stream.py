"""Spans out of a running ``generate``: the generating thread cuts the answer into spans
and queues each span's pooled features; the caller's thread takes them in order, applies
the attribution head and hands out :class:`Span` objects.

The queue is bounded (a slow consumer holds generation back instead of growing memory),
never drops a span, carries the generating thread's exception to the caller, and either
side stopping (end of generation, an error, ``break``, KeyboardInterrupt) ends both.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence

import torch

_POLL_S = 0.05  # how often a blocked side looks whether the other has stopped


@dataclass
class Span:
    """A span of one row's generated tokens, with its region features and scores.

    ``start``/``end``: the range ``[start, end)`` of generated-token indices (0 is the
    first generated token). ``features`` ``(K, L*H)`` float32 on the CPU: the attention
    mass layer l, head h put on region k (index ``l*H + h``), averaged over the query rows
    that predicted the span's tokens. ``scores`` ``(K,)``: the head's predicted effect of
    ablating each region (None without a head). ``text``: the span decoded (None without a
    tokenizer).
    """
    batch_index: int
    start: int
    end: int
    token_ids: torch.Tensor
    features: torch.Tensor
    scores: Optional[torch.Tensor] = None
    text: Optional[str] = None


class Stopped(Exception):
    """Raised inside ``generate`` (from the streamer) when the consumer has gone."""


@dataclass
class _Pending:
    batch_index: int
    start: int
    token_ids: List[int]
    features: torch.Tensor  # (K, L*H) on the model's device


class SpanCutter:
    """The streamer ``generate`` calls once per step with the new tokens (B,): adds them
    to each row's open span and, at a boundary, asks the tracer for the span's pooled
    features."""

    def __init__(self, take_features: Callable[[int, int, bool], torch.Tensor],
                 spans: "SpanQueue", batch_size: int,
                 ends_span: Optional[Callable[[Sequence[int]], bool]], eos: Sequence[int],
                 inner=None):
        self.take_features = take_features
        self.spans = spans
        self.ends_span = ends_span
        self.eos = set(int(e) for e in eos)
        self.inner = inner
        self.prompt_seen = False
        self.generated: List[List[int]] = [[] for _ in range(batch_size)]
        self.span_start = [0] * batch_size
        self.done = [False] * batch_size

    def put(self, value: torch.Tensor) -> None:
        if self.spans.stop.is_set():  # the consumer left: end generate now
            raise Stopped()
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
                self._cut(b, finished=eos)
            self.done[b] = eos

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()
        for b in range(len(self.generated)):
            if not self.done[b] and len(self.generated[b]) > self.span_start[b]:
                self._cut(b, finished=True)
            self.done[b] = True

    def _cut(self, b: int, finished: bool) -> None:
        """Ends row b's open span; ``finished``: the row generates no more."""
        start, end = self.span_start[b], len(self.generated[b])
        self.span_start[b] = end
        self.spans.put(_Pending(b, start, self.generated[b][start:end],
                                self.take_features(b, end - start, finished)))


class SpanQueue:
    """Bounded hand-over from the generating thread to the caller."""

    _DONE = object()

    def __init__(self, maxsize: int):
        self.q: "queue.Queue" = queue.Queue(maxsize)
        self.stop = threading.Event()

    def put(self, item) -> None:
        """Blocks while the queue is full; raises :class:`Stopped` once the consumer left."""
        while True:
            if self.stop.is_set():
                raise Stopped()
            try:
                self.q.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def finish(self, error: Optional[BaseException]) -> None:
        """The generating thread's last word: its error, or done."""
        item = error if error is not None else self._DONE
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[_Pending]:
        while True:
            try:
                item = self.q.get(timeout=_POLL_S)
            except queue.Empty:
                if self.stop.is_set():  # the other side has gone without a last word
                    return
                continue
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def run_in_thread(target: Callable[[], None], spans: SpanQueue) -> threading.Thread:
    def main():
        error = None
        try:
            target()
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller to re-raise
            error = e
        spans.finish(error)

    thread = threading.Thread(target=main, name="headscope-generate", daemon=True)
    thread.start()
    return thread
