"""Timing helpers, public for anyone timing headscope against a baseline in one process
(``headscope.bench`` and ``headscope.shapes`` do): medians of repeated calls, interleaved
rounds with their ratios, and a streamer that times ``generate`` per token."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["TokenClock", "interleaved", "round_ratios", "sync", "timeit"]


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timeit(fn: Callable[[], object], device="cpu", *, warmup: int = 1, min_time: float = 0.3,
           max_repeat: int = 50) -> float:
    """Median seconds per call (at least 3 calls, until min_time has passed)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], object]], device="cpu", *, rounds: int = 7,
                calls: dict[str, int] | None = None, pause: float = 0.2) -> dict[str, list[float]]:
    """Seconds per call of each function, measured in rounds that take every function in
    turn (the median of calls[name] calls, default 1, per round), so that a shared machine's
    slow and fast spells, which last seconds, fall on all of them alike: ratios of one round
    compare like with like. `pause` seconds before each function let the worker threads of
    the one before go idle (OpenBLAS's spin for about 0.1 s after a call, taking the cores
    the next function's threads need); one untimed call after it warms caches and cores
    again."""
    calls = calls or {}
    for fn in fns.values():
        fn()
    sync(device)
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(pause)
            fn()
            sync(device)
            times = []
            for _ in range(calls.get(name, 1)):
                t0 = time.perf_counter()
                fn()
                sync(device)
                times.append(time.perf_counter() - t0)
            out[name].append(statistics.median(times))
    return out


def round_ratios(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median, lowest and highest ratio num / den over the rounds of interleaved()."""
    r = sorted(a / b for a, b in zip(num, den))
    return statistics.median(r), r[0], r[-1]


class TokenClock:
    """A streamer for ``generate(..., streamer=clock)`` that notes when each token is handed
    over (the prompt's first, then one call per decode step), to time a generation per
    token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def per_token(self) -> float:
        """The median interval between decode steps (after the prefill)."""
        gaps = [b - a for a, b in zip(self.times[1:], self.times[2:])]
        return statistics.median(gaps)

    def mean_per_token(self) -> float:
        """The decode's time over its steps: every step counted, the slow ones too."""
        return (self.times[-1] - self.times[1]) / (len(self.times) - 2)
