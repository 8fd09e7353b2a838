"""Benchmarks: each op beside its baselines in one process; prints ratios and peak memory.

    python -m headscope.bench [--family mixer vas attribution] [--device cpu|cuda]
                              [--quick] [--json results.json]

Timings are for reading, never assertions.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
from pathlib import Path

import torch

FAMILIES = ["mixer", "vas", "attribution", "hf"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m headscope.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=FAMILIES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for smoke runs")
    parser.add_argument("--json", type=Path, default=Path("bench_results.json"))
    args = parser.parse_args(argv)

    import headscope  # noqa: F401  (loads the ops)

    results = {"torch": torch.__version__, "device": args.device,
               "machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "families": {}}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    for family in args.family:
        module = importlib.import_module(f"headscope.bench.{family}")
        results["families"][family] = module.run(torch.device(args.device), quick=args.quick)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
