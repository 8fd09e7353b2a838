"""The faithfulness-against-time figure: the gradient baseline against finite differences
and an independent autograd formulation on a tiny random Qwen2-VL, the R^2 and LDS helpers
against hand-computed values, and the command end to end on the shipped model."""
from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
from headscope.hf import gradient_scores  # noqa: E402
from headscope.hf.testing import EOS, image_prompt, tiny_model  # noqa: E402
from headscope.shapes.faithfulness import affine_r_squared, lds, r_squared  # noqa: E402

K = 3
SPANS = [(0, 2), (2, 5), (5, 6)]


@pytest.fixture(scope="module")
def case():
    """A float64 tiny model, its prompt, a generated answer of 6 tokens and region ids
    (the image's 16 tokens in 3 bands)."""
    model = tiny_model("qwen2_vl", dtype=torch.float64)
    inputs = image_prompt(model, grids=((8, 8),))
    with torch.no_grad():
        sequences = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6,
                                   do_sample=False)
    assert EOS not in sequences[0, -6:].tolist()
    P = inputs["input_ids"].shape[1]
    rid = torch.full((P,), -1, dtype=torch.int64)
    image = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().squeeze(1)
    rid[image] = torch.arange(len(image)) * K // len(image)
    return model, inputs, sequences, rid


def _answer_log_probs(model, inputs, sequences, change):
    """log p of each answer token from the model's own full forward, with ``change``
    applied to the decoder's input embeddings (a forward pre-hook)."""
    P = inputs["input_ids"].shape[1]
    N = sequences.shape[1] - P
    full = dict(inputs, input_ids=sequences,
                attention_mask=torch.nn.functional.pad(inputs["attention_mask"], (0, N),
                                                       value=1),
                mm_token_type_ids=torch.nn.functional.pad(inputs["mm_token_type_ids"],
                                                          (0, N)))

    def hook(module, args, kwargs):
        kwargs["inputs_embeds"] = change(kwargs["inputs_embeds"])
        return args, kwargs

    handle = model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)
    try:
        logits = model(**full, use_cache=False).logits[0, P - 1:-1]
    finally:
        handle.remove()
    return logits.log_softmax(-1).gather(1, sequences[0, P:, None]).squeeze(1)


def test_input_x_gradient_is_the_directional_derivative(case):
    """Sum over a region of e . grad = d/de f(embeddings with the region scaled by 1 + e)
    at 0: central differences on the float64 model, whose rotary angles are computed in
    float32 (transformers' Qwen2-VL): a step of 1e-2 keeps that rounding (~1e-6 in f) and
    the truncation (~1e-4 relative) below the tolerance."""
    model, inputs, sequences, rid = case
    ixg, _ = gradient_scores(model, inputs, sequences, SPANS, rid)
    assert ixg.shape == (len(SPANS), K) and ixg.abs().min() > 5e-4
    eps = 1e-2
    for k in range(K):
        region = torch.nn.functional.pad((rid == k).to(torch.float64),
                                         (0, sequences.shape[1] - len(rid)))[None, :, None]

        def scaled(factor):
            with torch.no_grad():
                return _answer_log_probs(model, inputs, sequences,
                                         lambda e: e * (1 + factor * region))
        up, down = scaled(eps), scaled(-eps)
        for s, (start, end) in enumerate(SPANS):
            derivative = float((up[start:end].sum() - down[start:end].sum()) / (2 * eps))
            assert ixg[s, k].item() == pytest.approx(derivative, rel=2e-3, abs=2e-5)


