"""What the low-precision contract holds the Tracer to: the float64 definitions of VAS and
span features on exactly the tensors a model formed (its attention calls as
:func:`~headscope.hf.testing.reference.recorded_attention` records them: q after rotary,
the key cache, the mask the model built, what each head writes), and the bound within
which the Tracer's float32 arithmetic must keep its results from them (docs/hf.md, "Half
precision").

The bound, first order in the unit roundoff. A bfloat16 or float16 tensor widens to float32
exactly and the ops accumulate in float32 (docs/vas.md, docs/attribution.md), so its unit
roundoff ``u = 2^-24`` and the length of each accumulation set the bound; the model's own
dtype enters only as the values it formed. ``gamma(n) = n u / (1 - n u)`` bounds a sum of
n terms in any order relative to the sum of their magnitudes (Higham, 3.1 and 4.2).

* A probability recomputed from q and k (the qk ops): its logit is a dot product of D
  exact products, off by ``gamma(D + 1)`` times ``scale * sum |q_d k_d|``; the cap, the
  shift by the row's largest logit and exp add a few roundings of that size; a softmax
  moves each probability relatively by at most twice its row's largest logit error, and
  the normaliser (a sum of Tk terms, divided) by ``gamma(Tk + 8)``:
  ``eps_row = L (2 gamma(D + 1) + 8 u) + gamma(Tk + 8)``, ``L`` the row's largest
  ``scale * sum |q_d k_d|`` (:func:`probability_error`). Weights the model formed are read
  exactly: 0. Against the float64 softmax of their q and k instead, they carry the
  model's own rounding in its dtype (:func:`formed_probability_error`).
* The Gram of the normalised writes: each ``S_ij = (Vn_i . Vn_j + 1) / 2`` is off by at most
  ``gamma(3 Dh + 8)`` (a norm and a dot product of Dh terms on the CPU; on CUDA three
  float16 tensor-core products of the writes split into ``hi + lo / 2048``).
* The statistics' own sums (float32 within an 8-row strip of a 128-wide tile, float64
  beyond: ``m = 8 min(n, 128) + 64`` roundings): d's numerator
  ``sqrt(|Ac|^2 - 2 <Ac, Sc> + |Sc|^2)`` is off by ``min(gamma(m) P^2 / num,
  sqrt(gamma(m)) P)`` with ``P = |Ac| + |Sc|`` and its denominator by ``2 gamma(m)``
  relatively; c, a cosine, by ``gamma(m) (1 + |c|)``; r by ``(gamma(m) + 4 u)`` times its
  terms' magnitudes ``mean_i sum_j p_ij (1 + |log(p_ij / q_ij)|)`` (a division and a
  logarithm within 2.5 ulp per term).
* Those input errors move a statistic ``f`` by at most
  ``sum_ij |df/dA_ij| err(A_ij) + gamma(3 Dh + 8) sum_ij |df/dS_ij|``, the derivatives
  taken in float64 by autograd (``err(A_ij) = eps_row A_ij``, plus an absolute part for
  weights rounded to a dtype with subnormals in their range).

Span features are sums of probabilities over a region's keys, averaged over the span's
rows: each row's mass on region k is off by ``(eps_row + gamma(Tk + N + 8))`` times itself
(``N`` the span's rows: the sums over keys, rows and the running folds).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .reference import AttentionCall

UNIT_ROUNDOFF = 2.0 ** -24  # float32's, the ops' arithmetic for every floating input


def gamma(n: int) -> float:
    """``n u / (1 - n u)``: the relative error of a sum of n float32 roundings."""
    nu = n * UNIT_ROUNDOFF
    return nu / (1 - nu)


def _visible(call: AttentionCall) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool: the keys each query row saw, from the mask the model built (None:
    causal for a prefill, every key for one row, as transformers' sdpa takes it)."""
    B, _, Tq, _ = call.query.shape
    Tk = call.key.shape[2]
    mask = call.mask
    if mask is None:
        seen = torch.ones(Tq, Tk, dtype=torch.bool, device=call.query.device)
        if Tq > 1:
            seen = seen.tril(Tk - Tq)
        return seen.expand(B, 1, Tq, Tk)
    mask = mask[..., :Tk]
    if mask.dtype == torch.bool:
        return mask.expand(B, 1, Tq, Tk)
    hidden = mask < torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | hidden).all()):
        raise ValueError("recorded_attention: an additive mask of other values than 0 and "
                         "the dtype's lowest (a bias) is not a pattern of seen keys")
    return (~hidden).expand(B, 1, Tq, Tk)


def attention64(call: AttentionCall) -> torch.Tensor:
    """(B, H, Tq, Tk) float64 softmax of the call's q and k, soft-capped and masked as the
    model's call was; a row with no key seen is zero."""
    q, k = call.query.double(), call.key.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    logits = q @ k.transpose(-1, -2) * call.scale
    if call.softcap:
        logits = call.softcap * torch.tanh(logits / call.softcap)
    seen = _visible(call)
    logits = logits.masked_fill(~seen, float("-inf"))
    return torch.softmax(logits, -1).nan_to_num(0.0)


