"""The family contract, on a tiny random model of every registered model type
(headscope.hf.families; a family's TinySpec picks its prompts' pictures and marks a contract
that cannot hold yet): the model's outputs are unchanged and it is restored on detach, VAS
features equal the reference implementation's extract_vas (or vas_features) on eager
attentions and per-head writes, span features equal region_pool on eager attentions of the
teacher-forced sequence and greedy tokens equal the untraced model's, batches with left
padding equal their rows alone, and tr.images places every image token on its picture.
The models of one model type and device are built once for all its tests."""
from __future__ import annotations

import pytest
import torch

import headscope
from conftest import DEVICES, load_seed

pytest.importorskip("transformers")
from headscope.hf import Tracer  # noqa: E402
from headscope.hf.families import FAMILIES, family_of  # noqa: E402
from headscope.hf.families.base import TYPE_INPUTS  # noqa: E402
from headscope.hf.structure import output_projection, softmax_attention_layers  # noqa: E402
from headscope.hf.testing import eager_reference, image_prompt, tiny_model, tiny_of  # noqa: E402

TYPES = TYPE_INPUTS  # per-position type inputs


def _cases():
    """Every registered model type, a strict xfail where its family's contract cannot hold
    yet (TinySpec.contract_xfail: the error expected and why)."""
    cases = []
    for family in FAMILIES:
        marks = ()
        if tiny_of(family).spec.contract_xfail is not None:
            error, reason = tiny_of(family).spec.contract_xfail
            marks = pytest.mark.xfail(raises=error, strict=True, reason=reason)
        cases += [pytest.param(t, marks=marks, id=t) for t in family.model_types]
    return cases


def continued(model, inputs, n):
    """The per-position type inputs of ``inputs`` continued over n generated tokens."""
    family = family_of(model)
    return {k: torch.nn.functional.pad(inputs[k], (0, n), value=family.answer_type(k))
            for k in TYPES if k in inputs}


def prompt(model, batch=1, seed=0):
    """A left-padded batch of ``batch`` prompts of one picture each (the family's
    TinySpec.grids), on the model's device."""
    grids = tiny_of(model).spec.grids[:batch]
    inputs = image_prompt(model, grids=grids, text_before=(3, 2)[:batch],
                          text_after=(5, 3)[:batch], seed=seed)
    return {k: v.to(model.device) for k, v in inputs.items()}


@pytest.fixture(scope="module", params=_cases())
def family(request):
    return request.param


@pytest.fixture(scope="module", params=DEVICES)
def models(family, request):
    """The same weights loaded with sdpa (the default) and with eager attention."""
    return (tiny_model(family).to(request.param),
            tiny_model(family, attn_implementation="eager").to(request.param))


def eager_run(model_eager, inputs):
    """Eager attentions and per-head writes (the o_proj inputs) of every decoder layer."""
    return eager_reference(model_eager, inputs)


# ---- forward ----------------------------------------------------------------------------

def test_logits_unchanged_and_model_restored(models):
    model, _ = models
    inputs = prompt(model, batch=2)
    before_impl = model.config.text_config._attn_implementation
    with torch.no_grad():
        ref = model(**inputs).logits
        with Tracer(model, regions=4, vas=True) as tr:
            assert model.config.text_config._attn_implementation == "headscope"
            traced = model(**inputs).logits
            tr.vas_features()
        after = model(**inputs).logits
    assert torch.equal(ref, traced)
    assert torch.equal(ref, after)
    assert model.config.text_config._attn_implementation == before_impl
    assert not model._forward_pre_hooks and not model.get_decoder()._forward_pre_hooks


