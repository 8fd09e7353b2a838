"""Peak-memory, table and reference-loading helpers shared by every benchmark family (the
timing helpers are the public :mod:`headscope.timing`)."""
from __future__ import annotations

import ctypes
import statistics
from typing import Callable

import torch

from ..timing import round_ratios

_libc = ctypes.CDLL("libc.so.6")


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} missing from /proc/self/status")


def peak_bytes(fn: Callable[[], object], device="cpu", warmup: bool = True) -> int:
    """Extra memory one call needs at its peak, beyond what exists before it (``warmup``:
    after an uncounted first call, which a call that takes minutes can do without).

    CUDA: the caching allocator's peak. CPU (torch and NumPy alike): the growth of the
    process's resident-set high-water mark, reset through /proc/self/clear_refs after
    malloc_trim has returned freed memory to the system (so that reused free lists do
    not hide what the call needs).
    """
    if warmup:  # lazy initialisation is not counted
        fn()
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
