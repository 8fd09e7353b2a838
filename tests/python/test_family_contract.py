"""The family contract, on a tiny random model of every registered model type
(headscope.hf.families; a family's TinySpec picks its prompts' pictures and marks a contract
that cannot hold yet): the model's outputs are unchanged and it is restored on detach, VAS
features equal the reference implementation's extract_vas (or vas_features) on eager
attentions and per-head writes (each head's block of the output projection's input, after
an output gate), span features equal region_pool on eager attentions of the teacher-forced
sequence and greedy tokens equal the untraced model's, batches with left padding equal
their rows alone, and tr.images places every image token on its picture. In bfloat16 and
float16: logits unchanged bit for bit, and VAS and span features equal to their float64
definitions on the very q, k and writes the model formed, within the bound of the ops'
float32 arithmetic (headscope.hf.testing.precision).
The models of one model type and device are built once for all its tests."""
from __future__ import annotations

import copy
import sys

import pytest
import torch

import headscope
from conftest import DEVICES, load_seed

pytest.importorskip("transformers")
from headscope.hf import Tracer  # noqa: E402
from headscope.hf.families import FAMILIES, family_of  # noqa: E402
from headscope.hf.families.base import TYPE_INPUTS  # noqa: E402
from headscope.hf.structure import output_projection, softmax_attention_layers  # noqa: E402
from headscope.hf.testing import (eager_reference, image_prompt, tiny_model,  # noqa: E402
                                  tiny_of, video_prompt)
from headscope.hf.testing.precision import (assert_within, step_masses64,  # noqa: E402
                                            vas_head_stats64)
from headscope.hf.testing.reference import GATED, recorded_attention  # noqa: E402

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
    if prompt is video_contract_prompt:  # one video per row: the processor on row b alone
        return video_contract_prompt(model, len(inputs["input_ids"]), row=b)
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


# ---- a video prompt: the same contract ------------------------------------------------------

def video_contract_prompt(model, batch=1, seed=0, row=None):
    """A left-padded batch of ``batch`` prompts of one video each (the family's
    TinySpec.clips: an odd and an even number of frames where the model takes them),
    laid out by the family's real tiny processor, on the model's device, as the model
    takes them (the processor's video_metadata left out); ``row``: that row alone."""
    spec = tiny_of(model).spec
    if spec.video is None:
        pytest.skip(f"the {model.config.model_type} family reads no video")
    inputs = video_prompt(model, spec.clips[:batch], seed=seed,
                          rows=None if row is None else [row])
    inputs = family_of(model).model_inputs(inputs)
    return {k: v.to(model.device) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}


@pytest.fixture
def on_video(monkeypatch):
    """The contract's tests run on prompts of one video per row instead of one picture."""
    monkeypatch.setattr(sys.modules[__name__], "prompt", video_contract_prompt)


def test_video_logits_unchanged_and_model_restored(models, on_video):
    test_logits_unchanged_and_model_restored(models)


def test_video_vas_features_equal_seed_on_eager_attentions(models, on_video):
    test_vas_features_equal_seed_on_eager_attentions(models)


def test_video_eager_base_uses_materialised_weights(models, on_video):
    test_eager_base_uses_materialised_weights(models)


def test_video_left_padded_batch_equals_rows_alone(models, on_video):
    test_left_padded_batch_equals_rows_alone(models)


def test_video_left_padded_generation_equals_rows_alone(models, on_video):
    test_left_padded_generation_equals_rows_alone(models)


def test_video_generate_same_tokens_and_span_features_equal_region_pool(models, on_video):
    test_generate_same_tokens_and_span_features_equal_region_pool(models)


