"""KL projection (kl_project, kl_hvp) and the thin mixer (thin_mix, FactorMixer), against
plain formulations and the reference implementation (kl_projection_reference.py,
docs/mixer.md; those tests skip without it)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_within, gamma, load_seed

import headscope

ops = torch.ops.headscope


def dense_mix(U, V, X):
    """The reference implementation's dense_apply: W = (U / g) V^T, then W @ X (float64)."""
    g = U.sum(-2, keepdim=True)
    return (U / g) @ V.mT @ X


def hvp_bound(U, V, s) -> torch.Tensor:
    """How far two float64 evaluations of H s = (colsum U + colsum V) s - U^T U s - V^T V s
    may differ: U and V are positive, so the same products with |s| are the terms'
    magnitudes, each through at most n + r + 4 roundings (column sums, dot products, the
    differences); H s cancels (to 0 along the gauge), so the bound is not a share of it."""
    U, V, s = (torch.as_tensor(x, dtype=torch.float64) for x in (U, V, s))
    a = s.abs().unsqueeze(-1)
    magnitude = ((U.sum(-2) + V.sum(-2)) * s.abs() + (U.mT @ (U @ a)).squeeze(-1)
                 + (V.mT @ (V @ a)).squeeze(-1))
    return 2 * gamma(U.shape[-2] + U.shape[-1] + 4, torch.float64) * magnitude


def mix_bound(U, V, X) -> torch.Tensor:
    """How far two float64 evaluations of (U / g) V^T X may differ: the mixing matrix is
    positive, so (U / g) V^T |X| is the terms' magnitude, each through at most n + m + r + 4
    roundings; X of either sign lets the result cancel."""
    U, V, X = (torch.as_tensor(x, dtype=torch.float64) for x in (U, V, X))
    return (2 * gamma(U.shape[-2] + V.shape[-2] + U.shape[-1] + 4, torch.float64)
            * dense_mix(U, V, X.abs()))


def kkt_violation(a, b, out):
    """How far (U, V, z) is from the projection of log-references a, b: U, V must be the
    row softmaxes at z, z[-1] == 0 and the column sums must agree."""
    U, V, z = out[0].double(), out[1].double(), out[2].double()
    zz = z.unsqueeze(-2)
    return max((U - torch.softmax(a.double() + zz, -1)).abs().max().item(),
               (V - torch.softmax(b.double() - zz, -1)).abs().max().item(),
               z[..., -1].abs().max().item(),
               (U.sum(-2) - V.sum(-2)).abs().max().item())


# ---------------------------------------------------------------- thin_mix

@pytest.mark.parametrize("batch,n,m,r,d", [((), 7, 7, 3, 5), ((2, 3), 40, 33, 4, 6),
                                           ((1,), 600, 300, 8, 64), ((2,), 5, 5, 1, 3)])
def test_thin_mix_equals_dense_float64(device, batch, n, m, r, d):
    g = torch.Generator().manual_seed(0)
    U = torch.softmax(torch.randn(*batch, n, r, generator=g, dtype=torch.float64), -1)
    V = torch.softmax(torch.randn(*batch, m, r, generator=g, dtype=torch.float64), -1)
    X = torch.randn(*batch, m, d, generator=g, dtype=torch.float64)
    want = dense_mix(U, V, X)
    got = headscope.thin_mix(U.to(device), V.to(device), X.to(device)).cpu()
    assert got.shape == want.shape and got.dtype == torch.float64
    assert ((got - want).norm() / want.norm()).item() < 1e-12