def _largest_logits(call: AttentionCall) -> torch.Tensor:
    """(B, H, Tq, 1): each row's largest ``scale * sum_d |q_d k_d|`` over its seen keys."""
    q, k = call.query.double().abs(), call.key.double().abs()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    largest = (q @ k.transpose(-1, -2) * call.scale).masked_fill(~_visible(call), 0.0)
    return largest.amax(-1, keepdim=True)


def probability_error(call: AttentionCall) -> Tuple[torch.Tensor, float]:
    """``(relative (B, H, Tq, 1), absolute)``: how far each of a row's probabilities may be
    from the float64 softmax of the call's q and k as a qk op computes it in float32
    (module docstring): ``eps_row`` times the probability."""
    D, Tk = call.query.shape[-1], call.key.shape[2]
    return (_largest_logits(call) * (2 * gamma(D + 1) + 8 * UNIT_ROUNDOFF) + gamma(Tk + 8),
            0.0)


def formed_probability_error(call: AttentionCall) -> Tuple[torch.Tensor, float]:
    """``(relative (B, H, Tq, 1), absolute)``: how far the weights a model's eager
    attention formed in its own dtype (unit roundoff ``u_w``: 2^-8 for bfloat16, 2^-11 for
    float16) may be from the float64 softmax of the same q and k. transformers'
    ``eager_attention_forward`` rounds each logit to that dtype twice (the product
    ``q k^T``, accumulated in float32, and the scaling) and three times more under a soft
    cap, takes the softmax in float32 and rounds each probability once:
    ``2 L (roundings u_w + 2 gamma(D + 1)) + u_w + gamma(Tk + 8)`` relatively, plus half the
    dtype's subnormal spacing absolutely (float16 probabilities below 6e-5)."""
    info = torch.finfo(call.weights.dtype)
    u = info.eps / 2
    roundings = 2 + (3 if call.softcap else 0)
    D, Tk = call.query.shape[-1], call.key.shape[2]
    relative = _largest_logits(call) * 2 * (roundings * u + 2 * gamma(D + 1)) + u \
        + gamma(Tk + 8)
    return relative, info.smallest_normal * u


def _center(K: torch.Tensor) -> torch.Tensor:
    return K - K.mean(0, keepdim=True) - K.mean(1, keepdim=True) + K.mean()


