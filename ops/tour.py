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


def dense_vas(A, V):
    """d, c, r of one head as the reference implementation defines them (docs/vas.md), with
    dense float64 torch (T x T matrices)."""
    A, V = A.double(), V.double()
    Vn = V / V.norm(dim=-1, keepdim=True).clamp_min(1e-9)
    S = (Vn @ Vn.T + 1) / 2

    def center(K):
        return K - K.mean(0, keepdim=True) - K.mean(1, keepdim=True) + K.mean()

    Ac, Sc = center(A), center(S)
    d = (Ac - Sc).norm() / (A.norm() * S.norm()).clamp_min(1e-9)
    c = (Ac * Sc).sum() / ((Ac * Ac).sum() * (Sc * Sc).sum()).sqrt().clamp_min(1e-12)
    p = (A / A.sum(-1).max().clamp_min(1e-12)).clamp_min(1e-12)
    q = (S / S.sum(-1).max().clamp_min(1e-12)).clamp_min(1e-12)
    r = (p * (p / q).log()).sum(-1).mean()
    return torch.stack([d, c, r]).float()


def vas_rows(device):
    g = torch.Generator().manual_seed(1)
    B, L, H, T, D = 2, 4, 8, 256, 64
    lengths = torch.tensor([T, 200]).to(device)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    stats = []
    for layer in range(L):
        q, k, hw = (torch.randn(B, H, T, D, generator=g).to(device) for _ in range(3))
        scores = (q @ k.mT) * D**-0.5
        attn = torch.softmax(scores.masked_fill(~causal.to(device), float("-inf")), -1)
        out, ms = timed(lambda: ops.vas_head_stats(attn, hw, lengths, None))
        stats.append(out)
        if layer == 0:
            want = dense_vas(attn[1, 3, :200, :200].cpu(), hw[1, 3, :200].cpu())
            err = (out[1, 3].cpu() - want).abs().max().item()
            yield ("vas_head_stats", f"attn {list(attn.shape)}, head_writes {list(hw.shape)}",
                   f"(d, c, r) per head {list(out.shape)}",
                   f"vs dense torch (one head): max abs err {err:.1e}", ms)
            out_qk, ms = timed(lambda: ops.vas_head_stats_qk(q, k, hw, lengths, D**-0.5, True,
                                                             None))
            err = (out_qk - out).abs().max().item()
            yield ("vas_head_stats_qk", f"q, k {list(q.shape)} (attention never stored)",
                   f"{list(out_qk.shape)}", f"vs vas_head_stats on softmax: {err:.1e}", ms)
    head_stats = torch.stack(stats, 1)
    feats, ms = timed(lambda: ops.vas_aggregate(head_stats))
    want = head_stats[:, :, :, 0].mean(2).mean(1)  # column 0: d, head mean, layer mean
    yield ("vas_aggregate", f"head stats {list(head_stats.shape)}", f"features {list(feats.shape)}",
           f"vas_d_mean_mean vs torch: {(feats[:, 0] - want).abs().max().item():.1e}", ms)


def attribution_rows(device):
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, Tk, D, K, F = 1, 28, 4, 4096, 128, 64, 28 * 28
    region_ids = torch.full((B, Tk), -1, dtype=torch.long)
    region_ids[:, 100:1124] = torch.randint(0, K, (B, 1024), generator=g)
    region_ids = region_ids.to(device)
    q = torch.randn(B, H, 1, D, generator=g).to(device)
    k = torch.randn(B, Hkv, Tk, D, generator=g).to(device)
    w = torch.ones(B, 1, device=device)
    pooled, ms = timed(lambda: ops.region_pool_qk(q, k, w, region_ids, K, D**-0.5, False, None,
                                                  "sum"))
    attn = torch.softmax((q @ k.repeat_interleave(H // Hkv, 1).mT) * D**-0.5, -1)
    onehot = torch.nn.functional.one_hot(region_ids.clamp_min(0), K).float()
    onehot = onehot * (region_ids >= 0).unsqueeze(-1)
    want = torch.einsum("bhqt,btk->bkh", attn, onehot)
    yield ("region_pool_qk", f"decode: q {list(q.shape)}, kv cache {list(k.shape)}",
           f"region mass {list(pooled.shape)}",
           f"vs softmax + one-hot pooling: {(pooled - want).abs().max().item():.1e}", ms)
    pooled2, ms = timed(lambda: ops.region_pool(attn, w, region_ids, K, "sum"))
    yield ("region_pool", f"attn {list(attn.shape)}", f"{list(pooled2.shape)}",
           f"vs region_pool_qk: {(pooled2 - pooled).abs().max().item():.1e}", ms)

    feats = torch.randn(K, F, generator=g).to(device)
    weight, mean = torch.randn(F, generator=g).to(device), torch.randn(F, generator=g).to(device)
    std = torch.rand(F, generator=g).to(device) + 0.5
    bias = torch.tensor(0.5, device=device)
    scores, ms = timed(lambda: ops.linear_attribution(feats, weight, mean, std, bias))
    want = ((feats - mean) / std) @ weight + 0.5
    yield ("linear_attribution", f"features {list(feats.shape)} (L*H = {F})",
           f"scores {list(scores.shape)}",
           f"vs ((f - mean) / std) @ w + b: {(scores - want).abs().max().item():.1e}", ms)

    target = scores + torch.randn(K, generator=g).to(device)
    rho, ms = timed(lambda: ops.spearman(scores, target, -1))
    ranks = lambda x: x.argsort().argsort().double()  # noqa: E731 (no ties here)
    want = torch.corrcoef(torch.stack([ranks(scores), ranks(target)]))[0, 1]
    yield ("spearman", f"pred, target {list(scores.shape)}", f"{rho.item():.4f}",
           f"vs Pearson of ranks: {abs(rho.item() - want.item()):.1e}", ms)
    r, ms = timed(lambda: ops.pearson(scores, target, -1))
    want = torch.corrcoef(torch.stack([scores, target]))[0, 1]
    yield ("pearson", f"pred, target {list(scores.shape)}", f"{r.item():.4f}",
           f"vs torch.corrcoef: {abs(r.item() - want.item()):.1e}", ms)

    patches = torch.randn(32 * 32, 64, generator=g)
    labels, ms = timed(lambda: ops.ward_regions(patches, 32, 32, 32))
    sizes = torch.bincount(labels)
    yield ("ward_regions", "32 x 32 patches, 64 channels, K = 32", f"labels {list(labels.shape)}",
           f"{len(sizes)} regions of {sizes.min().item()}-{sizes.max().item()} patches", ms)


SECTIONS = [("mixer", mixer_rows), ("vas", vas_rows), ("attribution", attribution_rows)]


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