def test_thin_mix_non_contiguous(device):
    g = torch.Generator().manual_seed(1)
    U = torch.softmax(torch.randn(3, 6, 20, generator=g, dtype=torch.float64), -2).mT
    V = torch.softmax(torch.randn(3, 6, 20, generator=g, dtype=torch.float64), -2).mT
    X = torch.randn(3, 8, 20, generator=g, dtype=torch.float64).mT
    assert not (U.is_contiguous() or V.is_contiguous() or X.is_contiguous())
    got = headscope.thin_mix(U.to(device), V.to(device), X.to(device)).cpu()
    assert_within(got, dense_mix(U, V, X), mix_bound(U, V, X))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_thin_mix_low_precision_x(device, dtype):
    # Accumulation is float32 throughout. Elementwise error bound: the final rounding
    # of Y to X's dtype (half an ulp of |Y|) plus the standard float32 summation bound
    # (m + r + 2) * 2^-24 * (|U| / g) |V|^T |X| of the two products.
    g = torch.Generator().manual_seed(2)
    U = torch.softmax(torch.randn(2, 300, 8, generator=g), -1)
    V = torch.softmax(torch.randn(2, 300, 8, generator=g), -1)
    X = torch.randn(2, 300, 32, generator=g).to(dtype)
    want = dense_mix(U.double(), V.double(), X.double())
    got = headscope.thin_mix(U.to(device), V.to(device), X.to(device)).cpu()
    assert got.dtype == dtype
    half_ulp = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[dtype]
    bound = half_ulp * want.abs() + (300 + 8 + 2) * 2.0**-24 * dense_mix(
        U.double(), V.double(), X.double().abs())
    assert ((got.double() - want).abs() <= bound).all()


def test_thin_mix_empty_batch_and_rows(device):
    U = torch.rand(0, 5, 3, device=device)
    assert ops.thin_mix(U, U, torch.rand(0, 5, 2, device=device)).shape == (0, 5, 2)
    U = torch.rand(2, 0, 3, device=device)
    assert ops.thin_mix(U, U, torch.rand(2, 0, 4, device=device)).shape == (2, 0, 4)


@pytest.mark.parametrize("args,match", [
    ((torch.rand(4, 3), torch.rand(4, 2), torch.rand(4, 5)), "argument 'V' must have size 3"),
    ((torch.rand(4, 3), torch.rand(5, 3), torch.rand(4, 5)), "argument 'X' must have size 5"),
    ((torch.rand(2, 4, 3), torch.rand(3, 4, 3), torch.rand(2, 4, 5)),
     "argument 'V' must have the batch dimensions"),
    ((torch.rand(4, 3), torch.rand(4, 3).double(), torch.rand(4, 5)),
     "argument 'V' must have the dtype of 'U'"),
    ((torch.rand(4, 3).double(), torch.rand(4, 3).double(), torch.rand(4, 5)),
     "argument 'X' must have dtype Double"),
    ((torch.ones(4, 3, dtype=torch.long),) * 3, "argument 'U' must have dtype Float or Double"),
    ((torch.rand(4, 0), torch.rand(4, 0), torch.rand(4, 5)), "rank r >= 1"),
    ((torch.rand(4), torch.rand(4, 3), torch.rand(4, 5)), "at least 2 dimensions"),
    ((torch.rand(4, 3), torch.rand(4, 3, device="meta"), torch.rand(4, 5)),
     "argument 'V' must be on the same device"),
])
def test_thin_mix_rejects_bad_input(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.thin_mix(*args)


def test_thin_mix_gradcheck(device):
    g = torch.Generator().manual_seed(3)
    U = torch.softmax(torch.randn(2, 6, 3, generator=g, dtype=torch.float64), -1).to(device)
    V = torch.softmax(torch.randn(2, 5, 3, generator=g, dtype=torch.float64), -1).to(device)
    X = torch.randn(2, 5, 4, generator=g, dtype=torch.float64).to(device)
    args = [t.requires_grad_() for t in (U, V, X)]
    assert torch.autograd.gradcheck(ops.thin_mix, args)
    assert torch.autograd.gradgradcheck(ops.thin_mix, args)


def test_thin_mix_opcheck(device):
    g = torch.Generator().manual_seed(4)
    U = torch.softmax(torch.randn(2, 6, 3, generator=g), -1).to(device)
    V = torch.softmax(torch.randn(2, 6, 3, generator=g), -1).to(device)
    X = torch.randn(2, 6, 4, generator=g).to(device)
    torch.library.opcheck(ops.thin_mix.default, (U, V, X))
    torch.library.opcheck(ops.thin_mix.default,
                          (U.requires_grad_(), V.requires_grad_(), X.requires_grad_()))


# ---------------------------------------------------------------- kl_project

def random_problem(shape, seed, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=dtype) * scale,
            torch.randn(*shape, generator=g, dtype=dtype) * scale)


