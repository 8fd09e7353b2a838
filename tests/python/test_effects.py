"""headscope.hf.region_effects on tiny random VLMs against a plain reference that ablates
one region at a time with the model's own forward (an attention mask with holes for
"mask", a decoder pre-hook that replaces the embeddings for "zero" and "mean"); regions
a span cannot see have no effect; every region masked equals the image masked out."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from conftest import DEVICES  # noqa: E402
from headscope.hf import Tracer, region_effects  # noqa: E402
from headscope.hf.families import FAMILIES, family_of  # noqa: E402
from headscope.hf.families.base import TYPE_INPUTS  # noqa: E402
from headscope.hf.keymask import removed_score  # noqa: E402
from headscope.hf.testing import image_prompt, tiny_model, tiny_of  # noqa: E402

K = 4
SPANS = [(0, 2), (2, 6), (0, 6), (5, 6)]


def _generated(model, text_before=3):
    grid = ((8, 8),)
    inputs = image_prompt(model, grids=grid, text_before=(text_before,), text_after=(5,))
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    with torch.no_grad(), Tracer(model, regions=K, vas=False) as tr:
        list(tr.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None))
    return inputs, tr.sequences, tr.region_ids


_CASES = {}


def _case(family, device="cpu"):
    """A family's tiny model, or one of test_families_patterns.VARIANTS (a family on
    another decoder), with its generation."""
    if (family, device) not in _CASES:
        from test_families_patterns import VARIANTS
        model_type, text = VARIANTS.get(family, (family, None))
        model = tiny_model(model_type, text_overrides=text).to(device)
        _CASES[family, device] = (model, *_generated(model))
    return _CASES[family, device]


@pytest.fixture
def qwen():
    return _case("qwen2_vl")


def _decoder_inputs(model, full):
    got = {}
    handle = model.get_decoder().register_forward_pre_hook(
        lambda m, a, kw: got.update(kw), with_kwargs=True)
    with torch.no_grad():
        model(**full)
    handle.remove()
    return got


_CLEAN = {}


def _clean_inputs(model, full):
    """The decoder's inputs of the unablated sequence (one forward per model)."""
    if id(model) not in _CLEAN:
        _CLEAN[id(model)] = _decoder_inputs(model, full)
    return _CLEAN[id(model)]


