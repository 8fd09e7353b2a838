"""KL projection and the thin doubly-stochastic mixer.

``kl_project`` projects two positive n x r references to row-stochastic factors U, V
with equal column sums g (the joint KL projection of the reference implementation,
``kl_projection_reference.py``, docs/mixer.md, solved by Newton's method on an
r-dimensional dual); ``thin_mix`` applies W = U diag(1/g) V^T to X in
O(n r d) without forming W; ``FactorMixer`` puts both in place of softmax attention.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


class KLProjection(NamedTuple):
    U: Tensor          # (..., n, r) row-stochastic
    V: Tensor          # (..., n, r) row-stochastic, V.sum(-2) == U.sum(-2)
    z: Tensor          # (..., r) dual variable, z[..., -1] == 0
    iters: Tensor      # (...) int64: states examined, as the reference counts them
    residual: Tensor   # (...) float64: max |U.sum(-2) - V.sum(-2)|


def kl_project(u_ref: Tensor, v_ref: Tensor, tol: float = 1e-11, max_iter: int = 80,
               log_space: bool = False, check: bool = True) -> KLProjection:
    """Joint KL projection of references ``u_ref``, ``v_ref`` (both ``(..., n, r)``).

    The references are positive (as in the reference implementation) unless
    ``log_space=True``, in which case they are log-references of any finite value. With
    ``check=True`` a problem whose residual stays above ``tol`` raises instead of
    returning silently.
    Differentiable with respect to both references (implicit differentiation).
    """
    for name, ref in (("u_ref", u_ref), ("v_ref", v_ref)):
        if not isinstance(ref, Tensor):
            raise TypeError(f"headscope.kl_project: argument '{name}' must be a tensor, "
                            f"got {type(ref).__name__}")
        if not ref.is_floating_point():
            raise TypeError(f"headscope.kl_project: argument '{name}' must be float32 or "
                            f"float64, got {ref.dtype}")
        if not bool(torch.isfinite(ref).all()):
            raise ValueError(f"headscope.kl_project: argument '{name}' holds NaN or Inf")
        if not log_space and not bool((ref > 0).all()):
            raise ValueError(f"headscope.kl_project: argument '{name}' must be positive "
                             f"(as references are); pass log_space=True for "
                             f"log-references")
    if not log_space:
        u_ref, v_ref = u_ref.log(), v_ref.log()
    out = KLProjection(*torch.ops.headscope.kl_project(u_ref, v_ref, tol, max_iter))
    if check and out.residual.numel() > 0:
        bad = ~(out.residual <= tol)
        if bool(bad.any()):
            worst = int(torch.argmax(torch.where(bad, out.residual, -1.0).flatten()))
            raise RuntimeError(
                f"headscope.kl_project: {int(bad.sum())} of {bad.numel()} problems did not "
                f"converge to tol={tol:g} within max_iter={max_iter} (worst: problem {worst}, "
                f"residual {out.residual.flatten()[worst].item():.3g}, "
                f"iters {out.iters.flatten()[worst].item()}); raise max_iter or tol, or pass "
                f"check=False to inspect the result")
    return out


def kl_hvp(U: Tensor, V: Tensor, s: Tensor) -> Tensor:
    """The projection dual's Hessian at (U, V) applied to ``s`` ``(..., r)``."""
    return torch.ops.headscope.kl_hvp(U, V, s)


def thin_mix(U: Tensor, V: Tensor, X: Tensor) -> Tensor:
    """``(U / g) @ (V^T @ X)`` with ``g = U.sum(-2)``: the dense ``W @ X``."""
    return torch.ops.headscope.thin_mix(U, V, X)


class FactorMixer(nn.Module):
    """Doubly-stochastic low-rank mixing in place of softmax attention.

    ``forward(q, k, v)`` takes the arguments of ``scaled_dot_product_attention``
    (``(B, H, n, head_dim)``, self-attention, no mask) and returns ``(B, H, n, head_dim)``.
    Per head, queries and keys map to r-dimensional log-references
    ``q @ W_q[h] / temperature`` and ``k @ W_k[h] / temperature`` (the reference
    implementation's ``exp(Q[:, :r] / 3)`` generalised to a learned projection),
    ``kl_project`` makes them the factors U, V of a doubly-stochastic W, and ``thin_mix``
    applies W to v in O(n r d). Every row and column of W sums to 1; W is not causal.
    """

    def __init__(self, num_heads: int, head_dim: int, rank: int, temperature: float = 3.0,
                 tol: float = 1e-10, max_iter: int = 50, check: bool = True):
        super().__init__()
        if rank < 1:
            raise ValueError(f"FactorMixer: rank must be >= 1, got {rank}")
        if temperature <= 0:
            raise ValueError(f"FactorMixer: temperature must be > 0, got {temperature}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.rank = rank
        self.temperature = float(temperature)
        self.tol = float(tol)
        self.max_iter = int(max_iter)
        self.check = check
        # Initialised like the reference implementation: the first r coordinates, Q[:, :r].
        init = torch.zeros(num_heads, head_dim, rank)
        idx = torch.arange(min(rank, head_dim))
        init[:, idx, idx] = 1.0
        self.w_q = nn.Parameter(init.clone())
        self.w_k = nn.Parameter(init.clone())

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.dim() != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
            raise ValueError(f"FactorMixer: q, k must be (B, H, n, head_dim) and v "
                             f"(B, H, n, dv); got {list(q.shape)}, {list(k.shape)}, "
                             f"{list(v.shape)}")
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        log_u = torch.matmul(q.to(acc), self.w_q.to(acc)) / self.temperature
        log_v = torch.matmul(k.to(acc), self.w_k.to(acc)) / self.temperature
        U, V, z, iters, residual = torch.ops.headscope.kl_project(log_u, log_v, self.tol,
                                                                  self.max_iter)
        if self.check and bool((residual > self.tol).any()):
            raise RuntimeError("FactorMixer: the KL projection did not converge (max residual "
                               + str(residual.max().item()) + "); raise max_iter")
        return torch.ops.headscope.thin_mix(U, V, v)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, rank={self.rank}, "
                f"temperature={self.temperature}")