def _statistics(A: torch.Tensor, S: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """(d, c, r) of one head's window by their definitions (docs/vas.md), and what the
    bound needs: d's numerator and the norms of the centred matrices."""
    Ac, Sc = _center(A), _center(S)
    numerator = torch.linalg.norm(Ac - Sc)
    den = (torch.linalg.norm(A) * torch.linalg.norm(S)).clamp_min(1e-9)
    d = numerator / den
    ac, sc = torch.linalg.norm(Ac), torch.linalg.norm(Sc)
    c = (Ac * Sc).sum() / (ac * sc).clamp_min(1e-12)
    p = (A / A.sum(-1).max().clamp_min(1e-12)).clamp_min(1e-12)
    q = (S / S.sum(-1).max().clamp_min(1e-12)).clamp_min(1e-12)
    log_ratio = torch.log(p / q)
    r = (p * log_ratio).sum(-1).mean()
    r_terms = (p * (1 + log_ratio.abs())).sum(-1).mean()
    return d, c, r, numerator, den, ac + sc, r_terms


def head_stats64(A: torch.Tensor, V: torch.Tensor,
                 error: Optional[Tuple[torch.Tensor, float]] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One head's window: ``A`` ``(n, n)`` and the writes ``V`` ``(n, Dh)``, float64 ->
    ``(d, c, r)`` and their bound (module docstring); ``error``: how far the probabilities
    the Tracer reads may be from ``A``, ``(relative (n, 1), absolute)``, None where it reads
    ``A`` itself."""
    n, Dh = V.shape
    Vn = V / torch.linalg.vector_norm(V, dim=-1, keepdim=True).clamp_min(1e-9)
    A = A.detach().clone().requires_grad_(True)
    S = ((Vn @ Vn.T + 1) / 2).detach().requires_grad_(True)
    d, c, r, numerator, den, P, r_terms = _statistics(A, S)
    m = gamma(8 * min(n, 128) + 64)
    gram = gamma(3 * Dh + 8)
    sums = torch.stack([
        torch.minimum(m * P ** 2 / numerator.clamp_min(1e-300), m ** 0.5 * P) / den + 2 * m * d,
        m * (1 + c.abs()),
        (m + 4 * UNIT_ROUNDOFF) * r_terms]).detach()
    inputs = []
    for f in (d, c, r):
        dA, dS = torch.autograd.grad(f, (A, S), retain_graph=True)
        moved = gram * dS.abs().sum()
        if error is not None:
            relative, absolute = error
            moved = moved + (dA.abs() * (relative * A + absolute)).sum()
        inputs.append(moved)
    return torch.stack([d, c, r]).detach(), sums + torch.stack(inputs).detach()


def vas_head_stats64(calls: Sequence[AttentionCall], attention_mask: torch.Tensor,
                     exact: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(B, L, H, 3)`` float64 per-head (d, c, r) of one forward's recorded calls (one per
    traced layer, every query row) and their bound, over each row's window of the
    left-padded ``attention_mask``. Of the probabilities the Tracer reads: the weights a
    call formed (eager attention), else those of its q and k (sdpa: a qk op recomputes
    them); with ``exact``, of the float64 softmax of q and k in every call, the bound then
    taking in the rounding of the weights an eager call formed in the model's dtype
    (:func:`formed_probability_error`)."""
    from ...vas import lengths_and_offsets
    lengths, offsets = lengths_and_offsets(attention_mask, left_padding=True)
    stats, bounds = [], []
    for call in calls:
        formed = call.weights is not None
        A = call.weights.double() if formed and not exact else attention64(call)
        if formed:
            relative, absolute = formed_probability_error(call) if exact else (None, 0.0)
        else:
            relative, absolute = probability_error(call)
        V = call.writes.double()
        B, H, T, _ = A.shape
        layer_stats = torch.zeros(B, H, 3, dtype=torch.float64)
        layer_bounds = torch.zeros(B, H, 3, dtype=torch.float64)
        for b in range(B):
            n = min(max(min(int(lengths[b]), T), 4), T)
            s = max(0, min(int(offsets[b]), T - n))
            w = slice(s, s + n)
            for h in range(H):
                error = None if relative is None else (relative[b, h, w].cpu(), absolute)
                layer_stats[b, h], layer_bounds[b, h] = head_stats64(
                    A[b, h, w, w].cpu(), V[b, h, w].cpu(), error)
        stats.append(layer_stats)
        bounds.append(layer_bounds)
    return torch.stack(stats, 1), torch.stack(bounds, 1)


def step_masses64(calls: Sequence[AttentionCall], num_layers: int, prompt_length: int,
                  region_ids: torch.Tensor, num_regions: int
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(N, B, K, L*H)`` float64: the attention mass of each generation step's query row
    on each region of the prompt (column ``l*H + h``), and its bound, from a generation's
    recorded calls (the prefill, then one call per layer and decode step; step t's row
    predicts generated token t). ``region_ids`` ``(B, P)``, -1 off the pictures. A span's
    features are the mean over the steps that predicted its tokens."""
    steps = [calls[i:i + num_layers] for i in range(0, len(calls), num_layers)]
    B, K = region_ids.shape[0], num_regions
    masses, bounds = [], []
    for t, step in enumerate(steps):
        mass, bound = [], []
        for call in step:
            A = attention64(call)[:, :, -1]  # (B, H, Tk): the step's last query row
            eps = probability_error(call)[0][:, :, -1]  # (B, H, 1)
            Tk = A.shape[-1]
            seen = prompt_length + t  # tokens the model had seen at that step
            position = torch.arange(seen - Tk, seen, device=A.device)
            ids = torch.full((B, Tk), -1, dtype=torch.int64, device=A.device)
            prompt = position < prompt_length
            ids[:, prompt] = region_ids[:, position[prompt]].to(A.device)
            onehot = torch.nn.functional.one_hot(ids.clamp_min(0), K).double() \
                * (ids >= 0).unsqueeze(-1)  # (B, Tk, K)
            row = torch.einsum("bhj,bjk->bkh", A, onehot)
            mass.append(row)
            # the sums over keys, over the span's rows and the running folds
            bound.append(row * (eps.transpose(1, 2) + gamma(Tk + len(steps) + 8)))
        masses.append(torch.cat(mass, -1))
        bounds.append(torch.cat(bound, -1))
    return torch.stack(masses).cpu(), torch.stack(bounds).cpu()


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str,
                  fine: bool = True) -> None:
    """Raises AssertionError unless every ``|got - want|`` is within its ``bound`` (``want``
    and ``bound`` float64 on the CPU); ``fine``: the bound is one of float32 arithmetic,
    and so far below the statistics' own size (of order 1e-1 to 1): under 1e-2."""
    if fine and float(bound.max()) >= 1e-2:
        raise AssertionError(f"{what}: a bound of {float(bound.max()):.2e}")
    err = (got.double().cpu() - want).abs()
    out = err > bound
    if bool(out.any()):
        raise AssertionError(f"{what}: an error of {float((err / bound)[out].max()):.2f} "
                             f"times its bound")