def test_vas_features_equal_seed_on_eager_attentions(models):
    model, eager = models
    inputs = prompt(model, batch=1)
    with torch.no_grad(), Tracer(model, vas=True) as tr:
        model(**inputs)
        feats = tr.vas_features()
        stats = tr.vas_head_stats()
    _, attns, writes = eager_run(eager, inputs)
    # a hybrid decoder's softmax layers only
    L = len(softmax_attention_layers(family_of(model).decoder(model)))
    H = model.config.text_config.num_attention_heads
    assert feats.shape == (1, 36) and feats.dtype == torch.float32
    assert stats.shape == (1, L, H, 3)
    try:
        seed = load_seed("vas_reference")
    except pytest.skip.Exception:
        seed = None
    if seed is not None:
        cache = type("Cache", (), {"attn_weights": attns, "head_writes": writes})()
        want, cols = seed.extract_vas(None, inputs["input_ids"], inputs["attention_mask"], cache)
        assert cols == headscope.VAS_COLUMNS
        want = torch.from_numpy(want).to(feats.device)
    else:
        want, _ = headscope.vas_features(attns, writes, inputs["attention_mask"])
    torch.testing.assert_close(feats, want, atol=1e-4, rtol=1e-4)


def test_eager_base_uses_materialised_weights(models):
    model, eager = models
    inputs = prompt(model, batch=2)
    with torch.no_grad():
        with Tracer(model, vas=True) as tr:
            model(**inputs)
            via_qk = tr.vas_features()
        with Tracer(eager, vas=True) as tr:
            eager(**inputs)
            via_weights = tr.vas_features()
    torch.testing.assert_close(via_qk, via_weights, atol=1e-4, rtol=1e-4)


def test_residual_writes_equal_writes_through_o_proj(models):
    model, eager = models
    inputs = prompt(model, batch=1)
    with torch.no_grad(), Tracer(model, vas=True, writes="residual") as tr:
        model(**inputs)
        stats = tr.vas_head_stats()
    _, attns, writes = eager_run(eager, inputs)
    H = model.config.text_config.num_attention_heads
    lengths = inputs["attention_mask"].sum(-1)
    want = []
    for attention, A, O in zip(softmax_attention_layers(family_of(model).decoder(model)),
                               attns, writes):
        W = output_projection(attention).weight  # (hidden, H * Dh)
        Dh = W.shape[1] // H
        # each head's write into the residual stream, hidden wide: O_h W_O^h^T
        resid = torch.einsum("bhtd,ehd->bhte", O, W.reshape(W.shape[0], H, Dh))
        want.append(headscope.vas_head_stats(A, resid, lengths))
    torch.testing.assert_close(stats, torch.stack(want, 1), atol=2e-5, rtol=1e-4)


def rows_like_alone(model, inputs):
    """The rows of a left-padded batch whose model outputs equal the row's alone: all, but
    the first only where the model numbers a batch's pictures in order
    (TinySpec.batch_numbers_pictures); that the later rows do differ in the untraced model
    is checked, so the exception cannot outlive its cause."""
    if not tiny_of(model).spec.batch_numbers_pictures:
        return range(2)
    keep = inputs["attention_mask"][1].bool()
    with torch.no_grad():
        padded = model(**inputs).logits[1, keep]
        alone = model(**row_alone(model, inputs, 1)).logits[0]
    assert (padded - alone).abs().max() > 1e-4
    return range(1)


def test_left_padded_batch_equals_rows_alone(models):
    model, _ = models
    inputs = prompt(model, batch=2)
    same = rows_like_alone(model, inputs)
    with torch.no_grad(), Tracer(model, regions=4, vas=True) as tr:
        model(**inputs)
        batch_feats, batch_rid = tr.vas_features(), tr.region_ids
        for b in range(2):
            keep = inputs["attention_mask"][b].bool()
            row = row_alone(model, inputs, b)
            model(**row)
            if b in same:
                torch.testing.assert_close(tr.vas_features()[0], batch_feats[b], atol=1e-4,
                                           rtol=1e-4)
            assert torch.equal(tr.region_ids[0], batch_rid[b, keep])


