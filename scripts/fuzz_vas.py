"""Randomised differential check of the vas ops against a float64 evaluation.

    python scripts/fuzz_vas.py --seconds 120            # random cases for two minutes
    python scripts/fuzz_vas.py --case 636399564 -v      # replay one case, print its numbers

Each case draws shapes (T 1..300, Dh 1..128, B, H, grouped-query heads), dtypes, strides,
thread counts, windows (lengths, offsets, key padding masks), attention patterns (random
softmax of varied sharpness, attention sinks, sliding windows, rows not summing to 1, zero
head-write rows; for the qk op sliding windows, chunks, bidirectional blocks and soft caps,
judged against the materialised pattern) and runs vas_head_stats or vas_head_stats_qk. d and c are judged against a
float64 evaluation of the same (upcast) inputs, r against the project's float32 reference
(the op forms S in float32 as the reference implementation does, and log q near S = 0
follows those roundings).
A case fails when the op misses the 1e-4 relative / 1e-6 absolute tolerance *and* is more
than 3 times as far from float64 as the float32 reference (the arithmetic of the VAS
reference implementation, docs/vas.md) is: ill-conditioned heads, where no float32 method
keeps the digits, do not count against the op. Heads whose values are nearly parallel
(--near-parallel) are such a case for the reference and the op alike.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import headscope  # noqa: E402,F401  (loads the ops)
from vas_fuzz_cases import judge, run_case  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case", type=int, help="replay one case")
    ap.add_argument("--near-parallel", type=float, default=0.0,
                    help="share of cases whose head writes are nearly parallel")
    ap.add_argument("--min-T", type=int, default=1, help="draw T from this up (3: no windows of 2)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    cases = [args.case] if args.case is not None else None
    start, n, failures = time.time(), 0, []
    while (cases is None and time.time() - start < args.seconds) or (cases and n < len(cases)):
        case = cases[n] if cases else rng.randrange(1 << 30)
        what, out, f32, f64, parallel = run_case(case, args.near_parallel, args.min_T)
        bad = judge(out, f32, f64, strict_c=parallel)
        n += 1
        if args.verbose:
            print(what, "\n  op", out.tolist(), "\n  float32 reference", f32.tolist(),
                  "\n  float64 (d, c)", f64[..., :2].tolist())
        if bad.max() > 0:
            failures.append((bad.max(), what))
        if cases is None and n % 500 == 0:
            print(f"{n} cases, {len(failures)} failed, {time.time() - start:.0f} s", flush=True)
    print(f"{n} cases, {len(failures)} failed")
    for worst, what in sorted(failures, reverse=True)[:20]:
        print(f"  err/tol {worst:.3g}  {what}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
