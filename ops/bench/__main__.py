"""Benchmarks: each op beside its baselines in one process; prints ratios and peak memory.

    python -m headscope.bench [--family mixer vas attribution hf cost] [--device cpu|cuda]
                              [--quick] [--big] [--json results.json]

Timings are for reading, never assertions. The JSON holds each family's results and the
tables printed (``scripts/perf_tables.py`` turns them into docs/performance.md).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import platform
from pathlib import Path

import torch

FAMILIES = ["mixer", "vas", "attribution", "hf", "cost"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m headscope.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=FAMILIES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for smoke runs")
    parser.add_argument("--big", action="store_true",
                        help="also the sizes that take minutes on a CPU (families that have "
                             "them: mixer's vision tower at 9k and 16k patches; cost's "
                             "Qwen2-VL-2B-shaped decoder, about an hour)")
    parser.add_argument("--json", type=Path, default=Path("bench_results.json"))
    args = parser.parse_args(argv)

    import headscope  # noqa: F401  (loads the ops)
    from ..io import atomic_path

    from ._util import PRINTED_TABLES

    results = {"torch": torch.__version__, "device": args.device, "machine": _cpu_name(),
               "threads": torch.get_num_threads(),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "quick": args.quick, "big": args.big, "families": {}, "tables": {}}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    for family in args.family:
        module = importlib.import_module(f"headscope.bench.{family}")
        PRINTED_TABLES.clear()
        big = {"big": True} if args.big and "big" in inspect.signature(module.run).parameters else {}
        results["families"][family] = module.run(torch.device(args.device), quick=args.quick, **big)
        results["tables"][family] = list(PRINTED_TABLES)
    with atomic_path(args.json) as tmp:  # an interrupted run leaves the previous file
        Path(tmp).write_text(json.dumps(results, indent=2))
    print(f"\nresults written to {args.json}")


def _cpu_name() -> str:
    """The processor's model name (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
