"""The newest VLM families (and two older ones: VipLLaVA, GOT-OCR 2), traced through the generic reading by structure
(headscope.hf.families.generic) on tiny random models built as their own transformers
tests build them (headscope.hf.testing.newest): the logits are bitwise unchanged, VAS equals
the reference on the eager attentions of the softmax layers (a hybrid decoder's other
mixers are not traced), greedy tokens are plain generate's and span features equal
region_pool on eager attentions, a left-padded batch equals its rows alone, regions lie
only on placeholders that hold a piece of the picture, and region_effects' "mask"
ablation equals the model's own forward with the region's keys masked out (refused for a
hybrid decoder, whose other mixers would carry the region on: there "zero" and "mean"
equal the model's forward on ablated embeddings)."""
from __future__ import annotations

import pytest
import torch

import headscope

pytest.importorskip("transformers")
from headscope.commands.models import text_sizes  # noqa: E402
from headscope.hf import Tracer, grid_regions, region_effects  # noqa: E402
from headscope.hf.families import GENERIC, family_of  # noqa: E402
from headscope.hf.structure import softmax_attention_layers  # noqa: E402
from headscope.hf.testing import eager_reference as shared_eager_reference  # noqa: E402
from headscope.hf.testing.newest import (RECIPES, batch_rows, newest_rows,  # noqa: E402
                                         tiny_newest)
from headscope.hf.testing.tokens import IMAGE_TOKEN  # noqa: E402

TYPES = sorted(RECIPES)
HYBRID = {"lfm2_vl"}
# placeholders per picture that hold no piece of it: Granite 4 Vision's row breaks after
# each of the 2 rows of its unpadded view
MARKERS = {"granite4_vision": 2}
# decoders whose inputs region_effects cannot batch: it refuses them (NotImplementedError)
UNBATCHED = {"granite4_vision": "deepstack_features"}
TEXT = dict(text_before=(3, 5), text_after=(5, 2))
NEW = 5  # generated tokens

_MODELS = {}


def _models(model_type):
    """The same weights with sdpa and with eager attention, and the recipe."""
    if model_type not in _MODELS:
        model, recipe = tiny_newest(model_type)
        eager, _ = tiny_newest(model_type, attn_implementation="eager")
        _MODELS[model_type] = (model, eager, recipe)
    return _MODELS[model_type]


@pytest.fixture(scope="module", params=TYPES)
def case(request):
    model, eager, recipe = _models(request.param)
    rows = newest_rows(model, recipe, **TEXT)
    return model, eager, recipe, rows


def _softmax_layers(model):
    return [m.layer_idx for m in softmax_attention_layers(family_of(model).decoder(model))]


def eager_reference(eager, inputs):
    """Per softmax layer of the eager model, its attention weights (B, H, T, T) and its
    per-head writes (B, H, T, Dh): headscope.hf.testing's reference, without a cache."""
    _, attns, writes = shared_eager_reference(eager, inputs, use_cache=False)
    return attns, writes


def test_read_by_structure(case):
    model, _, _, _ = case
    text = model.config.get_text_config(decoder=True)
    assert family_of(model) is GENERIC
    with Tracer(model, regions=2) as tr:
        layers = tr.layers
        assert tr.feature_width == len(layers) * text.num_attention_heads
    # what the commands record of a checkpoint's config (collect, eval, vas) agrees
    assert text_sizes(model.config) == (len(layers), text.num_attention_heads)
    types = getattr(text, "layer_types", None) or []
    if model.config.model_type in HYBRID:  # the softmax layers only
        assert 0 < len(layers) < text.num_hidden_layers
        assert all(types[i] == "full_attention" for i in layers)
    else:
        assert layers == list(range(text.num_hidden_layers))


def test_logits_bitwise_and_regions_only_on_the_picture(case):
    model, _, recipe, rows = case
    inputs = batch_rows(recipe, rows)
    before = model.config.get_text_config(decoder=True)._attn_implementation
    with torch.no_grad():
        plain = model(**inputs).logits
        with Tracer(model, regions=2, vas=True) as tr:
            traced = model(**inputs).logits
            vas = tr.vas_features()
    assert torch.equal(plain, traced)
    assert vas.shape == (2, 36) and bool(torch.isfinite(vas).all())
    assert model.config.get_text_config(decoder=True)._attn_implementation == before
    assert not model._forward_pre_hooks
    is_image = inputs["input_ids"] == IMAGE_TOKEN
    rid = tr.region_ids.cpu()
    assert bool((rid[~is_image] == -1).all())
    markers = MARKERS.get(model.config.model_type, 0)
    for b in range(2):
        on_picture = int((rid[b] >= 0).sum())
        assert on_picture == int(is_image[b].sum()) - markers
        assert set(rid[b][rid[b] >= 0].tolist()) == {0, 1}
    assert tr.num_regions == [2, 2]