def test_videos_give_every_video_tokens_place_in_space_and_time(models, on_video):
    """tr.videos: per row, its video's frame groups; every video token is in exactly one
    group's view (or a marker), every other position has region -1; Ward regions over
    space and time number the row's regions from 0; grid_regions(2, 2) puts each token
    in its group's quarter holding its box's centre."""
    from headscope.hf import grid_regions
    model, _ = models
    inputs = prompt(model, batch=2)
    family = family_of(model)
    ids = inputs["input_ids"]
    # every image or video token of a prompt of videos is a video's (GLM's frames are image
    # tokens)
    media = [*family.image_token_ids(model.config), *family.video_token_ids(model.config)]
    is_video = torch.isin(ids, torch.tensor(media, device=ids.device))
    for regions in (4, grid_regions(2, 2)):
        with torch.no_grad(), Tracer(model, regions=regions, vas=False) as tr:
            model(**inputs)
        assert tr.images == [[], []] and [len(row) for row in tr.videos] == [1, 1]
        for b, (video,) in enumerate(tr.videos):
            placed = torch.cat([video.positions, video.markers]).sort().values
            assert torch.equal(placed, is_video[b].nonzero().flatten().cpu())
            assert len(set(video.positions.tolist())) == len(video.positions)
            rid = tr.region_ids[b].cpu()
            assert bool((rid[~is_video[b].cpu()] == -1).all()) and bool((rid[video.markers] == -1).all())
            got = rid[video.positions]
            if isinstance(regions, int):
                assert sorted(set(got.tolist())) == list(range(regions)) == \
                    list(range(tr.num_regions[b]))
                continue
            centre = (video.boxes[:, :2] + video.boxes[:, 2:]) / 2
            quarter = (centre[:, 1] >= 0.5).long() * 2 + (centre[:, 0] >= 0.5).long()
            group = torch.cat([torch.full((len(g.image.positions),), i)
                               for i, g in enumerate(video.groups)])
            assert torch.equal(got, group * 4 + quarter)
            assert tr.num_regions[b] == 4 * len(video.groups)


# ---- what a head writes -------------------------------------------------------------------

def test_vas_equals_its_float64_definition_on_what_o_proj_reads(models):
    """float32: each head's VAS statistics equal their float64 definition on the q, k and
    writes the model formed, each head's write read at o_proj's input, within the bound of
    the ops' float32 arithmetic, and the features the same to the contract's 1e-4; on a
    gated family the writes before the gate (the attention call's output) are off by more
    than ten times that."""
    model, _ = models
    inputs = prompt(model, batch=1)
    with torch.no_grad(), recorded_attention(model) as calls, Tracer(model, vas=True) as tr:
        model(**inputs)
        stats, feats = tr.vas_head_stats(), tr.vas_features()
    want, bound = vas_head_stats64(calls, inputs["attention_mask"])
    assert_within(stats, want, bound, "VAS in float32")
    torch.testing.assert_close(feats, headscope.vas_aggregate(want.float()), atol=1e-4,
                               rtol=1e-4)
    if model.config.model_type in GATED:
        for call in calls:
            call.writes = call.output.transpose(1, 2)
        ungated, _ = vas_head_stats64(calls, inputs["attention_mask"])
        off = (headscope.vas_aggregate(ungated.float()) - feats).abs()
        assert bool((off > 10 * (1e-4 + 1e-4 * feats.abs())).any())  # 10x the tolerance


