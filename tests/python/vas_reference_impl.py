"""The project's own dense reference for the vas ops (tests run it without ../shared).

A direct NumPy transcription of the VAS definitions, in float32 like the reference
implementation (``extract_vas`` of vas_reference.py, docs/vas.md): per head it forms both
T x T matrices, centres them and takes norms, CKA and the row KL with the reference
implementation's normalisation (each matrix divided by its largest row sum, clipped at
1e-12).
It adds the window options of the ops (``offsets`` for left padding).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional

import numpy as np
import torch

COLUMNS = [f"vas_{q}_{hagg}_{lstat}" for q in ("d", "c", "r")
           for hagg in ("mean", "std", "max", "min") for lstat in ("mean", "std", "max")]


def window(length: int, T: int, offset: int | None = None) -> tuple[int, int]:
    """(start, n): n = max(min(length, T), 4) bounded by T; start 0, or the offset moved
    left until the window fits."""
    n = min(max(min(length, T), 4), T)
    start = 0 if offset is None else max(0, min(offset, T - n))
    return start, n


def _center(K):
    return K - K.mean(axis=0, keepdims=True) - K.mean(axis=1, keepdims=True) + K.mean()


def _as_ints(M: np.ndarray, bits: int) -> np.ndarray:
    """M * 2^bits as exact Python integers (M's floats have denominators dividing 2^bits)."""
    out = [num * ((1 << bits) // den) for num, den in (float(x).as_integer_ratio() for x in M.ravel())]
    return np.array(out, dtype=object).reshape(M.shape)


def exact_cka(A: np.ndarray, S: np.ndarray) -> float:
    """The reference implementation's CKA of A and S (n x n float64 arrays, their values
    taken as exact), in integer arithmetic: n^2 <Ac, Sc> = n^2 <A, S> - n <rA, rS> - n <cA, cS> + sum(A) sum(S)
    (r, c: row and column sums), and the same for the norms. For heads whose centred A is
    below float64's resolution (an attention sink taking all but 1e-15 of every row), where
    a float64 evaluation of c is off by more than the tolerance."""
    n = A.shape[0]
    a, s = _as_ints(A, 1074), _as_ints(S, 1074)

    def centred_dot(x, y):
        return (n * n * (x * y).sum() - n * (x.sum(1) * y.sum(1)).sum()
                - n * (x.sum(0) * y.sum(0)).sum() + x.sum() * y.sum())

    num, den = centred_dot(a, s), math.isqrt(centred_dot(a, a) * centred_dot(s, s))
    # the reference implementation's max(sqrt(d1 d2), 1e-12)
    floor = Fraction(1e-12) * n * n * (1 << 2148)
    return float(Fraction(num) / max(Fraction(den), floor))


def head_stats_dense(A: np.ndarray, V: np.ndarray, dtype=np.float32) -> tuple[float, float, float]:
    """(d, c, r) of one head from A (n, n) and V (n, Dh), in float32 arithmetic like the
    reference implementation (or float64: for inputs where float32 centring itself loses
    digits; c then exact where even float64 centring loses it, see exact_cka)."""
    A = A.astype(dtype)
    V = V.astype(dtype)
    nrm = np.linalg.norm(V, axis=-1, keepdims=True)  # float32: NumPy's pairwise sum
    Vn = V / np.maximum(nrm, dtype(1e-9))
    S = (Vn @ Vn.T + dtype(1.0)) / dtype(2.0)
    Ac, Sc = _center(A), _center(S)
    if dtype == np.float64:  # Sc = H S H = W W^T / 2 (W = Vn - mean): nearly parallel rows
        W = Vn - Vn.mean(0)  # keep their digits there, and identical rows give Sc = 0
        Sc = W @ W.T / 2.0
    d = float(np.linalg.norm(Ac - Sc)) / max(float(np.linalg.norm(A)) * float(np.linalg.norm(S)), 1e-9)
    num = float(np.sum(Ac.astype(np.float64) * Sc))
    d1 = float(np.sum(Ac.astype(np.float64) ** 2))
    d2 = float(np.sum(Sc.astype(np.float64) ** 2))
    c = num / max(np.sqrt(d1 * d2), 1e-12)
    if dtype == np.float64 and np.sqrt(d1) < 1e-11 * np.linalg.norm(A):
        c = exact_cka(A, S)
    eps = dtype(1e-12)
    p = A / max(A.sum(-1).max(), eps)
    q = S / max(S.sum(-1).max(), eps)
    p = np.clip(p, eps, None)
    q = np.clip(q, eps, None)
    r = float((p.astype(np.float64) * np.log(p / q)).sum(-1).mean())
    return d, c, r


def head_stats(attn: torch.Tensor, head_writes: torch.Tensor, lengths, offsets=None,
               dtype=np.float32) -> np.ndarray:
    """(B, H, 3) float64 like headscope.vas_head_stats (NaN for heads with non-finite input);
    dtype: the arithmetic of head_stats_dense."""
    A = attn.detach().float().cpu().numpy()
    V = head_writes.detach().float().cpu().numpy()
    B, H, T, _ = A.shape
    out = np.zeros((B, H, 3))
    for b in range(B):
        s, n = window(int(lengths[b]), T, None if offsets is None else int(offsets[b]))
        for h in range(H):
            a, v = A[b, h, s:s + n, s:s + n], V[b, h, s:s + n]
            if not (np.isfinite(a).all() and np.isfinite(v).all()):
                out[b, h] = np.nan
                continue
            with np.errstate(all="ignore"):
                out[b, h] = head_stats_dense(a, v, dtype)
    return out


def attention_from_qk(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
                      key_padding_mask: Optional[torch.Tensor] = None, *,
                      window: Optional[int] = None, chunk: Optional[int] = None,
                      block_ids: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                      window_bounds_blocks: bool = True,
                      chunk_origin: Optional[torch.Tensor] = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) with grouped-query heads, in dtype (float32
    unless asked); keys where the (B, T) key_padding_mask is True are left out (a row with
    no key left is zero). The attention pattern (window, chunk, block_ids, softcap,
    chunk_origin) is materialised by headscope.pattern_mask, queries aligned with the last
    keys."""
    q, k = q.to(dtype), k.to(dtype)
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    logits = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    Tq, Tk = q.shape[2], k.shape[2]
    if window or chunk or block_ids is not None:
        from headscope import pattern_mask
        keep = pattern_mask(Tq, Tk, batch=q.shape[0], causal=causal, window=window, chunk=chunk,
                            block_ids=block_ids, key_padding_mask=key_padding_mask,
                            window_bounds_blocks=window_bounds_blocks,
                            chunk_origin=chunk_origin, device=q.device)
        logits = logits.masked_fill(~keep[:, None], float("-inf"))
    elif causal:
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).triu(Tk - Tq + 1)
        logits = logits.masked_fill(mask, float("-inf"))
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    no_key = torch.isneginf(logits).all(-1, keepdim=True)
    return torch.softmax(logits, dim=-1).masked_fill(no_key, 0.0)


def aggregate(head_stats: np.ndarray) -> np.ndarray:
    """(B, L, H, 3) -> (B, 36): per layer mean/std/max/min over heads (stored float32),
    then per column mean/std/max over layers."""
    hs = np.asarray(head_stats, dtype=np.float64)
    B, L, H, _ = hs.shape
    feats = np.zeros((B, 36), dtype=np.float32)
    for b in range(B):
        idx = 0
        for qi in range(3):
            x = hs[b, :, :, qi]
            lay = np.stack([x.mean(1), x.std(1), x.max(1), x.min(1)], 1).astype(np.float32)
            for a in range(4):
                col = lay[:, a]
                feats[b, idx:idx + 3] = [col.mean(), col.std(), col.max()]
                idx += 3
    return feats