def test_kl_project_matches_seed_prediction_1():
    seed = load_seed("kl_projection_reference")
    rng = np.random.default_rng(7)
    for n in [16, 32, 64, 128]:
        for r in [2, 4, 8]:
            A, B = rng.normal(size=(n, r)), rng.normal(size=(n, r))
            U, V, z, its, res, _ = seed.project(np.exp(A), np.exp(B))
            out = ops.kl_project(torch.from_numpy(A), torch.from_numpy(B), 1e-11, 80)
            assert out[4].item() <= 1e-11
            assert out[3].item() == its
            np.testing.assert_allclose(out[0].numpy(), U, rtol=0, atol=1e-13)
            np.testing.assert_allclose(out[1].numpy(), V, rtol=0, atol=1e-13)
            np.testing.assert_allclose(out[2].numpy(), z, rtol=0, atol=1e-12)


def column_offset_problem(seed, n=64, r=6):
    """Log-references whose columns differ in level (as a trained mixer's do): some columns
    are nearly empty in both factors, where the dual objective is flat."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, r, generator=g, dtype=torch.float64) * 2
                 + torch.randn(r, generator=g, dtype=torch.float64) * 3 for _ in range(2))


def test_kl_project_never_steps_up_the_dual_into_a_flat_region(device):
    # The reference's rule (squared gradient norm only) takes steps here that raise the dual
    # objective into a region where softmax rows saturate, and stalls there (next test);
    # refusing steps that raise the dual converges in 6 iterations.
    a, b = column_offset_problem(5)
    out = [t.cpu() for t in ops.kl_project(a.to(device), b.to(device), 1e-11, 80)]
    assert out[4].item() <= 1e-11 and out[3].item() == 6
    assert kkt_violation(a, b, out) <= 1e-11
    for seed in range(40):  # the same family of problems converges throughout
        a, b = column_offset_problem(seed)
        assert ops.kl_project(a.to(device), b.to(device), 1e-11, 80)[4].item() <= 1e-11, seed


def test_kl_project_reference_stalls_where_the_op_converges():
    reference = load_seed("kl_projection_reference")
    a, b = column_offset_problem(5)
    U, V, z, its, res, _ = reference.project(np.exp(a.numpy()), np.exp(b.numpy()))
    assert res > 1.0 and its < 80  # stalled: the line search found no step


@pytest.mark.parametrize("n,r", [(16, 2), (64, 4), (128, 8), (300, 16), (50, 1)])
def test_kl_project_solves_the_projection(device, n, r):
    a, b = random_problem((3, n, r), seed=n + r)
    out = ops.kl_project(a.to(device), b.to(device), 1e-11, 80)
    assert (out[4] <= 1e-11).all()
    assert kkt_violation(a, b, [t.cpu() for t in out]) <= 1e-11
    torch.testing.assert_close(out[0].sum(-1).cpu(), torch.ones(3, n, dtype=torch.float64))
    assert out[3].dtype == torch.int64 and (out[3] < 80).all()


def test_kl_project_float32_residual(device):
    # Solved in double; the float32 outputs' column sums agree to rounding.
    for n, r in [(16, 2), (128, 8), (1024, 16)]:
        a, b = random_problem((4, n, r), seed=n, dtype=torch.float32)
        U, V, z, iters, res = [t.cpu() for t in ops.kl_project(a.to(device), b.to(device),
                                                                1e-11, 80)]
        assert U.dtype == torch.float32 and (res <= 1e-11).all()
        out_residual = (U.double().sum(-2) - V.double().sum(-2)).abs().max().item()
        assert out_residual <= 1e-5 * n / r


def test_kl_project_batched_equals_looped(device):
    a, b = random_problem((2, 3, 20, 4), seed=5)
    out = ops.kl_project(a.to(device), b.to(device), 1e-11, 80)
    for i in range(2):
        for j in range(3):
            one = ops.kl_project(a[i, j].to(device), b[i, j].to(device), 1e-11, 80)
            for got, want in zip(out, one):
                assert torch.equal(got[i, j], want)


def test_kl_project_log_references_beyond_exp_range(device):
    # exp() of these overflows or underflows in the reference implementation; in log space they
    # are fine.
    a, b = random_problem((2, 40, 4), seed=6, scale=300.0)
    a = a + 1000.0
    out = ops.kl_project(a.to(device), b.to(device), 1e-11, 200)
    assert (out[4] <= 1e-11).all()
    assert kkt_violation(a, b, [t.cpu() for t in out]) <= 1e-11


def test_kl_project_column_scales_far_apart(device):
    # One column is e^-400 times smaller than the others in every row: balancing
    # needs z of several hundred, which the solver's fast path must not lose.
    a, b = random_problem((1, 30, 3), seed=7)
    a[..., 0] -= 400.0
    out = ops.kl_project(a.to(device), b.to(device), 1e-11, 200)
    assert out[4].item() <= 1e-11
    assert kkt_violation(a, b, [t.cpu() for t in out]) <= 1e-11


def test_kl_project_reports_non_convergence(device):
    a, b = random_problem((2, 64, 8), seed=8, scale=3.0)
    U, V, z, iters, res = ops.kl_project(a.to(device), b.to(device), 1e-11, 1)
    assert (iters == 1).all() and (res > 1e-11).all()
    with pytest.raises(RuntimeError, match="did not converge"):
        headscope.kl_project(a.exp().to(device), b.exp().to(device), max_iter=1)
    out = headscope.kl_project(a.exp().to(device), b.exp().to(device), max_iter=1, check=False)
    assert (out.residual > 1e-11).all()


def test_kl_project_max_iter_zero_returns_initial_state():
    a, b = random_problem((5, 2), seed=9)
    U, V, z, iters, res = ops.kl_project(a, b, 1e-11, 0)
    assert iters.item() == 0 and (z == 0).all()
    torch.testing.assert_close(U, torch.softmax(a, -1))


def test_kl_project_rank_one_is_trivial(device):
    a, b = random_problem((3, 9, 1), seed=10)
    U, V, z, iters, res = ops.kl_project(a.to(device), b.to(device), 1e-11, 80)
    assert (U == 1).all() and (V == 1).all() and (z == 0).all() and (res == 0).all()
    assert (iters == 1).all()


def test_kl_project_non_finite_input_is_reported(device):
    a, b = random_problem((2, 8, 3), seed=11)
    a[1, 3, 0] = float("nan")
    U, V, z, iters, res = ops.kl_project(a.to(device), b.to(device), 1e-11, 80)
    assert res[0].item() <= 1e-11 and math.isnan(res[1].item())
    with pytest.raises(ValueError, match="argument 'u_ref' holds NaN or Inf"):
        headscope.kl_project(a.exp(), b.exp())


def test_kl_project_empty_batch(device):
    a = torch.rand(0, 4, 3, dtype=torch.float64, device=device)
    U, V, z, iters, res = ops.kl_project(a, a, 1e-11, 80)
    assert U.shape == (0, 4, 3) and z.shape == (0, 3) and iters.shape == (0,)


def test_kl_project_non_contiguous(device):
    a, b = random_problem((3, 4, 25), seed=12)
    out = ops.kl_project(a.mT.to(device), b.mT.to(device), 1e-11, 80)
    assert kkt_violation(a.mT, b.mT, [t.cpu() for t in out]) <= 1e-11


@pytest.mark.parametrize("args,match", [
    ((torch.rand(5, 3), torch.rand(6, 3)), "n == m"),
    ((torch.rand(5, 3), torch.rand(5, 2)), "argument 'log_v_ref' must have size 3"),
    ((torch.rand(2, 5, 3), torch.rand(3, 5, 3)), "batch dimensions"),
    ((torch.rand(5, 0), torch.rand(5, 0)), "rank r >= 1"),
    ((torch.ones(5, 3, dtype=torch.int32),) * 2, "dtype Float or Double"),
    ((torch.rand(5, 3), torch.rand(5, 3, dtype=torch.float64)), "dtype of 'log_u_ref'"),
    ((torch.rand(5, 3), torch.rand(5, 3, device="meta")), "same device"),
])
def test_kl_project_rejects_bad_input(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.kl_project(*args, 1e-11, 80)


def test_kl_project_rejects_bad_settings():
    a = torch.rand(5, 3)
    with pytest.raises(RuntimeError, match="argument 'tol'"):
        ops.kl_project(a, a, -1.0, 80)
    with pytest.raises(RuntimeError, match="argument 'max_iter'"):
        ops.kl_project(a, a, 1e-11, -1)
    with pytest.raises(ValueError, match="argument 'v_ref' must be positive"):
        headscope.kl_project(a + 0.1, a - 2.0)
    with pytest.raises(TypeError, match="argument 'u_ref' must be float32 or float64"):
        headscope.kl_project(torch.ones(5, 3, dtype=torch.long), a)


def test_kl_project_gradcheck(device):
    a, b = random_problem((2, 7, 3), seed=13)
    a, b = a.to(device).requires_grad_(), b.to(device).requires_grad_()

    def f(a, b):
        U, V, z, _, _ = ops.kl_project(a, b, 1e-13, 100)
        return U, V, z

    assert torch.autograd.gradcheck(f, (a, b))


def test_kl_project_opcheck(device):
    a, b = random_problem((2, 7, 3), seed=14)
    torch.library.opcheck(ops.kl_project.default, (a.to(device), b.to(device), 1e-11, 80))
    torch.library.opcheck(ops.kl_project.default,
                          (a.to(device).requires_grad_(), b.to(device).requires_grad_(), 1e-11, 80))


# ---------------------------------------------------------------- kl_hvp

def test_kl_hvp_equals_hessian(device):
    a, b = random_problem((3, 40, 5), seed=15)
    U, V, *_ = ops.kl_project(a, b, 1e-11, 80)
    s = torch.randn(3, 5, dtype=torch.float64)
    H = (torch.diag_embed(U.sum(-2) + V.sum(-2)) - U.mT @ U - V.mT @ V)
    got = headscope.kl_hvp(U.to(device), V.to(device), s.to(device)).cpu()
    assert_within(got, (H @ s.unsqueeze(-1)).squeeze(-1), hvp_bound(U, V, s))


def test_kl_hvp_matches_seed_prediction_2():
    seed = load_seed("kl_projection_reference")
    rng = np.random.default_rng(3)
    for r in [2, 4, 8, 12]:
        U, V, _, _, _, H = seed.project(np.exp(rng.normal(size=(40, r))),
                                        np.exp(rng.normal(size=(40, r))))
        s = rng.normal(size=r)
        got = ops.kl_hvp(torch.from_numpy(U), torch.from_numpy(V), torch.from_numpy(s)).numpy()
        assert_within(torch.from_numpy(got), torch.from_numpy(seed.hvp(U, V, s)),
                      hvp_bound(U, V, s))
        assert np.linalg.norm(got - H @ s) / np.linalg.norm(H @ s) < 1e-12


def test_kl_hvp_rejects_bad_input():
    U = torch.rand(4, 3)
    with pytest.raises(RuntimeError, match="argument 's' must have size 3"):
        ops.kl_hvp(U, U, torch.rand(2))
    with pytest.raises(RuntimeError, match="argument 's' must have the dtype of 'U'"):
        ops.kl_hvp(U, U, torch.rand(3, dtype=torch.float64))


def test_kl_hvp_opcheck():
    U = torch.softmax(torch.randn(2, 6, 3), -1)
    torch.library.opcheck(ops.kl_hvp.default, (U, U, torch.randn(2, 3)))


# ------------------------------------------------ the reference implementation's prediction 3

def test_thin_apply_matches_seed_prediction_3():
    seed = load_seed("kl_projection_reference")
    rng = np.random.default_rng(11)
    for n, r in [(32, 4), (64, 4), (128, 8), (256, 8)]:
        U, V, *_ = seed.project(np.exp(rng.normal(size=(n, r))), np.exp(rng.normal(size=(n, r))))
        X = rng.normal(size=(n, 16))
        Yd, _ = seed.dense_apply(U, V, X)
        got = ops.thin_mix(torch.from_numpy(U), torch.from_numpy(V), torch.from_numpy(X)).numpy()
        assert np.linalg.norm(got - Yd) / np.linalg.norm(Yd) < 1e-12
        assert_within(torch.from_numpy(got), torch.from_numpy(seed.thin_apply(U, V, X)),
                      mix_bound(U, V, X))


# ---------------------------------------------------------------- FactorMixer

class ToyBlock(torch.nn.Module):
    """One mixing block: tokens of C classes, each with a scalar value; the target at
    every position is the mean value of the tokens of its class, so the block must
    mix by content."""

    def __init__(self, classes=4, dim=16, heads=2, rank=4, check=True):
        super().__init__()
        self.embed = torch.nn.Embedding(classes, dim)
        self.value_in = torch.nn.Linear(1, dim)
        self.qk = torch.nn.Linear(dim, heads * dim)
        self.v = torch.nn.Linear(dim, heads * dim)
        self.mixer = headscope.FactorMixer(heads, dim, rank, check=check)
        self.out = torch.nn.Linear(heads * dim, 1)
        self.heads, self.dim = heads, dim

    def forward(self, classes, values):
        x = self.embed(classes) + self.value_in(values.unsqueeze(-1))
        B, n, _ = x.shape
        qk = self.qk(x).view(B, n, self.heads, self.dim).transpose(1, 2)
        v = self.v(x).view(B, n, self.heads, self.dim).transpose(1, 2)
        y = self.mixer(qk, qk, v).transpose(1, 2).reshape(B, n, self.heads * self.dim)
        return self.out(y).squeeze(-1)


def toy_batch(g, B=32, n=16, classes=4):
    c = torch.randint(0, classes, (B, n), generator=g)
    v = torch.randn(B, n, generator=g)
    onehot = torch.nn.functional.one_hot(c, classes).float()
    class_mean = (onehot * v.unsqueeze(-1)).sum(1) / onehot.sum(1).clamp(min=1)
    return c, v, class_mean.gather(1, c)


def test_factor_mixer_learns_a_content_mixing_task():
    torch.manual_seed(0)
    model = ToyBlock()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    eval_batch = toy_batch(g, B=256)

    def eval_loss():
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(*eval_batch[:2]), eval_batch[2]).item()

    start = eval_loss()
    for _ in range(100):
        c, v, target = toy_batch(g)
        loss = torch.nn.functional.mse_loss(model(c, v), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = eval_loss()
    assert end < 0.05 * start, (start, end)  # measured: 0.65 -> 1e-4


def test_factor_mixer_rows_and_columns_mix_to_one(device):
    mixer = headscope.FactorMixer(num_heads=2, head_dim=8, rank=3).to(device).double()
    q = torch.randn(1, 2, 10, 8, dtype=torch.float64, device=device)
    k = torch.randn(1, 2, 10, 8, dtype=torch.float64, device=device)
    # Mixing the identity gives W itself: rows and columns sum to one.
    W = mixer(q, k, torch.eye(10, dtype=torch.float64, device=device).expand(1, 2, 10, 10))
    torch.testing.assert_close(W.sum(-1).cpu(), torch.ones(1, 2, 10, dtype=torch.float64))
    torch.testing.assert_close(W.sum(-2).cpu(), torch.ones(1, 2, 10, dtype=torch.float64))


def test_factor_mixer_scripted_equals_eager(device):
    torch.manual_seed(1)
    mixer = headscope.FactorMixer(num_heads=2, head_dim=8, rank=3).to(device)
    scripted = torch.jit.script(mixer)
    q, k, v = (torch.randn(2, 2, 12, 8, device=device) for _ in range(3))
    assert torch.equal(scripted(q, k, v), mixer(q, k, v))


def test_factor_mixer_compile_fullgraph_and_export():
    torch.manual_seed(2)
    mixer = headscope.FactorMixer(num_heads=2, head_dim=8, rank=3, check=False)
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    eager = mixer(q, k, v)
    compiled = torch.compile(mixer, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager)
    exported = torch.export.export(mixer, (q, k, v))
    torch.testing.assert_close(exported.module()(q, k, v), eager)
    names = {str(node.target) for node in exported.graph.nodes}
    assert "headscope.kl_project.default" in names and "headscope.thin_mix.default" in names


def test_factor_mixer_rejects_bad_shapes():
    mixer = headscope.FactorMixer(num_heads=2, head_dim=8, rank=3)
    with pytest.raises(ValueError, match="FactorMixer: q, k must be"):
        mixer(torch.randn(2, 12, 8), torch.randn(2, 12, 8), torch.randn(2, 12, 8))


# ---------------------------------------------------------------- the reproduction script

def test_reproduction_script_meets_the_seed_predictions():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "reproduce_kl_projection.py"
    spec = importlib.util.spec_from_file_location("reproduce_kl_projection", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.reproduce()
    for row in result["prediction_1_feasibility"]:
        assert row["residual"] <= 1e-11 and row["col_match"] <= 1e-11 and row["row_res"] <= 1e-14
        assert row["h_null"] <= 1e-10  # H 1 = 0: the gauge direction is the null space
    assert all(row["hvp_relative_error"] < 1e-12 for row in result["prediction_2_hvp"])
    for row in result["prediction_3_application"]:
        assert row["apply_rel_error"] < 1e-12
        assert row["storage_ratio"] == row["n"] ** 2 / (2 * row["n"] * row["r"] + row["r"])
    assert result["mini_experiment"]["idea_ds_residual"] <= 1e-11