def test_left_padded_generation_equals_rows_alone(models):
    model, _ = models
    inputs = prompt(model, batch=2)
    gen = dict(max_new_tokens=5, do_sample=False, eos_token_id=None)
    every2 = lambda ids: len(ids) % 2 == 0  # noqa: E731
    with Tracer(model, regions=3, vas=True, splitter=every2) as tr:
        batch_spans = list(tr.generate(**inputs, **gen))
        batch_vas = tr.vas_features()
        for b in rows_like_alone(model, inputs):
            keep = inputs["attention_mask"][b].bool()
            row = row_alone(model, inputs, b)
            alone = list(tr.generate(**row, **gen))
            assert torch.equal(tr.sequences[0, int(keep.sum()):],
                               inputs["input_ids"].new_tensor(
                                   [t for s in alone for t in s.token_ids.tolist()]))
            mine = [s for s in batch_spans if s.batch_index == b]
            assert [(s.start, s.end) for s in mine] == [(s.start, s.end) for s in alone]
            for x, y in zip(mine, alone):
                assert torch.equal(x.token_ids, y.token_ids)
                torch.testing.assert_close(x.features, y.features, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(tr.vas_features()[0], batch_vas[b], atol=1e-4, rtol=1e-4)


def _image_tokens(model, input_ids):
    ids = family_of(model).image_token_ids(model.config)
    return torch.isin(input_ids, torch.tensor(ids, device=input_ids.device))


def row_alone(model, inputs, b):
    """Row b of a left-padded batch of one image per row, without its padding."""
    keep = inputs["attention_mask"][b].bool()
    row = {k: v[b:b + 1][:, keep] for k, v in inputs.items()
           if k in ("input_ids", "attention_mask") + TYPES}
    pixels = inputs["pixel_values"]
    if "image_token_pooling" in inputs:  # crops' patches pooled by index (Molmo 2)
        crops, grids = inputs["image_num_crops"], inputs["image_grids"]
        tokens = (grids[:, :2].prod(-1) + grids[:, 2:].prod(-1)).tolist()
        first, start = sum(tokens[:b]), int(crops[:b].sum())
        pooled = inputs["image_token_pooling"][first:first + tokens[b]]
        shift = start * pixels.shape[1]  # the earlier pictures' patches
        return dict(row, pixel_values=pixels[start:start + int(crops[b])],
                    image_token_pooling=torch.where(pooled >= 0, pooled - shift, pooled),
                    image_grids=grids[b:b + 1], image_num_crops=crops[b:b + 1])
    if "target_sizes" in inputs:  # views' patches packed side by side (MiniCPM-V 4.6)
        views = [sum(len(image.views) for image in pictures)
                 for pictures in family_of(model).images(model.config, inputs)]
        patches = inputs["target_sizes"].prod(-1).tolist()
        first, last = sum(views[:b]), sum(views[:b + 1])
        width = pixels.shape[2]  # a patch's pixels along the packed dim
        start, end = sum(patches[:first]) * width, sum(patches[:last]) * width
        return dict(row, pixel_values=pixels[..., start:end],
                    target_sizes=inputs["target_sizes"][first:last])
    if "image_grid_thw" not in inputs and len(pixels) == len(inputs["input_ids"]):
        # every picture input has one item per picture
        return dict(row, **{k: v[b:b + 1] for k, v in inputs.items() if k not in row})
    if "image_grid_thw" not in inputs:  # tiles of equal token counts (InternVL), in order
        tokens = _image_tokens(model, inputs["input_ids"]).sum(-1).tolist()
        per_token = len(pixels) / sum(tokens)
        start, count = round(sum(tokens[:b]) * per_token), round(tokens[b] * per_token)
        return dict(row, pixel_values=pixels[start:start + count])
    sizes = inputs["image_grid_thw"].prod(-1).tolist()
    start = sum(sizes[:b])
    return dict(row, pixel_values=inputs["pixel_values"][start:start + sizes[b]],
                image_grid_thw=inputs["image_grid_thw"][b:b + 1])




# ---- generation ---------------------------------------------------------------------------

def test_generate_same_tokens_and_span_features_equal_region_pool(models):
    model, eager = models
    inputs = prompt(model, batch=2)
    plain = model.generate(**inputs, max_new_tokens=7, do_sample=False, eos_token_id=None)
    every3 = lambda ids: len(ids) % 3 == 0  # noqa: E731
    with Tracer(model, regions=4, vas=True, splitter=every3) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=7, do_sample=False,
                                 eos_token_id=None))
        prompt_rid = tr.region_ids
        K = tr.num_regions
        final_vas = tr.vas_features()
    assert torch.equal(tr.sequences, plain)
    P = inputs["input_ids"].shape[1]
    for b in range(2):
        mine = [s for s in spans if s.batch_index == b]
        assert [(s.start, s.end) for s in mine] == [(0, 3), (3, 6), (6, 7)]
        assert torch.equal(torch.cat([s.token_ids for s in mine]), plain[b, P:])
    # teacher-forced eager run of the final sequence
    dev = model.device
    full = dict(inputs, input_ids=plain,
                attention_mask=torch.cat([inputs["attention_mask"],
                                          torch.ones(2, 7, dtype=torch.int64, device=dev)], 1))
    full.update(continued(model, inputs, 7))
    _, attns, writes = eager_run(eager, full)
    rid = torch.nn.functional.pad(prompt_rid, (0, 7), value=-1)
    for s in spans:
        w = torch.zeros(2, P + 7, device=dev)
        w[:, P + s.start - 1:P + s.end - 1] = 1.0  # rows that predicted the span's tokens
        want = headscope.stack_layers(
            [headscope.region_pool(a.float(), w, rid, max(K)) for a in attns])
        assert s.features.shape == (K[s.batch_index], want.shape[-1])
        assert s.features.device.type == "cpu"
        torch.testing.assert_close(s.features, want[s.batch_index, :K[s.batch_index]].cpu(),
                                   atol=1e-5, rtol=1e-5)
    want_vas, _ = headscope.vas_features(attns, writes, full["attention_mask"], left_padding=True)
    torch.testing.assert_close(final_vas, want_vas, atol=1e-4, rtol=1e-4)