def test_marker_slots_are_those_the_pixels_do_not_reach(case):
    """An independent reading of the markers: the decoder inputs of a picture of other
    pixels differ at the picture's slots only."""
    model, _, recipe, rows = case
    inputs = batch_rows(recipe, rows[:1])
    with torch.no_grad(), Tracer(model, regions=1, vas=False) as tr:
        model(**inputs)
    (image,) = tr.images[0]
    assert len(image.markers) == MARKERS.get(model.config.model_type, 0)
    assert bool((tr.region_ids[0, image.markers] == -1).all())


def test_vas_equals_the_reference_on_eager_attentions(case):
    model, eager, recipe, rows = case
    inputs = batch_rows(recipe, rows)
    with torch.no_grad(), Tracer(model, vas=True) as tr:
        model(**inputs)
        feats = tr.vas_features()
    attns, writes = eager_reference(eager, inputs)
    assert len(attns) == len(_softmax_layers(model))
    want, _ = headscope.vas_features(attns, writes, inputs["attention_mask"], left_padding=True)
    torch.testing.assert_close(feats, want, atol=1e-4, rtol=1e-4)


def test_left_padded_batch_equals_rows_alone(case):
    model, _, recipe, rows = case
    inputs = batch_rows(recipe, rows)
    with torch.no_grad(), Tracer(model, regions=2, vas=True) as tr:
        model(**inputs)
        together = tr.vas_features()
        rid = tr.region_ids.cpu()
        alone = []
        for b, row in enumerate(rows):
            model(**batch_rows(recipe, [row]))
            alone.append(tr.vas_features()[0])
            T = row["input_ids"].shape[1]
            assert torch.equal(tr.region_ids[0].cpu(), rid[b, -T:])
    torch.testing.assert_close(together, torch.stack(alone), atol=1e-4, rtol=1e-4)


def test_generation_and_span_features_equal_region_pool(case):
    model, eager, recipe, rows = case
    inputs = batch_rows(recipe, rows)
    with torch.no_grad():
        plain = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        every2 = lambda ids: len(ids) % 2 == 0  # noqa: E731
        with Tracer(model, regions=2, vas=True, splitter=every2) as tr:
            spans = list(tr.generate(**inputs, max_new_tokens=NEW, do_sample=False,
                                     eos_token_id=None))
            final_vas = tr.vas_features()
    assert torch.equal(tr.sequences, plain)
    P = inputs["input_ids"].shape[1]
    assert sorted((s.batch_index, s.start, s.end) for s in spans) == \
        [(b, a, min(a + 2, NEW)) for b in range(2) for a in range(0, NEW, 2)]
    full = dict(inputs, input_ids=plain,
                attention_mask=torch.nn.functional.pad(inputs["attention_mask"], (0, NEW),
                                                       value=1))
    if "mm_token_type_ids" in inputs:
        full["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"],
                                                            (0, NEW))
    attns, writes = eager_reference(eager, full)
    rid = torch.nn.functional.pad(tr.region_ids, (0, NEW), value=-1)
    for s in spans:
        w = torch.zeros(2, P + NEW)
        w[:, P + s.start - 1:P + s.end - 1] = 1.0  # rows that predicted the span's tokens
        want = headscope.stack_layers([headscope.region_pool(a.float(), w, rid, 2)
                                       for a in attns])
        assert s.features.shape == (2, want.shape[-1]) == (2, tr.feature_width)
        torch.testing.assert_close(s.features, want[s.batch_index], atol=1e-5, rtol=1e-5)
    want_vas, _ = headscope.vas_features(attns, writes, full["attention_mask"],
                                         left_padding=True)
    torch.testing.assert_close(final_vas, want_vas, atol=1e-4, rtol=1e-4)