def _reference_logp(model, inputs, sequences, rid, removed, ablation, hole=None):
    """Answer-token log-probabilities of one ablation (``removed`` (P,) bool), by the
    model's plain forward. ``hole``: prompt positions masked out in every run."""
    removed = removed.to(model.device)
    hole = None if hole is None else hole.to(model.device)
    P = inputs["input_ids"].shape[1]
    N = sequences.shape[1] - P
    full = dict(inputs, input_ids=sequences)
    for name in ("attention_mask", *TYPE_INPUTS):
        if name in full:
            full[name] = torch.nn.functional.pad(
                full[name], (0, N), value=1 if name == "attention_mask"
                else family_of(model).answer_type(name))
    clean = _clean_inputs(model, full)
    if clean.get("position_ids") is not None:  # positions as without holes in the mask
        full["position_ids"] = clean["position_ids"]
    if hole is not None:
        full["attention_mask"] = full["attention_mask"] * ~torch.nn.functional.pad(hole, (0, N))
    rem = torch.nn.functional.pad(removed, (0, N))
    handle = None
    if ablation == "mask":
        full["attention_mask"] = full["attention_mask"] * ~rem
    else:
        image = torch.nn.functional.pad(rid[0] >= 0, (0, N))
        mean = clean["inputs_embeds"][0, image].mean(0)

        def replace(module, args, kwargs):
            embeds = kwargs["inputs_embeds"].clone()
            embeds[0, rem] = 0 if ablation == "zero" else mean
            kwargs["inputs_embeds"] = embeds
            if kwargs.get("deepstack_visual_embeds") is not None:  # Qwen3-VL
                hit = rem[kwargs["visual_pos_masks"][0]]
                kwargs["deepstack_visual_embeds"] = [
                    torch.where(hit[:, None], 0 if ablation == "zero" else e.mean(0), e)
                    for e in kwargs["deepstack_visual_embeds"]]
            return args, kwargs
        handle = model.get_decoder().register_forward_pre_hook(replace, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(**full).logits[0, P - 1:P - 1 + N].float()
    finally:
        if handle is not None:
            handle.remove()
    return logits.log_softmax(-1).gather(1, sequences[0, P:, None]).squeeze(1).double()


def _reference_effects(model, inputs, sequences, rid, sets, ablation, hole=None):
    """(spans, len(sets)) effects of ablating each region set, one forward per set."""
    none = torch.zeros(rid.shape[1], dtype=torch.bool)
    base = _reference_logp(model, inputs, sequences, rid, none, ablation, hole)
    out = []
    for regions in sets:
        removed = torch.isin(rid[0], torch.tensor(regions, device=rid.device))
        drop = base - _reference_logp(model, inputs, sequences, rid, removed, ablation, hole)
        out.append([float(drop[a:b].sum()) for a, b in SPANS])
    return torch.tensor(out, dtype=torch.float32).T


# The model types and ablations each family module chooses (TinySpec.effects; "zero" and
# "mean" differ between families only in Qwen3-VL's deepstack features), and LLaVA on Llama
# 4's chunked decoder (test_families_patterns.VARIANTS)
EFFECTS = [(model_type, ablation) for family in FAMILIES
           for model_type, ablations in tiny_of(family).spec.effects.items()
           for ablation in ablations]
EFFECTS.append(("llava_llama4_chunked", "mask"))
UNSEEN = [t for family in FAMILIES for t in tiny_of(family).spec.unseen_region_effects]


@pytest.mark.parametrize("family, ablation", EFFECTS)
@pytest.mark.parametrize("device", DEVICES)
def test_batched_effects_equal_one_region_at_a_time(family, ablation, device):
    model, inputs, sequences, rid = _case(family, device)
    subsets = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    effects, joint = region_effects(model, inputs, sequences, SPANS, rid, subsets=subsets,
                                    ablation=ablation, batch_size=8, progress=False)
    assert effects.shape == (len(SPANS), K) and effects.dtype == torch.float32
    assert joint.shape == (len(SPANS), 3)
    want = _reference_effects(model, inputs, sequences, rid, [[k] for k in range(K)], ablation)
    torch.testing.assert_close(effects, want, atol=2e-5, rtol=1e-4)
    want_joint = _reference_effects(model, inputs, sequences, rid,
                                    [[0, 1], [1, 3], [0, 1, 2, 3]], ablation)
    torch.testing.assert_close(joint, want_joint, atol=2e-5, rtol=1e-4)
    assert effects.abs().max() > 1e-3  # the ablations do change the answer's likelihood
    single = region_effects(model, inputs, sequences, SPANS, rid, ablation=ablation,
                            batch_size=1, progress=False)
    torch.testing.assert_close(single, effects, atol=1e-5, rtol=1e-5)
    # spans add up: [0, 2) + [2, 6) = [0, 6)
    torch.testing.assert_close(effects[0] + effects[1], effects[2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", UNSEEN)
@pytest.mark.parametrize("ablation", ["mask", "zero"])
def test_region_the_span_cannot_see_has_no_effect(family, ablation):
    model, inputs, sequences, rid = _case(family)
    hidden = 2
    hole = rid[0] == hidden  # no query sees region 2's keys, ablated or not
    masked = dict(inputs, attention_mask=inputs["attention_mask"] * ~hole)
    effects = region_effects(model, masked, sequences, SPANS, rid, ablation=ablation,
                             progress=False)
    assert torch.all(effects[:, hidden].abs() <= 1e-6), effects
    assert effects.abs().max() > 1e-3


def test_mask_all_regions_equals_image_masked_out(qwen):
    model, inputs, sequences, rid = qwen
    P = inputs["input_ids"].shape[1]
    N = sequences.shape[1] - P
    _, joint = region_effects(model, inputs, sequences, SPANS, rid,
                              subsets=torch.ones(1, K, dtype=torch.bool), progress=False)
    none = torch.zeros(P, dtype=torch.bool)
    base = _reference_logp(model, inputs, sequences, rid, none, "mask")
    without = _reference_logp(model, inputs, sequences, rid, none, "mask", hole=rid[0] >= 0)
    drop = base - without
    want = torch.tensor([[float(drop[a:b].sum())] for a, b in SPANS])
    torch.testing.assert_close(joint, want, atol=2e-5, rtol=1e-4)
    assert N == 6


def test_image_at_position_zero_stays_finite():
    """LLaVA with no text before the image: the first image token's query sees only
    itself, so a row whose every key is removed must not turn into NaN."""
    model = tiny_model("llava")
    inputs, sequences, rid = _generated(model, text_before=0)
    assert int(rid[0, 0]) >= 0
    effects = region_effects(model, inputs, sequences, SPANS, rid, progress=False)
    assert torch.isfinite(effects).all()
    single = region_effects(model, inputs, sequences, SPANS, rid, batch_size=1, progress=False)
    torch.testing.assert_close(single, effects, atol=1e-5, rtol=1e-5)
    assert removed_score(torch.float16) > float("-inf")


def test_spans_objects_and_model_restored(qwen):
    model, inputs, sequences, rid = qwen
    impl = model.config.text_config._attn_implementation
    with torch.no_grad(), Tracer(model, regions=K, vas=False) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=6, do_sample=False,
                                 eos_token_id=None))
    from_spans = region_effects(model, inputs, sequences, spans, tr.region_ids.reshape(-1),
                                progress=False)
    pairs = region_effects(model, inputs, sequences, [(s.start, s.end) for s in spans], rid,
                           progress=False)
    assert torch.equal(from_spans, pairs)
    from transformers import BatchFeature  # what processors (and shapes.prompt) return
    batch = region_effects(model, BatchFeature(dict(inputs)), sequences, spans, rid,
                           progress=False)
    assert torch.equal(batch, pairs)
    with pytest.raises(ValueError, match="'inputs' must be a mapping of model inputs"):
        region_effects(model, list(inputs.values()), sequences, spans, rid, progress=False)
    assert model.config.text_config._attn_implementation == impl
    assert not model.get_decoder()._forward_pre_hooks


def test_errors(qwen):
    model, inputs, sequences, rid = qwen
    P = inputs["input_ids"].shape[1]
    with pytest.raises(ValueError, match="argument 'ablation'"):
        region_effects(model, inputs, sequences, SPANS, rid, ablation="blur")
    with pytest.raises(ValueError, match=r"argument 'spans'\[0\]"):
        region_effects(model, inputs, sequences, [(3, 3)], rid)
    with pytest.raises(ValueError, match=r"argument 'spans'\[1\]"):
        region_effects(model, inputs, sequences, [(0, 1), (0, 99)], rid)
    with pytest.raises(ValueError, match="argument 'region_ids'"):
        region_effects(model, inputs, sequences, SPANS, rid[:, :-1])
    with pytest.raises(ValueError, match="argument 'region_ids'"):
        region_effects(model, inputs, sequences, SPANS, torch.full((P,), -1))
    with pytest.raises(ValueError, match="argument 'subsets'"):
        region_effects(model, inputs, sequences, SPANS, rid,
                       subsets=torch.ones(2, K + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="argument 'sequences'"):
        region_effects(model, inputs, sequences[:, :P], SPANS, rid)
    with pytest.raises(ValueError, match="start with the prompt"):
        region_effects(model, inputs, sequences.flip(1), SPANS, rid)
    with pytest.raises(ValueError, match="argument 'batch_size'"):
        region_effects(model, inputs, sequences, SPANS, rid, batch_size=0)
    with Tracer(model, regions=K):
        with pytest.raises(RuntimeError, match="already traced"):
            region_effects(model, inputs, sequences, SPANS, rid, progress=False)
