"""AttnLRP (headscope.hf.attnlrp_scores): conservation of the logit target up to what the
softmax rule and the biases keep (recorded by a Ledger), on tiny models covering grouped-query
heads, biases, soft caps, sliding windows and bidirectional image blocks; agreement with
lxt 2.1's own rule functions bound to the same model; the rules' closed forms where lxt
has none; the difference from input x gradient; errors; and the model left as it was."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
from headscope.hf import attnlrp_scores, gradient_scores  # noqa: E402
from headscope.hf.attnlrp import (AttnLRP, Ledger, attnlrp_relevance,  # noqa: E402
                                  _layer_norm_rule, identity_rule)
from headscope.hf.decoder import decoder_inputs  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.gradient import _frozen, answer_targets  # noqa: E402
from headscope.hf.keymask import KeyMask  # noqa: E402
from headscope.hf.testing import EOS, image_prompt, tiny_model  # noqa: E402

N = 6


def _case(family: str, dtype=torch.float64, **kwargs):
    """A tiny model, its prompt, a generated answer of N tokens and region ids (the
    image's tokens in 3 bands)."""
    model = tiny_model(family, dtype=dtype, **kwargs)
    inputs = image_prompt(model)
    with torch.no_grad():
        sequences = model.generate(**inputs, max_new_tokens=N, min_new_tokens=N,
                                   do_sample=False)
    assert EOS not in sequences[0, -N:].tolist()
    P = inputs["input_ids"].shape[1]
    image = torch.isin(inputs["input_ids"][0],
                       torch.tensor(family_of(model).image_token_ids(model.config)))
    rid = torch.full((P,), -1, dtype=torch.int64)
    rid[image] = torch.arange(int(image.sum())) * 3 // int(image.sum())
    return model, inputs, sequences, rid


@pytest.fixture(scope="module")
def qwen():
    return _case("qwen2_vl")


def _targets(model, inputs, sequences, target):
    """The answer's per-token targets from the plain model (no rules bound)."""
    P = inputs["input_ids"].shape[1]
    with torch.no_grad(), KeyMask(family_of(model).decoder(model).config):
        got = decoder_inputs(model, inputs, sequences)
        return answer_targets(model, got["inputs_embeds"], got, sequences[0, P:], P, target)


# qwen2_vl: q/k/v biases, grouped-query heads, multimodal rotary positions; paligemma
# (Gemma 2, eager): attention and output soft caps, a bidirectional prefix block; gemma3:
# sliding windows, q/k norms, bidirectional image blocks; glm4v: a fused gate/up MLP
@pytest.mark.parametrize("family", ["qwen2_vl", "paligemma", "gemma3", "glm4v"])
def test_relevance_is_conserved_but_for_the_softmax_and_biases(family):
    """Logit target: the relevance over every decoder input position plus what the ledger
    records equals the sum of the answer's logits (the plain model's), to float64
    rounding; the softmax rule's share is what conservation misses. Log-probability
    target: the relevance entering the log-softmax is ``z_y - E_p[z]`` (its own rule)."""
    model, inputs, sequences, rid = _case(family)
    logits = _targets(model, inputs, sequences, "logit")
    log_probs = _targets(model, inputs, sequences, "log_prob")
    spans = [(0, 2), (2, N)]
    ledger = Ledger()
    relevance = attnlrp_relevance(model, inputs, sequences, [(0, N)], target="logit",
                                  ledger=ledger)
    total = float(logits.sum())
    assert float(relevance.sum()) + ledger.softmax + ledger.bias == \
        pytest.approx(total, rel=1e-6, abs=1e-7)
    assert abs(ledger.softmax) > 1e-3 * abs(total)  # the rule does lose a share
    assert abs(ledger.bias) < 1e-3 * abs(total)
    # one backward per span: the spans' relevances add up to the whole answer's
    per_span = attnlrp_relevance(model, inputs, sequences, spans, target="logit")
    torch.testing.assert_close(per_span.sum(0), relevance[0], rtol=1e-7, atol=1e-9)
    # log p: the log-softmax passes z_y - sum_j p_j z_j of the output relevance on
    P = inputs["input_ids"].shape[1]
    with torch.no_grad(), KeyMask(family_of(model).decoder(model).config):
        got = decoder_inputs(model, inputs, sequences)
        hidden = family_of(model).decoder(model)(
            inputs_embeds=got["inputs_embeds"], use_cache=False,
            **{k: got[k] for k in ("attention_mask", "position_ids") if got.get(k) is not None}
        ).last_hidden_state[0, P - 1:-1]
        z = model.get_output_embeddings()(hidden)
        cap = family_of(model).final_softcap(model.config)
        z = z if cap is None else torch.tanh(z / cap) * cap
    entering = float((logits - (z.softmax(-1) * z).sum(-1)).sum())
    ledger = Ledger()
    relevance = attnlrp_relevance(model, inputs, sequences, [(0, N)], ledger=ledger)
    assert float(relevance.sum()) + ledger.softmax + ledger.bias == \
        pytest.approx(entering, rel=1e-6, abs=1e-7)
    assert log_probs.sum() < 0
    scores = attnlrp_scores(model, inputs, sequences, spans, rid)
    assert scores.shape == (2, 3) and scores.dtype == torch.float32
    for k in range(3):
        torch.testing.assert_close(
            scores[:, k].double(),
            attnlrp_relevance(model, inputs, sequences, spans)[:, :P][:, rid == k].sum(1),
            rtol=1e-6, atol=1e-9)


def _lxt():
    """lxt 2.1's ``efficient`` rule functions and patches, imported without running its
    package ``__init__`` (which imports its BERT patch, and with it a module transformers 5
    removed)."""
    spec = importlib.util.find_spec("lxt")
    if spec is None:
        pytest.skip("lxt is not installed (pip install --no-deps -r requirements-nodeps.txt)")
    package = types.ModuleType("lxt.efficient")
    package.__path__ = [str(Path(spec.origin).parent / "efficient")]
    return package


def test_agrees_with_lxt_rules_bound_to_the_model(monkeypatch):
    """lxt 2.1's rule functions (its RMSNorm and gated MLP forwards, its attention
    wrapper dividing the q/k/v gradients), bound to an eager float64 Qwen2-VL, give the
    same relevance at every position as attnlrp_relevance with epsilon 0 (lxt's
    Gradient*Input form has no stabiliser), to lxt's own 1e-10 in the identity rule."""
    package = _lxt()
    monkeypatch.setitem(sys.modules, "lxt.efficient", package)
    for name in ("lxt.efficient.rules", "lxt.efficient.patches"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from lxt.efficient import patches

    model, inputs, sequences, _ = _case("qwen2_vl", attn_implementation="eager")
    spans = [(0, 2), (2, N)]
    ours = attnlrp_relevance(model, inputs, sequences, spans, epsilon=0)
    default = attnlrp_relevance(model, inputs, sequences, spans)
    decoder = family_of(model).decoder(model)
    modeling = sys.modules[type(decoder.layers[0].self_attn).__module__]
    P = inputs["input_ids"].shape[1]

    def relevance():
        with torch.enable_grad(), _frozen(model):
            got = decoder_inputs(model, inputs, sequences)
            embeds = got["inputs_embeds"].detach().requires_grad_(True)
            targets = answer_targets(model, embeds, got, sequences[0, P:], P)
            out = []
            for start, end in spans:
                (g,) = torch.autograd.grad(targets[start:end].sum(), embeds, retain_graph=True)
                out.append((g * embeds)[0].sum(-1).detach())
            return torch.stack(out)

    plain_ixg = relevance()
    for module in decoder.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            monkeypatch.setattr(module, "forward",
                                types.MethodType(patches.rms_norm_forward, module))
        elif name.endswith("MLP"):
            monkeypatch.setattr(module, "forward",
                                types.MethodType(patches.gated_mlp_forward, module))
    monkeypatch.setattr(modeling, "eager_attention_forward",
                        patches.wrap_attention_forward(modeling.eager_attention_forward))
    theirs = relevance()
    scale = theirs.abs().max()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * scale)
    # the stabiliser moves little; input x gradient is something else
    torch.testing.assert_close(default, theirs, rtol=0, atol=1e-3 * scale)
    assert (plain_ixg - theirs).abs().max() > 0.2 * scale


def test_rules_in_closed_form():
    """The identity rule on an activation passes ``f(x)/x`` of the gradient; LayerNorm's
    rule is the map with its standard deviation held constant (relevance conserved but
    for the bias)."""
    x = torch.tensor([-2.0, -0.5, 0.0, 0.7, 3.0], dtype=torch.float64, requires_grad=True)
    y = identity_rule(torch.nn.functional.silu(x), x)
    torch.testing.assert_close(y, torch.nn.functional.silu(x))
    (g,) = torch.autograd.grad(y.sum(), x)
    expected = torch.where(x == 0, 0, torch.nn.functional.silu(x) / x).detach()
    torch.testing.assert_close(g, expected)
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 6, dtype=torch.float64)
    y = _layer_norm_rule(norm, (x,), norm(x))
    torch.testing.assert_close(y, norm(x))
    (g,) = torch.autograd.grad((y * upstream).sum(), x)
    std = (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt().detach()
    w = norm.weight.detach() * upstream / std  # (3, 6): d y_j / d centred_j times upstream
    torch.testing.assert_close(g, w - w.mean(-1, keepdim=True))
    relevance_out = (y - norm.bias) * upstream  # what passes the bias
    torch.testing.assert_close((g * x).sum(), relevance_out.sum().detach())


def test_differs_from_input_x_gradient_and_leaves_the_model_as_it_was(qwen):
    model, inputs, sequences, rid = qwen
    config = family_of(model).decoder(model).config
    implementation = config._attn_implementation_internal
    with torch.no_grad():
        before = model(**inputs).logits
    spans = [(0, 2), (2, N)]
    lrp = attnlrp_scores(model, inputs, sequences, spans, rid)
    ixg, _ = gradient_scores(model, inputs, sequences, spans, rid)
    assert (lrp - ixg).norm() > 0.5 * ixg.norm()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)
    assert config._attn_implementation_internal == implementation
    assert all(p.requires_grad for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_errors_name_it(qwen):
    model, inputs, sequences, rid = qwen
    with pytest.raises(ValueError, match=r"^headscope\.hf\.attnlrp_scores: argument "
                                         r"'region_ids'"):
        attnlrp_scores(model, inputs, sequences, [(0, 2)], rid[:-1])
    with pytest.raises(ValueError, match=r"^headscope\.hf\.attnlrp_scores: argument "
                                         r"'spans'\[0\]"):
        attnlrp_scores(model, inputs, sequences, [(0, 99)], rid)
    with pytest.raises(ValueError, match=r"^headscope\.hf\.attnlrp_scores: argument 'target'"):
        attnlrp_scores(model, inputs, sequences, [(0, 2)], rid, target="prob")
    moe = tiny_model("qwen3_vl_moe")
    with pytest.raises(NotImplementedError, match=r"^headscope\.hf\.attnlrp_scores: no "
                                                  r"AttnLRP rule for the parameters of"):
        with AttnLRP(moe):
            pass
    assert not any(m._forward_hooks for m in moe.modules())


def test_shapes_model_ranks_cells_unlike_input_x_gradient():
    """On the shipped shapes model: scores for every span of a description, not a rescaling
    of input x gradient (their rankings of the cells differ on some span)."""
    from headscope.hf import Tracer, grid_regions
    from headscope.shapes import load
    from headscope.shapes.model import prompt
    from headscope.shapes.world import scene
    model, processor, _ = load(head=False)
    image, _ = scene(7, 3)
    inputs = dict(prompt(processor, image))
    spans = []
    with torch.no_grad(), Tracer(model, regions=grid_regions(3, 3), vas=False,
                                 tokenizer=processor.tokenizer) as tr:
        tr.generate_with(spans.append, **inputs, max_new_tokens=24, do_sample=False)
    lrp = attnlrp_scores(model, inputs, tr.sequences, spans, tr.region_ids)
    ixg, _ = gradient_scores(model, inputs, tr.sequences, spans, tr.region_ids)
    assert lrp.shape == ixg.shape == (len(spans), 9) and bool(torch.isfinite(lrp).all())
    assert bool((lrp.argsort(1) != ixg.argsort(1)).any(1).any())