def test_region_effects_mask_ablation_is_exact_or_refused(case):
    from test_effects import SPANS, _reference_effects
    model, _, recipe, rows = case
    inputs = batch_rows(recipe, rows[:1])
    with torch.no_grad(), Tracer(model, regions=3, vas=False) as tr:
        list(tr.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None))
    sequences, rid = tr.sequences, tr.region_ids
    model_type = model.config.model_type
    if model_type in HYBRID:
        with pytest.raises(NotImplementedError, match=r"ablation='mask' removes a region's keys "
                                                      r"from softmax attention, but decoder "
                                                      r"layers \[0"):
            region_effects(model, inputs, sequences, SPANS, rid, progress=False)
        for ablation in ("zero", "mean"):  # the embeddings: every mixer sees them ablated
            effects = region_effects(model, inputs, sequences, SPANS, rid, ablation=ablation,
                                     progress=False)
            want = _reference_effects(model, inputs, sequences, rid, [[k] for k in range(3)],
                                      ablation)
            torch.testing.assert_close(effects, want, atol=2e-5, rtol=1e-4)
            assert effects.abs().max() > 1e-3
        return
    if model_type in UNBATCHED:
        with pytest.raises(NotImplementedError, match=UNBATCHED[model_type]):
            region_effects(model, inputs, sequences, SPANS, rid, progress=False)
        return
    effects = region_effects(model, inputs, sequences, SPANS, rid, progress=False)
    want = _reference_effects(model, inputs, sequences, rid, [[k] for k in range(3)], "mask")
    torch.testing.assert_close(effects, want, atol=2e-5, rtol=1e-4)
    assert effects.abs().max() > 1e-3


def test_grid_regions_need_a_layout():
    model, _, _ = _models("ovis2")
    with pytest.raises(ValueError, match=r"grid_regions needs each image token's place on the "
                                         r"picture, and no layout is known for model_type "
                                         r"'ovis2'"):
        Tracer(model, regions=grid_regions(2, 2))
    assert model.config.get_text_config(decoder=True)._attn_implementation == "sdpa"


# Mistral 4 comes wrapped in Mistral 3 (its text decoder under Mistral3's vision tower,
# patch merger and [IMG_BREAK] rows): the Mistral 3 family module reads its picture plane,
# and its MLA attention (latent keys, rope and no-rope parts) is traced like any other
MISTRAL4_TEXT = dict(model_type="mistral4", kv_lora_rank=16, q_lora_rank=None,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     num_key_value_heads=4)


def test_mistral_4_traces_through_the_mistral_3_family_under_the_contract():
    from headscope.hf.testing import image_prompt, tiny_model
    model = tiny_model("mistral3", text_overrides=MISTRAL4_TEXT)
    eager = tiny_model("mistral3", text_overrides=MISTRAL4_TEXT, attn_implementation="eager")
    assert type(family_of(model).decoder(model)).__name__ == "Mistral4Model"
    assert family_of(model).name == "mistral3"
    inputs = image_prompt(model, grids=((8, 8), (6, 4)), text_before=(3, 2), text_after=(5, 3))
    with torch.no_grad():
        plain = model(**inputs).logits
        gen = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        with Tracer(model, regions=grid_regions(2, 2), vas=True) as tr:
            assert torch.equal(model(**inputs).logits, plain)
            vas = tr.vas_features()
            spans = list(tr.generate(**inputs, max_new_tokens=NEW, do_sample=False,
                                     eos_token_id=None))
    assert tr.sequences.equal(gen) and tr.num_regions == [4, 4]
    attns, writes = eager_reference(eager, inputs)
    want, _ = headscope.vas_features(attns, writes, inputs["attention_mask"], left_padding=True)
    torch.testing.assert_close(vas, want, atol=1e-4, rtol=1e-4)
    P = inputs["input_ids"].shape[1]
    full = dict(inputs, input_ids=gen, attention_mask=torch.nn.functional.pad(
        inputs["attention_mask"], (0, NEW), value=1))
    attns, _ = eager_reference(eager, full)
    rid = torch.nn.functional.pad(tr.region_ids, (0, NEW), value=-1)
    for s in spans:
        w = torch.zeros(2, P + NEW)
        w[:, P + s.start - 1:P + s.end - 1] = 1.0
        pooled = headscope.stack_layers([headscope.region_pool(a.float(), w, rid, 4)
                                         for a in attns])
        torch.testing.assert_close(s.features, pooled[s.batch_index], atol=1e-5, rtol=1e-5)
