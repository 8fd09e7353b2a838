"""Timing and peak-memory helpers shared by every benchmark family."""
from __future__ import annotations

import ctypes
import statistics
import time
from typing import Callable

import torch

_libc = ctypes.CDLL("libc.so.6")


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} missing from /proc/self/status")


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


def peak_bytes(fn: Callable[[], object], device="cpu") -> int:
    """Extra memory one call needs at its peak, beyond what exists before it.

    CUDA: the caching allocator's peak. CPU (torch and NumPy alike): the growth of the
    process's resident-set high-water mark, reset through /proc/self/clear_refs after
    malloc_trim has returned freed memory to the system (so that reused free lists do
    not hide what the call needs).
    """
    fn()  # warm up lazy initialisation so it is not counted
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    _libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _proc_status_bytes("VmRSS")
    fn()
    return max(0, _proc_status_bytes("VmHWM") - base)


def mib(n: int) -> float:
    return n / 2**20


#: Every table printed since the list was last cleared, as {"title", "columns", "rows"}:
#: ``python -m headscope.bench --json`` saves them per family for scripts/perf_tables.py.
PRINTED_TABLES: list[dict] = []


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    """Prints rows (dicts) as an aligned text table with the given columns, and records it
    in PRINTED_TABLES."""
    PRINTED_TABLES.append({"title": title, "columns": list(columns),
                           "rows": [{c: r[c] for c in columns if c in r} for r in rows]})
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    print(f"\n== {title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def load_seed(name: str):
    """Imports a reference implementation (``../shared/seeds/<name>.py``, see docs/vas.md
    and docs/mixer.md) or returns None when absent.

    Looked up in $HEADSCOPE_SEEDS, then beside the current directory and beside the
    source tree (a clone has ``../shared`` only on the team's machines)."""
    import importlib.util
    import os
    from pathlib import Path

    candidates = [Path(os.environ["HEADSCOPE_SEEDS"])] if "HEADSCOPE_SEEDS" in os.environ else []
    candidates += [Path.cwd().parent / "shared" / "seeds",
                   Path(__file__).resolve().parents[2].parent / "shared" / "seeds"]
    for folder in candidates:
        path = folder / f"{name}.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(f"seed_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    print(f"(reference implementation {name}.py not found: its baseline is skipped)")
    return None


def window_row(T: int, window: int, times: dict, mem: dict) -> dict:
    """A sliding-window benchmark's row: the op with the window, without it and the eager
    formulation with the materialised mask (``times``: lists of seconds from
    :func:`interleaved`, ``mem``: peak bytes, both keyed "window", "no window", "eager"):
    median times, ratios of rounds, peak memory."""
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"T": T, "window": window, "window ms": ms["window"],
            "no window ms": ms["no window"], "eager ms": ms["eager"],
            "no window / window": round_ratios(times["no window"], times["window"])[0],
            "eager / window": round_ratios(times["eager"], times["window"])[0],
            "window MiB": mib(mem["window"]), "no window MiB": mib(mem["no window"]),
            "eager MiB": mib(mem["eager"]),
            "eager / window memory": mem["eager"] / max(mem["window"], 1)}
