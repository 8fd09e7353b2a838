"""Prints the ratios of scripts/bench_compare.sh: for every timing column (``*_ms``, ``* ms``) of every
row of every benchmark table, this build's time over REV's, the median over rounds (a
ratio below 1: this build is faster)."""
import json
import re
import statistics
import sys
from pathlib import Path

TIMING = re.compile(r"[_ ]ms$")  # a column of milliseconds


def rows(result: dict):
    """(family, table title, the row's non-timing values, column, ms) of every timing of
    every table the run printed."""
    for family, tables in result["tables"].items():
        for table in tables:
            for row in table["rows"]:
                key = tuple((k, v) for k, v in row.items()
                            if not TIMING.search(k) and isinstance(v, (int, str)))
                for column, value in row.items():
                    if TIMING.search(column) and isinstance(value, (int, float)):
                        yield family, table["title"], key, column, float(value)


def main(folder: str, rounds: int, rev: str) -> None:
    times = {}
    for i in range(1, rounds + 1):
        for side in ("rev", "here"):
            result = json.loads((Path(folder) / f"{side}-{i}.json").read_text())
            for family, section, key, column, ms in rows(result):
                times.setdefault((family, section, key, column), {"rev": [], "here": []})[
                    side].append(ms)
    title = None
    for (family, section, key, column), t in times.items():
        if section != title:
            title = section
            print(f"\n{family}: {section}\n{'row':<40}{'column':<24}{rev + ' ms':>14}"
                  f"{'this ms':>12}{'this/rev':>10}")
        if len(t["rev"]) != rounds or len(t["here"]) != rounds:
            continue  # a row one side did not report
        ratio = statistics.median(h / r for h, r in zip(t["here"], t["rev"]) if r > 0)
        label = ", ".join(f"{k}={v}" for k, v in key)[:39]
        print(f"{label:<40}{column:<24}"
              f"{statistics.median(t['rev']):>14.3f}{statistics.median(t['here']):>12.3f}"
              f"{ratio:>10.2f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