def test_what_lies_between_attention_and_output_projection(models):
    _, eager = models
    inputs = prompt(eager, batch=1)
    decoder = family_of(eager).decoder(eager)
    H = decoder.config.num_attention_heads
    gates = []
    hooks = [m.q_proj.register_forward_hook(
        lambda module, args, out: gates.append(out.unflatten(-1, (H, -1)).chunk(2, -1)[1]))
        for m in softmax_attention_layers(decoder) if eager.config.model_type in GATED]
    try:
        with torch.no_grad(), recorded_attention(eager) as calls:
            eager(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(calls) == len(softmax_attention_layers(decoder))
    for i, call in enumerate(calls):
        written = call.writes.transpose(1, 2)  # (B, T, H, Dh)
        if gates:
            torch.testing.assert_close(written, call.output * torch.sigmoid(gates[i]))
            assert (written - call.output).abs().max() > 1e-2 * call.output.abs().max()
        else:
            assert torch.equal(written, call.output)


# ---- half precision -----------------------------------------------------------------------

LOW = (torch.bfloat16, torch.float16)

# float16 on one model type per attention layout (the suite's time in CI): causal with
# multimodal rotary, sliding windows with a bidirectional image block, a soft cap over a
# bidirectional prefix, a gated hybrid decoder, MLA (q and k wider than the writes)
FLOAT16 = {"qwen2_vl", "gemma3", "paligemma", "qwen3_5", "kimi_k25"}


@pytest.fixture(scope="module", params=LOW, ids=[str(d)[6:] for d in LOW])
def low_models(family, models, request):
    """The contract's models with their weights rounded to bfloat16 (every model type) or
    float16 (:data:`FLOAT16`)."""
    if request.param is torch.float16 and family not in FLOAT16:
        pytest.skip("float16 runs on one model type per attention layout (FLOAT16)")
    return tuple(copy.deepcopy(m).to(request.param) for m in models)


def test_low_precision_logits_bitwise_and_vas_within_its_bound(low_models):
    """On sdpa the Tracer recomputes each layer's probabilities from q and k; on eager it
    reads the weights the model formed; each against float64 on those same tensors, and
    the eager weights, which the model rounded to its dtype, against the float64 softmax
    of their q and k within a bound of that dtype's unit roundoff."""
    for model in low_models:
        inputs = prompt(model, batch=2)
        with torch.no_grad():
            plain = model(**inputs).logits
            with recorded_attention(model) as calls, Tracer(model, regions=4, vas=True) as tr:
                traced = model(**inputs).logits
                stats = tr.vas_head_stats()
        assert torch.equal(plain, traced)
        assert len(calls) == tr.num_layers and all(c.writes is not None for c in calls)
        assert {c.query.dtype for c in calls} == {c.writes.dtype for c in calls} == {model.dtype}
        want, bound = vas_head_stats64(calls, inputs["attention_mask"])
        impl = model.config.get_text_config(decoder=True)._attn_implementation
        assert_within(stats, want, bound, f"VAS on {impl}")
        if calls[0].weights is not None:
            exact, exact_bound = vas_head_stats64(calls, inputs["attention_mask"], exact=True)
            assert_within(stats, exact, exact_bound, "VAS of eager weights against float64",
                          fine=False)
        if model.config.model_type in GATED:  # the bound tells the gated write from the other
            for call in calls:
                call.writes = call.output.transpose(1, 2)
            ungated, _ = vas_head_stats64(calls, inputs["attention_mask"])
            assert bool(((ungated - want).abs() > bound).any())


def test_low_precision_generation_and_span_features_within_their_bound(low_models):
    """Greedy tokens are plain generate's; each span's features (on sdpa: the Tracer
    recomputes the probabilities of its rows from q and k) against the float64 masses of
    the recorded q and k, within their bound."""
    model, _ = low_models
    inputs = prompt(model, batch=2)
    N = 4
    plain = model.generate(**inputs, max_new_tokens=N, do_sample=False, eos_token_id=None)
    every2 = lambda ids: len(ids) % 2 == 0  # noqa: E731
    with torch.no_grad(), recorded_attention(model) as calls, \
            Tracer(model, regions=3, vas=False, splitter=every2) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=N, do_sample=False,
                                 eos_token_id=None))
    assert torch.equal(tr.sequences, plain)
    assert {c.query.dtype for c in calls} == {c.key.dtype for c in calls} == {model.dtype}
    masses, bounds = step_masses64(calls, tr.num_layers, inputs["input_ids"].shape[1],
                                   tr.region_ids, max(tr.num_regions))
    assert len(masses) == N and len(spans) == 2 * N // 2
    for s in spans:
        K = tr.num_regions[s.batch_index]
        rows = slice(s.start, s.end)
        assert_within(s.features, masses[rows, s.batch_index, :K].mean(0),
                      bounds[rows, s.batch_index, :K].mean(0), f"span {s.start}-{s.end}")
