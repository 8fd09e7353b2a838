"""Random cases for the vas ops, judged against a float64 evaluation (scripts/fuzz_vas.py
runs them for minutes; test_vas.py runs a fixed few hundred)."""
from __future__ import annotations

import random

import numpy as np
import torch

import vas_reference_impl as ref

OPS = torch.ops.headscope

T_CHOICES = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 130, 200, 256, 257,
             300]  # 256: a row stride of a multiple of 256 floats (the CPU copies A_JI tiles)
# windows of 2 or 3 positions: centred 2 x 2 or 3 x 3 matrices, where c is a ratio of rounding
# noise for the reference implementation and the op alike
DEGENERATE_T = 3


def relayout(x: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """The same values in one of three layouts: contiguous, (B, T, H, X) transposed, or every
    other element of a wider buffer."""
    k = rng.randrange(3)
    if k == 1:
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if k == 2:
        wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


def random_pattern(B: int, T: int, rng: random.Random) -> dict:
    """An attention pattern of the qk op, each part drawn with probability 1/3: a sliding
    window, chunks (half of them from a drawn origin, before, among or past the keys),
    bidirectional blocks (1 to 3 per row, any lengths, ids reused so that a block may have
    gaps; bounded by the window or not) and a logit soft cap."""
    p = {}
    if rng.random() < 1 / 3:
        p["window"] = rng.randint(1, T + 3)
    if rng.random() < 1 / 3:
        p["chunk"] = rng.randint(1, T + 3)
    if rng.random() < 1 / 3:
        ids = torch.full((B, T), -1, dtype=torch.long)
        for b in range(B):
            for _ in range(rng.randint(1, 3)):
                s = rng.randrange(T)
                ids[b, s:s + rng.randint(1, max(1, T // 2))] = rng.randrange(2)
        p["block_ids"] = ids
    if rng.random() < 1 / 3:
        p["softcap"] = rng.choice([0.5, 2.0, 30.0])
    if "block_ids" in p and rng.random() < 0.5:
        p["window_bounds_blocks"] = False
    if "chunk" in p and rng.random() < 0.5:  # chunks from anywhere (a key cache past them)
        p["chunk_origin"] = torch.tensor([rng.randint(-3 * T, 3 * T) for _ in range(B)])
    return p


def run_case(case: int, near_parallel: float = 0.0, min_T: int = 1):
    """One random case: (description, op result, float32 reference, float64 reference,
    whether its head writes are nearly parallel). near_parallel: the share of such cases
    (each head's writes one direction plus 1e-4..1e-1 of noise: cosines from about 0.99 to
    0.9999999)."""
    rng = random.Random(case)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    B, H = rng.randint(1, 3), rng.choice([1, 2, 3, 4, 6])
    T = rng.choice([t for t in T_CHOICES if t >= min_T])
    Dh = rng.choice([1, 2, 3, 7, 8, 9, 16, 31, 64, 65, 128])
    dtype = rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    mode, causal = rng.choice(["attn", "attn", "qk"]), rng.random() < 0.5
    threads = rng.choice([1, 2, 3, 4])
    lengths = torch.tensor([rng.randint(0, T) for _ in range(B)])
    offsets = (torch.tensor([rng.randint(0, T - int(n)) for n in lengths])
               if rng.random() < 0.4 else None)
    V = torch.randn(B, H, T, Dh, generator=g)
    if rng.random() < 0.3:
        V[:, :, ::rng.randint(2, 5)] = 0
    parallel = rng.random() < near_parallel
    if parallel:
        V = V[:, :, :1].expand_as(V) + 10 ** rng.uniform(-4, -1) * V
    V = V.to(dtype)
    torch.set_num_threads(threads)
    if mode == "attn":
        logits = torch.randn(B, H, T, T, generator=g) * rng.choice([0.5, 2.0, 8.0, 30.0])
        if rng.random() < 0.3:
            logits[..., 0] += rng.choice([4.0, 8.0, 12.0])  # an attention sink
        if rng.random() < 0.2:  # sliding-window attention: tiles and blocks of zeros
            i = torch.arange(T)
            logits = logits.masked_fill((i[:, None] - i[None, :]).abs() > rng.randint(1, 60),
                                        float("-inf"))
        if causal:
            logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        A = torch.softmax(logits, -1)
        if rng.random() < 0.2:
            A = A * rng.choice([0.5, 3.0])  # rows not summing to 1
        A = A.to(dtype)
        out = OPS.vas_head_stats(relayout(A, rng), relayout(V, rng), lengths, offsets)
    else:
        Hkv = rng.choice([h for h in range(1, H + 1) if H % h == 0])
        D = rng.choice([1, 4, 16, 64, 65])
        q = (torch.randn(B, H, T, D, generator=g) * rng.choice([0.3, 1.0, 3.0])).to(dtype)
        k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
        kpm = torch.rand(B, T, generator=g) < 0.3 if rng.random() < 0.4 else None
        pattern = random_pattern(B, T, rng)
        out = OPS.vas_head_stats_qk(relayout(q, rng), relayout(k, rng), relayout(V, rng),
                                    lengths, D ** -0.5, causal, offsets, kpm, **pattern)
        A = ref.attention_from_qk(q, k, D ** -0.5, causal, kpm, dtype=torch.float64,
                                  **pattern).float()
        mode += "".join(f" {key}={'...' if key == 'block_ids' else v}"
                        for key, v in pattern.items())
    f32 = ref.head_stats(A, V, lengths, offsets)
    # (c exact, in integers, for heads whose centred A float64 cannot resolve: ref.exact_cka)
    f64 = ref.head_stats(A, V, lengths, offsets, dtype=np.float64)
    # r is judged against the float32 reference: the op forms S in float32 as the reference
    # implementation does (docs/vas.md, "Differences from the reference"), and log q near S = 0
    # follows those roundings
    f64[..., 2] = f32[..., 2]
    what = (f"case {case}: {mode} B={B} H={H} T={T} Dh={Dh} {str(dtype)[6:]} "
            f"{'causal' if causal else 'dense'} threads={threads} lengths={lengths.tolist()}"
            f"{' offsets' if offsets is not None else ''}{' near-parallel' if parallel else ''}")
    return what, out.double().numpy(), f32, f64, parallel


def judge(out, f32, f64, strict_c: bool = False):
    """err/tol of each statistic, 0 where the op is within 3x the float32 reference's miss;
    with strict_c (nearly parallel writes, where the reference implementation's float32 Gram
    loses c's digits) c is judged against float64 alone."""
    tol = lambda x: np.abs(x - f64) / (1e-6 + 1e-4 * np.abs(f64))  # noqa: E731
    mine, seeds = tol(out), np.nan_to_num(tol(f32))
    if strict_c:
        seeds[..., 1] = 0.0
    both_nan = np.isnan(out) & np.isnan(f64)
    mine = np.where(both_nan, 0.0, np.where(np.isnan(mine), np.inf, mine))
    return np.where(mine > np.maximum(1.0, 3.0 * seeds), mine, 0.0)