# ---- the image plane ----------------------------------------------------------------------

def test_images_give_every_image_tokens_place_on_the_picture(models):
    """tr.images: per row, each picture's views; every image token is in exactly one view,
    every other position has region -1, each token's box lies in its view's box and the
    views' boxes tile the picture's area; grid_regions(2, 2) puts each token in the
    quarter holding its box's centre."""
    from headscope.hf import grid_regions
    model, _ = models
    inputs = prompt(model, batch=2)
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
    is_image = _image_tokens(model, inputs["input_ids"])
    assert len(tr.images) == inputs["input_ids"].shape[0]
    for b, pictures in enumerate(tr.images):
        seen = torch.cat([p.positions for p in pictures])
        markers = torch.cat([p.markers for p in pictures])  # at image-token positions
        assert sorted(seen.tolist() + markers.tolist()) == \
            is_image[b].nonzero().flatten().tolist()
        assert (tr.region_ids[b][~is_image[b]] == -1).all()
        assert (tr.region_ids[b][markers] == -1).all()
        for picture in pictures:
            area = 0.0
            for view in picture.views:
                x0, y0, x1, y1 = view.box
                boxes = view.boxes
                assert boxes.shape == (view.rows * view.cols, 4)
                assert (boxes[:, 0] >= x0 - 1e-12).all() and (boxes[:, 2] <= x1 + 1e-12).all()
                assert (boxes[:, 1] >= y0 - 1e-12).all() and (boxes[:, 3] <= y1 + 1e-12).all()
                assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
                area += float(((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).sum())
            assert area >= 1 - 1e-9  # at least one covering of the whole picture
            centre = (picture.boxes[:, :2] + picture.boxes[:, 2:]) / 2
            quarter = (centre[:, 1] >= 0.5).long() * 2 + (centre[:, 0] >= 0.5).long()
            got = tr.region_ids[b, picture.positions] - tr.region_ids[b, picture.positions].min()
            assert torch.equal(got.cpu(), quarter)
