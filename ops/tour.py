"""A tour of headscope: runs every op on generated inputs and prints what it did.

    python -m headscope.tour [--device cpu|cuda]

Each row: the op, the inputs it got, what came out, a check against a plain PyTorch
formulation of the same quantity, and the time the op took.
"""
from __future__ import annotations

import argparse
import time

import torch

import headscope

ops = torch.ops.headscope


def timed(fn):
    """Runs fn twice (the first call warms up) and returns the second result and its ms."""
    fn()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, 1e3 * (time.perf_counter() - start)


def mixer_rows(device):
    g = torch.Generator().manual_seed(0)
    heads, n, r, d = 8, 1024, 16, 64
    q, k, v = (torch.randn(1, heads, n, d, generator=g).to(device) for _ in range(3))
    (U, V, z, iters, res), ms = timed(lambda: ops.kl_project(q[..., :r] / 3, k[..., :r] / 3,
                                                             1e-11, 80))
    colsum_gap = (U.double().sum(-2) - V.double().sum(-2)).abs().max().item()
    yield ("kl_project", f"{heads} problems, n={n}, r={r}",
           f"iters {iters.min().item()}-{iters.max().item()}, residual {res.max().item():.1e}",
           f"column sums agree to {colsum_gap:.1e}", ms)

    s = torch.randn(1, heads, r, generator=g).to(device)
    hs, ms = timed(lambda: ops.kl_hvp(U, V, s))
    H = torch.diag_embed(U.sum(-2) + V.sum(-2)) - U.mT @ U - V.mT @ V
    err = ((hs - (H @ s.unsqueeze(-1)).squeeze(-1)).norm() / hs.norm()).item()
    yield ("kl_hvp", f"U, V above, s {list(s.shape)}", f"H s {list(hs.shape)}",
           f"vs explicit H @ s: rel. err {err:.1e}", ms)

    Y, ms = timed(lambda: ops.thin_mix(U, V, v))
    W = (U / U.sum(-2, keepdim=True)) @ V.mT
    err = ((Y - W @ v).norm() / Y.norm()).item()
    yield ("thin_mix", f"U, V above, X {list(v.shape)}", f"Y {list(Y.shape)}",
           f"vs dense W @ X: rel. err {err:.1e}; W rows/cols sum to 1 within "
           f"{max((W.sum(-1) - 1).abs().max().item(), (W.sum(-2) - 1).abs().max().item()):.0e}",
           ms)

    mixer = headscope.FactorMixer(num_heads=heads, head_dim=d, rank=r).to(device)
    out, ms = timed(lambda: mixer(q, k, v))
    yield ("FactorMixer", f"q, k, v {list(q.shape)}", f"out {list(out.shape)}",
           f"{2 * n * r + r} factor entries per head instead of {n * n}", ms)


SECTIONS = [("mixer", mixer_rows)]


def print_rows(rows):
    headers = ("op", "inputs", "result", "check", "ms")
    cells = [(a, b, c, d, f"{e:.2f}") for a, b, c, d, e in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m headscope.tour", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"headscope tour on {device} (torch {torch.__version__}, library {headscope.LIBRARY_PATH})")
    for name, section in SECTIONS:
        print(f"\n[{name}]")
        rows = []
        for row in section(device):
            rows.append(row)
            print(f"  ran {row[0]} ...", flush=True)
        print_rows(rows)


if __name__ == "__main__":
    main()