def test_gradient_matches_the_models_own_forward(case):
    """The same gradients through the model's whole forward (a leaf swapped in for the
    decoder's input embeddings), per span and region."""
    model, inputs, sequences, rid = case
    ixg, norm = gradient_scores(model, inputs, sequences, SPANS, rid)
    leaf = {}

    def swap(e):
        leaf["e"] = e.detach().requires_grad_(True)
        return leaf["e"]

    with torch.enable_grad():
        logp = _answer_log_probs(model, inputs, sequences, swap)
        for s, (start, end) in enumerate(SPANS):
            (g,) = torch.autograd.grad(logp[start:end].sum(), leaf["e"], retain_graph=True)
            for k in range(K):
                mine = torch.nn.functional.pad(rid == k, (0, sequences.shape[1] - len(rid)))
                expected = (g[0, mine] * leaf["e"][0, mine]).sum()
                assert ixg[s, k].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-9)
                assert norm[s, k].item() == pytest.approx(g[0, mine].norm().item(), rel=1e-5)
    # parameters need their gradients again afterwards
    assert all(p.requires_grad for p in model.parameters())


def test_gradient_scores_errors_name_it(case):
    model, inputs, sequences, rid = case
    with pytest.raises(ValueError, match=r"^headscope\.hf\.gradient_scores: argument "
                                         r"'region_ids'"):
        gradient_scores(model, inputs, sequences, SPANS, rid[:-1])
    with pytest.raises(ValueError, match=r"^headscope\.hf\.gradient_scores: argument "
                                         r"'spans'\[0\]"):
        gradient_scores(model, inputs, sequences, [(0, 99)], rid)
    with pytest.raises(ValueError, match=r"^headscope\.hf\.gradient_scores: argument "
                                         r"'sequences'"):
        gradient_scores(model, inputs, inputs["input_ids"], SPANS, rid)


def test_r_squared_and_lds_helpers_by_hand():
    true = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    # mean 3.5, SS_tot = 17.5; residuals all 1: SS_res = 6
    assert r_squared(true + 1, true) == pytest.approx(1 - 6 / 17.5, abs=1e-12)
    assert r_squared(true, true) == 1.0
    # an affine image of the truth fits perfectly; R^2 of a fit = squared Pearson
    assert affine_r_squared(-3 * true + 7, true) == pytest.approx(1.0, abs=1e-12)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    y = torch.tensor([1.0, 3.0, 2.0, 5.0])
    # about the means 2.5 and 2.75: Sxy = 5.5, Sxx = 5, Syy = 8.75; r^2 = 0.6914...
    r = 5.5 / math.sqrt(5.0 * 8.75)
    assert affine_r_squared(x, y) == pytest.approx(r * r, abs=1e-12)
    # LDS: per span Spearman, averaged per scene, then over scenes
    effects = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    scores = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    # scene 0: spans rho 1 and -1 -> 0; scene 1: rho 1 -> mean of (0, 1) = 0.5
    assert lds(scores, effects, torch.tensor([0, 0, 1]), 2) == pytest.approx(0.5)


def test_faithfulness_command_end_to_end(tmp_path):
    from headscope.shapes.__main__ import main
    out = tmp_path / "faith"
    assert main(["--threads", "1", "faithfulness", "--out", str(out), "--scenes", "2",
                 "--rounds", "1", "--tokens", "8"]) == 0
    result = json.loads((out / "faithfulness.json").read_text())
    methods = result["methods"]
    assert set(methods) == {"head", "attention", "gradient", "gradient_norm", "attnlrp",
                            "perturbation"}
    assert methods["perturbation"]["lds"] == 1.0 and methods["perturbation"]["r2"] == 1.0
    for m in methods.values():
        assert -1 <= m["lds"] <= 1 and m["r2"] <= 1 and m["ms_per_token"] > 0
        assert m["ms_per_span"] > 0
    assert methods["head"]["vs_head"] == 1.0
    assert result["seeds"] == [1_000_500_000, 1_000_500_001]
    assert sum(s["spans"] for s in result["per_scene"]) == result["spans"] > 0
    table = (out / "faithfulness.md").read_text()
    assert "| trained head |" in table and "| AttnLRP (log p) |" in table
    png = (out / "faithfulness.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
