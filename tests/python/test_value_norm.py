"""headscope.hf.value_norms: ||v_j W_O^h|| through the QR factor of each head's o_proj
columns, against the direct (hidden-wide) definition in float64, and as region_pool_qk's
key_weights against the materialised float64 pooling of softmax(q k^T) * norms."""
from __future__ import annotations

import pytest
import torch

import headscope
from headscope.hf import value_norm_factors, value_norms
from test_attribution import random_regions, ref_softmax_attn


def direct_norms(values, o_proj_weight, num_heads):
    """(B, H, Tk) ||W_O^h v_j||: each head's hidden-wide write, float64."""
    B, Hkv, Tk, Dh = values.shape
    W = o_proj_weight.double()
    out = torch.empty(B, num_heads, Tk, dtype=torch.float64)
    for h in range(num_heads):
        v = values[:, h // (num_heads // Hkv)].double()             # (B, Tk, Dh)
        out[:, h] = (v @ W[:, h * Dh:(h + 1) * Dh].T).norm(dim=-1)  # (B, Tk, hidden)
    return out


@pytest.mark.parametrize("H, Hkv, Dh, hidden", [(4, 4, 8, 32), (6, 2, 16, 48), (8, 1, 4, 40),
                                                (2, 2, 16, 8)],  # hidden < Dh: R is (8, 16)
                         ids=["mha", "gqa", "mqa", "narrow"])
def test_value_norms_equal_the_direct_definition(H, Hkv, Dh, hidden):
    gen = torch.Generator().manual_seed(H * 100 + Hkv)
    B, Tk = 2, 13
    values = torch.randn(B, Hkv, Tk, Dh, generator=gen, dtype=torch.float64)
    weight = torch.randn(hidden, H * Dh, generator=gen, dtype=torch.float64)
    factors = value_norm_factors(weight, H)
    assert factors.shape == (H, min(hidden, Dh), Dh) and factors.dtype == torch.float64
    got = value_norms(values, factors)
    assert got.shape == (B, H, Tk) and got.dtype == torch.float64
    torch.testing.assert_close(got, direct_norms(values, weight, H), rtol=1e-12, atol=1e-12)
    # bfloat16 cache and weight (a model's): float32 norms of the same values
    got32 = value_norms(values.bfloat16(), value_norm_factors(weight.bfloat16(), H))
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(),
                               direct_norms(values.bfloat16(), weight.bfloat16(), H),
                               rtol=1e-5, atol=1e-5)


def test_value_norms_bad_arguments():
    w = torch.randn(16, 12)
    with pytest.raises(ValueError, match=r"num_heads \(5\) must be >= 1 and divide"):
        value_norm_factors(w, 5)
    with pytest.raises(ValueError, match=r"o_proj_weight must be \(hidden"):
        value_norm_factors(w[0], 3)
    factors = value_norm_factors(w, 3)  # head_dim 4
    with pytest.raises(ValueError, match=r"values have head_dim 5, the factors 4"):
        value_norms(torch.randn(1, 3, 2, 5), factors)
    with pytest.raises(ValueError, match=r"the 2 value heads must divide the 3 heads"):
        value_norms(torch.randn(1, 2, 2, 4), factors)
    with pytest.raises(ValueError, match=r"values must be \(B, Hkv, Tk, head_dim\)"):
        value_norms(torch.randn(3, 2, 4), factors)


@pytest.mark.parametrize("causal", [True, False])
def test_region_pool_qk_with_value_norms_is_the_weighted_softmax(causal):
    """region_pool_qk(key_weights=norms) == per-region sums of softmax(q k^T) * norms,
    the span's weighted mean over queries, all in float64."""
    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, Tq, Tk, Dh, hidden, K = 2, 6, 2, 5, 70, 8, 24, 4
    dt = torch.float64
    q = torch.randn(B, H, Tq, Dh, generator=gen, dtype=dt)
    k = torch.randn(B, Hkv, Tk, Dh, generator=gen, dtype=dt)
    v = torch.randn(B, Hkv, Tk, Dh, generator=gen, dtype=dt)
    w = torch.rand(B, Tq, generator=gen, dtype=dt) + 0.1
    rid = random_regions(B, Tk, K, gen)
    norms = value_norms(v, value_norm_factors(torch.randn(hidden, H * Dh, generator=gen,
                                                          dtype=dt), H))
    got = headscope.region_pool_qk(q, k, w, rid, K, 0.3, causal, key_weights=norms)
    weighted = ref_softmax_attn(q, k, 0.3, causal, None) * norms[:, :, None, :]  # (B, H, Tq, Tk)
    span = w / w.sum(1, keepdim=True)
    want = torch.zeros(B, K, H, dtype=dt)
    for r in range(K):
        in_region = (rid == r).to(dt)[:, None, None, :]
        want[:, r] = torch.einsum("bq,bhq->bh", span, (weighted * in_region).sum(-1))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    # the same through the layers op with a per-layer list
    layers = headscope.region_pool_qk_layers([q, q], [k, k], w, rid, K, [0.3, 0.3], causal,
                                             key_weights=[norms, norms])
    torch.testing.assert_close(layers, torch.cat([want, want], 2), rtol=1e-12, atol=1e-13)
