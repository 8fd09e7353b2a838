"""The transformers integration (headscope.hf.Tracer) on tiny randomly initialised VLMs,
beyond the family contract every registered family passes (test_family_contract.py):
region forms and errors, span splitting and folding, value-norm-weighted features, and the
span stream neither drops, hangs nor leaks."""
from __future__ import annotations

import re
import threading
import warnings

import pytest
import torch

import headscope

pytest.importorskip("transformers")
from headscope.hf import Span, Tracer  # noqa: E402
from headscope.hf.testing import EOS, eager_reference, image_prompt, tiny_model  # noqa: E402
from test_family_contract import continued as _continued  # noqa: E402
from test_family_contract import prompt as _prompt  # noqa: E402
from test_family_contract import row_alone as _row_alone  # noqa: E402


# ---- regions ------------------------------------------------------------------------------

def test_region_forms_and_several_images():
    model = tiny_model("qwen2_vl")
    two = image_prompt(model, grids=((4, 4),), text_before=(2,), text_after=(2,))
    # two images in one prompt: the second image's tokens follow the first's
    one_ids = two["input_ids"][0]
    image = one_ids == model.config.image_token_id
    ids = torch.cat([one_ids, one_ids[image.nonzero().min() - 1:]])[None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": (ids == model.config.image_token_id).int(),
              "pixel_values": torch.cat([two["pixel_values"]] * 2),
              "image_grid_thw": torch.cat([two["image_grid_thw"]] * 2)}
    labels = torch.tensor([0, 0, 1, 1])
    seen = []

    def by_column(features, grid):
        seen.append((tuple(features.shape), grid))
        return torch.arange(grid[0] * grid[1]) % grid[1]

    with torch.no_grad():
        for regions, K in ((labels, 2), (by_column, 2), (3, 3)):
            with Tracer(model, regions=regions, vas=False) as tr:
                model(**inputs)
            rid = tr.region_ids[0]
            positions = (ids[0] == model.config.image_token_id).nonzero().flatten()
            assert bool((rid[ids[0] != model.config.image_token_id] == -1).all())
            first, second = rid[positions[:4]], rid[positions[4:]]
            assert set(first.tolist()) == set(range(K))
            assert torch.equal(second, first + K) if regions is not None and K != 3 \
                else set(second.tolist()) == set(range(K, 2 * K))
            assert tr.num_regions == [2 * K]
    assert seen == [((4, model.config.text_config.hidden_size), (2, 2))] * 2


@pytest.mark.parametrize("bad, error", [
    ("four", TypeError), (True, TypeError), (torch.tensor([0, 1]), ValueError),
    (lambda f, g: torch.zeros(3, dtype=torch.int64), ValueError), (100, ValueError)])
def test_bad_regions_raise(bad, error):
    model = tiny_model("qwen2_vl")
    inputs = _prompt(model)
    with pytest.raises(error, match="headscope.hf.Tracer"):
        with Tracer(model, regions=bad, vas=False):
            with torch.no_grad():
                model(**inputs)
    assert model.config.text_config._attn_implementation == "sdpa"


# ---- generation ---------------------------------------------------------------------------

def _no_eos(model):
    model.generation_config.eos_token_id = None
    return model


def test_generation_keeps_only_the_open_spans_query_rows():
    """Query rows are kept for pooling until every row's span that needs them has ended:
    memory stays bounded by the longest open span, not the answer."""
    model = tiny_model("qwen2_vl")
    inputs = _prompt(model, batch=2)
    held = []
    with Tracer(model, regions=2, vas=False) as tr:
        def every3(ids):
            held.append(tr.rows.held_rows())
            return len(ids) % 3 == 0
        tr.splitter = every3
        spans = list(tr.generate(**inputs, max_new_tokens=12, do_sample=False,
                                 eos_token_id=None))
    assert len(spans) == 8 and max(held) == 3 and min(held) == 1


def _host_syncs(run) -> int:
    """The host synchronisations ``run()`` makes, as CUDA's sync debug mode counts them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing" in str(w.message) for w in seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: no GPU on this machine")
def test_on_cuda_a_traced_decode_step_synchronises_the_host_no_more_than_plain_generate():
    """Per decode step (one open span, pooled as it grows), the tracer adds no host
    synchronisation to generate's own: the difference of two answer lengths is counted, so
    the prefill's and the span end's are left out."""
    model = _no_eos(tiny_model("qwen2_vl")).cuda()
    inputs = _prompt(model).to("cuda")

    def plain(n):
        model.generate(**inputs, max_new_tokens=n, do_sample=False)

    def traced(n):
        with Tracer(model, regions=2) as tr:
            tr.splitter = lambda ids: False
            assert len(list(tr.generate(**inputs, max_new_tokens=n, do_sample=False))) == 1

    def per_step(generate):
        return (_host_syncs(lambda: generate(12)) - _host_syncs(lambda: generate(4))) / 8

    plain_step, traced_step = per_step(plain), per_step(traced)
    assert plain_step > 0, "sync debug mode saw none of generate's own synchronisations"
    assert traced_step <= plain_step, (traced_step, plain_step)


@pytest.mark.parametrize("features", ["attention", "both"])
def test_long_spans_are_folded_into_running_sums_exactly(monkeypatch, features):
    """Past FOLD rows per layer the held rows are pooled into each open span's running sum:
    a span that never ends holds at most FOLD rows, and every span's features equal those
    pooled from all its rows at once (spans of different lengths in a left-padded batch,
    folds falling inside and across them; value-norm weighted columns too)."""
    from headscope.hf.rows import SpanRows
    model = tiny_model("qwen2_vl")
    inputs = _prompt(model, batch=2)
    every = {0: 7, 1: 3}
    gen = dict(max_new_tokens=17, do_sample=False, eos_token_id=None)

    def spans_with(fold):
        monkeypatch.setattr(SpanRows, "FOLD", fold)
        held = []
        with Tracer(model, regions=3, vas=False, features=features) as tr:
            def splitter(ids):
                held.append(tr.rows.held_rows())
                return len(ids) % every[len(held) % 2] == 0
            tr.splitter = splitter
            return list(tr.generate(**inputs, **gen)), max(held)

    whole, _ = spans_with(10 ** 9)
    folded, most = spans_with(4)
    assert most <= 4 + 1  # the rows of at most FOLD steps and the current one
    assert [(s.batch_index, s.start, s.end) for s in folded] == \
        [(s.batch_index, s.start, s.end) for s in whole]
    assert max(s.end - s.start for s in whole) > 4  # some span was folded
    for a, b in zip(folded, whole):
        torch.testing.assert_close(a.features, b.features, rtol=1e-5, atol=1e-6)


def test_spans_cover_every_token_with_eos_and_sentence_splitter():
    model = tiny_model("qwen2_vl")
    inputs = _prompt(model, batch=2)

    class Tok:
        def decode(self, ids):
            return "".join("." if i % 5 == 0 else "w" for i in ids)

    plain = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    with Tracer(model, regions=2, vas=False, tokenizer=Tok()) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=12, do_sample=False))
    assert torch.equal(tr.sequences, plain)
    P = inputs["input_ids"].shape[1]
    for b in range(2):
        answer = plain[b, P:].tolist()
        if EOS in answer:
            answer = answer[:answer.index(EOS) + 1]
        mine = [s for s in spans if s.batch_index == b]
        assert mine[0].start == 0 and mine[-1].end == len(answer)
        assert all(x.end == y.start for x, y in zip(mine, mine[1:]))
        assert sum((s.token_ids.tolist() for s in mine), []) == answer
        for s in mine[:-1]:
            assert s.token_ids[-1] % 5 == 0  # ended by a token whose text ends with '.'
        assert all(s.text == Tok().decode(s.token_ids.tolist()) for s in mine)


def test_span_special_marks_spans_of_special_tokens_only():
    model = tiny_model("qwen2_vl")
    inputs = _prompt(model, batch=2)
    plain = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None)
    answer = plain[0, inputs["input_ids"].shape[1]:].tolist()
    # an end-of-sequence id the tiny model does generate, and another token for a tokenizer
    eos = answer[3]
    other = next(t for t in answer if t != eos)

    class Tok:
        all_special_ids = [other]

        def decode(self, ids):
            return "w" * len(ids)

    # one span per token; without a tokenizer the end-of-sequence ids are the special ones
    for tokenizer, special in ((None, {eos}), (Tok(), {other})):
        with Tracer(model, regions=2, vas=False, tokenizer=tokenizer,
                    splitter=lambda ids: True) as tr:
            spans = list(tr.generate(**inputs, max_new_tokens=12, do_sample=False,
                                     eos_token_id=eos))
        assert all(len(s.token_ids) == 1 for s in spans)
        assert [s.special for s in spans] == [s.token_ids[0].item() in special for s in spans]
        assert any(s.special for s in spans) and not all(s.special for s in spans)


def test_head_scores_spans():
    model = tiny_model("qwen2_vl")
    L, H = 2, 4
    head = headscope.AttributionHead(L, H)
    with torch.no_grad():
        head.weight.copy_(torch.randn(L * H))
    with Tracer(model, regions=3, vas=False, head=head) as tr:
        spans = list(tr.generate(**_prompt(model), max_new_tokens=4, do_sample=False))
    assert spans and all(isinstance(s, Span) for s in spans)
    for s in spans:
        torch.testing.assert_close(s.scores, head(s.features))
    with pytest.raises(ValueError, match="fitted for L=3"):
        Tracer(model, head=headscope.AttributionHead(3, H))


# ---- value-norm-weighted features (Tracer(features=...)) ---------------------------------

def _value_norm_reference(model_eager, inputs, rid, rows: slice, K):
    """(B, K, L*H) float64 features of ``Tracer(features="attention*value_norm")`` without
    headscope: each layer's eager attentions times ``||W_O^h v_j||`` (the values from its
    v_proj, the head's columns of o_proj), summed over each region's keys and averaged over
    the query rows ``rows`` (a range of positions). One row without padding: transformers'
    float64 eager attention turns a left-padded row into NaN."""
    from headscope.hf.families import family_of
    layers = family_of(model_eager).decoder(model_eager).layers
    values, hooks = [], []
    for layer in layers:
        hooks.append(layer.self_attn.v_proj.register_forward_hook(
            lambda module, args, out: values.append(out)))
    try:
        _, attns, _ = eager_reference(model_eager, inputs)
    finally:
        for h in hooks:
            h.remove()
    regions = torch.nn.functional.one_hot(rid.clamp(min=0), K).double() * (rid >= 0)[..., None]
    features = []
    for layer, a, v in zip(layers, attns, values):
        W = layer.self_attn.o_proj.weight.double()                 # (hidden, H*Dh)
        B, H, T = a.shape[:3]
        Wh = W.reshape(W.shape[0], H, -1)                          # (hidden, H, Dh)
        v = v.double().reshape(B, T, -1, Wh.shape[2])               # (B, T, Hkv, Dh)
        v = v.repeat_interleave(H // v.shape[2], dim=2)             # head h reads h // G
        norms = torch.linalg.vector_norm(torch.einsum("ohd,bthd->bhto", Wh, v), dim=-1)
        features.append(torch.einsum("bhqt,bht,btk->bkh", a[:, :, rows].double(), norms,
                                     regions) / (rows.stop - rows.start))
    return torch.cat(features, dim=-1)


# causal; sliding + full; chunked + full (test_families_patterns.VARIANTS: LLaVA on Llama 4's
# text decoder)
@pytest.mark.parametrize("family_name", ["qwen2_vl", "gemma3", "llava_llama4_chunked"])
def test_value_norm_span_features_equal_eager_float64_reference(family_name):
    """Span features with features="attention*value_norm" equal eager attentions times the
    value norms of the model's own value projections, in float64; "both" is the attention
    block (the default tracer's features, bit for bit) then that one. Gemma 3's sliding
    and Llama 4's chunked layers are pooled at each step against the keys their cache still
    holds, over spans that outgrow the window or cross chunks. Three layers: Gemma 3's
    projector starts at zero, so its image tokens enter the first layer as zeros (value
    norm 0) and only the third layer is a sliding one that sees them otherwise."""
    from test_families_patterns import VARIANTS
    family_name, text = VARIANTS.get(family_name, (family_name, None))
    L, H = 3, 4
    model = tiny_model(family_name, layers=L, heads=H, text_overrides=text)
    eager = tiny_model(family_name, layers=L, heads=H, attn_implementation="eager",
                       dtype=torch.float64, text_overrides=text)
    inputs = _prompt(model, batch=2)
    n = 10
    gen = dict(max_new_tokens=n, do_sample=False, eos_token_id=None)
    every4 = lambda ids: len(ids) % 4 == 0  # noqa: E731
    spans = {}
    for features in ("attention", "attention*value_norm", "both"):
        with Tracer(model, regions=4, vas=False, splitter=every4, features=features) as tr:
            spans[features] = list(tr.generate(**inputs, **gen))
            prompt_rid, K = tr.region_ids, max(tr.num_regions)
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if window is not None:  # the window hides prompt keys from the spans' rows
        assert inputs["input_ids"].shape[1] > window
    P = inputs["input_ids"].shape[1]
    full = dict(inputs, input_ids=tr.sequences, pixel_values=inputs["pixel_values"].double(),
                attention_mask=torch.nn.functional.pad(inputs["attention_mask"], (0, n),
                                                       value=1))
    full.update(_continued(model, inputs, n))
    rid = torch.nn.functional.pad(prompt_rid, (0, n), value=-1)
    # the last layer whose span rows see image keys: chunked layers see only the answer's
    # chunks, past the image
    types = getattr(model.config.get_text_config(), "layer_types", None) or [""] * L
    seeing = max(layer for layer in range(L) if types[layer] != "chunked_attention")
    weighted = spans["attention*value_norm"]
    assert [(s.batch_index, s.start, s.end) for s in weighted] == \
        [(b, 0, 4) for b in range(2)] + [(b, 4, 8) for b in range(2)] + \
        [(b, 8, 10) for b in range(2)]
    for s, plain, both in zip(weighted, spans["attention"], spans["both"]):
        b, k = s.batch_index, tr.num_regions[s.batch_index]
        keep = full["attention_mask"][b].bool()
        start = P - int((~keep).sum())  # the row's prompt length without its padding
        rows = slice(start + s.start - 1, start + s.end - 1)  # rows that predicted the span
        want = _value_norm_reference(eager, _row_alone(model, full, b), rid[b:b + 1, keep],
                                     rows, K)[0]
        assert s.features.shape == plain.features.shape == (k, L * H)
        torch.testing.assert_close(s.features.double(), want[:k], atol=1e-5, rtol=1e-5)
        if s.start == 0:  # that layer's rows saw image keys (in Gemma's window too)
            assert s.features[:, seeing * H:(seeing + 1) * H].abs().max() > 1e-3
        assert not torch.allclose(s.features, plain.features, atol=1e-3)  # norms matter
        assert both.features.shape == (k, 2 * L * H)
        assert torch.equal(both.features, torch.cat([plain.features, s.features], dim=1))


def test_features_option_checks_its_value_and_the_heads_feature_set():
    model = tiny_model("qwen2_vl")
    L, H = 2, 4
    for bad in ("value_norm", 3, "Both"):
        with pytest.raises(ValueError, match=r"argument 'features' must be one of 'attention', "
                                             r"'attention\*value_norm', 'both', got"):
            Tracer(model, features=bad)
    for fitted, asked in (("attention", "both"), ("both", "attention"),
                          ("attention*value_norm", "attention")):
        head = headscope.AttributionHead(L, H, feature_set=fitted)
        with pytest.raises(ValueError, match=re.escape(
                f"head was fitted on feature set '{fitted}' but features='{asked}' was "
                f"passed; leave 'features' out")):
            Tracer(model, regions=2, head=head, features=asked)
    # a plain callable is checked on the width of the feature set
    with pytest.raises(ValueError, match=r"'head' must map features \(K, 2\*L\*H = 16\)"):
        Tracer(model, regions=2, head=torch.nn.Linear(L * H, 1), features="both")
    assert model.config.text_config._attn_implementation == "sdpa"  # none stayed bound
    # without features=, the tracer computes the head's own set; the same set passed
    # explicitly is no conflict
    for fitted, blocks in (("both", 2), ("attention*value_norm", 1)):
        head = headscope.AttributionHead(L, H, feature_set=fitted)
        with torch.no_grad():
            head.weight.copy_(torch.randn(blocks * L * H))
        for explicit in ({}, {"features": fitted}):
            with Tracer(model, regions=3, vas=False, head=head, **explicit) as tr:
                assert tr.features == fitted and tr.feature_width == blocks * L * H
                spans = list(tr.generate(**_prompt(model), max_new_tokens=4, do_sample=False))
            assert spans
            for s in spans:
                assert s.features.shape[1] == blocks * L * H
                torch.testing.assert_close(s.scores, head(s.features))
    assert Tracer(model, regions=2).features == "attention"  # no head: plain attention


def test_bfloat16_model():
    model = tiny_model("qwen2_vl", dtype=torch.bfloat16)
    inputs = _prompt(model, batch=2)
    with torch.no_grad():
        ref = model(**inputs).logits
    with Tracer(model, regions=3, vas=True) as tr:
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, ref)
        feats = tr.vas_features()
        spans = list(tr.generate(**inputs, max_new_tokens=3, do_sample=False))
    assert torch.isfinite(feats).all()
    assert len(spans) == 2 and all(torch.isfinite(s.features).all() for s in spans)


# ---- the span stream: pausing, errors, interruption -----------------------------------------

def test_generation_pauses_while_the_loop_body_runs():
    model = _no_eos(tiny_model("qwen2_vl"))
    steps = []
    with Tracer(model, regions=2, vas=False, splitter=_counting_splitter(steps)) as tr:
        got, grad_in_body = [], []
        for span in tr.generate(**_prompt(model), max_new_tokens=6, do_sample=False):
            assert len(steps) == span.end  # generation did not run ahead of the loop
            grad_in_body.append(torch.is_grad_enabled())
            got.append((span.start, span.end))
        assert got == [(i, i + 1) for i in range(6)]
        # the loop keeps its own grad mode although generate runs under no_grad
        assert grad_in_body == [True] * 6 and torch.is_grad_enabled()
        with torch.no_grad():
            for span in tr.generate(**_prompt(model), max_new_tokens=2, do_sample=False):
                assert not torch.is_grad_enabled()
        assert torch.is_grad_enabled()


def test_model_hook_is_off_during_generation_and_back_after():
    model = _no_eos(tiny_model("qwen2_vl"))
    inputs = _prompt(model)
    with Tracer(model, regions=2, vas=False, splitter=lambda ids: True) as tr:
        hooks = []
        tr.generate_with(lambda span: hooks.append(len(model._forward_pre_hooks)), **inputs,
                         max_new_tokens=3)
        assert hooks == [0, 0, 0] and len(model._forward_pre_hooks) == 1
        spans = list(tr.generate(**inputs, max_new_tokens=2))
        assert len(spans) == 2 and len(model._forward_pre_hooks) == 1
        tr.generate_with(lambda span: tr.detach(), **inputs, max_new_tokens=1)
        assert not model._forward_pre_hooks  # a callback detached it: not hooked again
    assert not model._forward_pre_hooks and not model.get_decoder()._forward_pre_hooks


def test_iterator_may_be_advanced_from_another_greenlet():
    greenlet = pytest.importorskip("greenlet")
    model = _no_eos(tiny_model("qwen2_vl"))
    main = greenlet.getcurrent()

    def take_one_and_wait(it):
        main.switch(next(it))  # and stays suspended, alive

    with Tracer(model, regions=2, vas=False, splitter=lambda ids: True) as tr:
        it = tr.generate(**_prompt(model), max_new_tokens=3)
        other = greenlet.greenlet(take_one_and_wait)
        first = other.switch(it)
        rest = list(it)  # the next spans come here, not to the greenlet that took the first
    assert [s.start for s in [first] + rest] == [0, 1, 2] and not other.dead


def test_generation_starts_no_thread(monkeypatch):
    model = _no_eos(tiny_model("qwen2_vl"))
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start",
                        lambda self: (started.append(self.name), real_start(self)))
    with Tracer(model, regions=2, vas=False, splitter=lambda ids: True) as tr:
        assert len(list(tr.generate(**_prompt(model), max_new_tokens=3))) == 3
        tr.generate_with(lambda span: None, **_prompt(model), max_new_tokens=3)
    assert started == []


def test_error_in_generation_is_reraised():
    model = _no_eos(tiny_model("qwen2_vl"))

    def broken(ids):
        if len(ids) == 3:
            raise ZeroDivisionError("splitter failed")
        return False

    with Tracer(model, regions=2, vas=False, splitter=broken) as tr:
        with pytest.raises(ZeroDivisionError, match="splitter failed"):
            list(tr.generate(**_prompt(model), max_new_tokens=6))
        # the tracer is usable again
        assert len(list(tr.generate(**_prompt(model), max_new_tokens=2))) == 1


def _counting_splitter(steps):
    """A splitter that ends a span at every token and notes how many it has seen."""
    def counting(ids):
        steps.append(len(ids))
        return True
    return counting


def test_keyboard_interrupt_and_break_stop_generation():
    model = _no_eos(tiny_model("qwen2_vl"))
    steps = []
    counting = _counting_splitter(steps)

    with Tracer(model, regions=2, vas=False, splitter=counting) as tr:
        with pytest.raises(KeyboardInterrupt):
            for span in tr.generate(**_prompt(model), max_new_tokens=200):
                raise KeyboardInterrupt
        assert len(steps) < 10  # generation stopped long before 200 tokens
        steps.clear()
        it = tr.generate(**_prompt(model), max_new_tokens=200)
        next(it)
        it.close()
        assert len(steps) < 10
        assert tr.sequences is None


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.5, 1.0, 2.0])
def test_interrupt_while_waiting_for_a_span(delay, ctrl_c):
    """Ctrl-C (SIGINT to the main thread) at any moment of a span that never ends stops
    generation; repeated at several moments, in the suite's order."""
    model = _no_eos(tiny_model("qwen2_vl"))
    import _thread
    steps = []

    def never_ends(ids):
        steps.append(len(ids))
        return False

    timer = threading.Timer(delay, _thread.interrupt_main)
    try:
        with Tracer(model, regions=2, vas=False, splitter=never_ends) as tr:
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                list(tr.generate(**_prompt(model), max_new_tokens=3000))
    finally:
        timer.cancel()
    assert not steps or steps[-1] < 3000  # generation stopped, not run to its end


class _SwallowedInterrupt:
    """Sends SIGINT from its finaliser: the KeyboardInterrupt is raised there and, as for
    any exception in a finaliser, swallowed (reported as unraisable)."""

    def __del__(self):
        import signal
        signal.raise_signal(signal.SIGINT)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["generate", "generate_with"])
def test_interrupt_swallowed_by_a_finaliser_still_stops_generation(how, ctrl_c):
    model = _no_eos(tiny_model("qwen2_vl"))
    steps, armed = [], [True]

    def splitter(ids):
        steps.append(len(ids))
        if len(ids) == 5 and armed.pop():
            _SwallowedInterrupt()  # dropped at once: its finaliser runs here
        return False

    with Tracer(model, regions=2, vas=False, splitter=splitter) as tr:
        with pytest.raises(KeyboardInterrupt):
            if how == "generate":
                list(tr.generate(**_prompt(model), max_new_tokens=200))
            else:
                tr.generate_with(lambda span: None, **_prompt(model), max_new_tokens=200)
        assert steps[-1] == 5  # stopped at the next step
        # the handler is the default again and the tracer generates as before
        import signal
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        steps.clear()
        armed.append(False)
        tr.generate_with(lambda span: None, **_prompt(model), max_new_tokens=8)
        assert steps[-1] == 8


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_interrupt_swallowed_on_the_last_step_is_raised_at_the_end(ctrl_c):
    model = _no_eos(tiny_model("qwen2_vl"))

    def splitter(ids):
        if len(ids) == 4:
            _SwallowedInterrupt()
        return False

    with Tracer(model, regions=2, vas=False, splitter=splitter) as tr:
        with pytest.raises(KeyboardInterrupt):
            tr.generate_with(lambda span: None, **_prompt(model), max_new_tokens=4)


@pytest.mark.isolated(max_rss_gib=4)
@pytest.mark.timeout(600)
def test_memory_of_a_long_open_span_grows_as_its_tokens_not_their_square():
    """A span that never ends holds its query rows, O(tokens x layers x heads x head size):
    from step 300 to step 1200 the traced process grows at most by what plain generate
    grows (its key cache) plus the rows and a few MiB. Measured in a process of its own,
    from /proc (resident set), at two lengths of the same generation."""
    import os
    model = _no_eos(tiny_model("qwen2_vl", hidden=256, kv_heads=4))
    inputs = _prompt(model)
    first, last = 300, 1200

    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20

    class Probe:  # a streamer: generate hands it the prompt, then each step's token
        def __init__(self):
            self.calls, self.mib = 0, {}

        def put(self, value):
            if self.calls in (first, last):
                self.mib[self.calls] = resident_mib()
            self.calls += 1

        def end(self):
            pass

    gen = dict(min_new_tokens=last, max_new_tokens=last, do_sample=False)
    with torch.no_grad():
        plain = Probe()
        model.generate(**inputs, streamer=plain, **gen)
        traced = Probe()
        with Tracer(model, regions=2, vas=False, splitter=lambda ids: False) as tr:
            spans = list(tr.generate(**inputs, streamer=traced, **gen))
    assert len(spans) == 1 and spans[0].end == last
    growth = {name: p.mib[last] - p.mib[first] for name, p in (("plain", plain),
                                                                ("traced", traced))}
    L, H, Dh = 2, 4, 64
    rows_mib = 2 * L * H * last * Dh * 4 / 2 ** 20  # the rows, with the buffer's doubling
    assert growth["traced"] <= growth["plain"] + rows_mib + 8, growth


def test_generate_with_callback_equals_iterator():
    model = tiny_model("qwen2_vl")
    inputs = _prompt(model, batch=2)
    gen = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    head = headscope.AttributionHead(2, 4)
    with torch.no_grad():
        head.weight.copy_(torch.randn(8))
    every2 = lambda ids: len(ids) % 2 == 0  # noqa: E731
    with Tracer(model, regions=3, vas=True, head=head, splitter=every2) as tr:
        iterated = list(tr.generate(**inputs, **gen))
        seq_iter, vas_iter = tr.sequences, tr.vas_features()
        got, threads_seen = [], set()

        def on_span(span):
            threads_seen.add(threading.current_thread().name)
            got.append(span)

        sequences = tr.generate_with(on_span, **inputs, **gen)
        assert torch.equal(sequences, seq_iter) and torch.equal(tr.sequences, seq_iter)
        torch.testing.assert_close(tr.vas_features(), vas_iter)
    assert threads_seen == {threading.current_thread().name}  # no second thread
    assert [(s.batch_index, s.start, s.end) for s in got] == \
        [(s.batch_index, s.start, s.end) for s in iterated]
    for a, b in zip(got, iterated):
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.features, b.features) and torch.equal(a.scores, b.scores)


def test_generate_with_callback_error_and_interrupt_stop_generation():
    model = _no_eos(tiny_model("qwen2_vl"))
    steps = []
    counting = _counting_splitter(steps)

    def broken(span):
        if span.start == 1:
            raise ValueError("callback failed")

    with Tracer(model, regions=2, vas=False, splitter=counting) as tr:
        with pytest.raises(ValueError, match="callback failed"):
            tr.generate_with(broken, **_prompt(model), max_new_tokens=200)
        assert len(steps) < 10 and tr.sequences is None

        def interrupting(ids):
            if len(ids) == 3:
                raise KeyboardInterrupt
            return True

        tr.splitter = interrupting
        with pytest.raises(KeyboardInterrupt):
            tr.generate_with(lambda span: None, **_prompt(model), max_new_tokens=200)
        tr.splitter = None
        assert tr.generate_with(lambda span: None, **_prompt(model),
                                max_new_tokens=2).shape[1] == _prompt(model)["input_ids"].shape[1] + 2


def test_model_called_while_generating_raises():
    model = _no_eos(tiny_model("qwen2_vl"))
    inputs = _prompt(model)
    with Tracer(model, regions=2, vas=False, splitter=lambda ids: True) as tr:
        it = tr.generate(**inputs, max_new_tokens=50)
        next(it)
        with pytest.raises(RuntimeError, match="while a generation of this tracer is running"):
            with torch.no_grad():
                model(**inputs)
        it.close()

        def calls_model(span):  # on the generating thread, between two decode steps
            model(**inputs)

        with pytest.raises(RuntimeError, match="while it is paused at a span"), torch.no_grad():
            tr.generate_with(calls_model, **inputs, max_new_tokens=5)
        assert tr.generate_with(lambda span: None, **inputs, max_new_tokens=2).shape[1] == \
            inputs["input_ids"].shape[1] + 2  # the tracer is usable again


def test_import_headscope_does_not_import_transformers():
    import subprocess
    import sys
    code = "import sys, headscope; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_misuse_errors():
    model = tiny_model("qwen2_vl")
    inputs = _prompt(model)
    with Tracer(model, vas=True) as tr:
        with pytest.raises(RuntimeError, match="no complete forward"):
            tr.vas_features()
        with pytest.raises(RuntimeError, match="already traced"):
            Tracer(model)
        with pytest.raises(NotImplementedError, match="num_beams"):
            tr.generate(**inputs, num_beams=2)
    with Tracer(model, regions=2, vas=False) as tr, torch.no_grad():
        # plain generate hands the vision output over without image_grid_thw
        with pytest.raises(ValueError, match=r"generate with tr\.generate\(\*\*inputs"):
            model.generate(**inputs, max_new_tokens=2)
        assert len(list(tr.generate(**inputs, max_new_tokens=2))) >= 1
    with pytest.raises(ValueError, match="writes"):
        Tracer(model, writes="values")
    with Tracer(model, vas=False) as tr:
        with pytest.raises(RuntimeError, match="VAS is off"):
            tr.vas_features()
    # a copy of a traced model that outlives its tracer
    with Tracer(model):
        import copy
        clone = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="no Tracer is attached"):
        with torch.no_grad():
            clone(**inputs)


def test_grid_regions_cut_the_picture_into_blocks_by_token_centres():
    from headscope.hf import grid_regions
    assert grid_regions(3, 3)(None, (6, 6)).reshape(6, 6).tolist() == \
        [[3 * (i // 2) + j // 2 for j in range(6)] for i in range(6)]
    # a token belongs to the block holding its centre: row i's centre is (i + 0.5) / 5
    uneven = grid_regions(2, 3)(None, (5, 7)).reshape(5, 7)
    assert uneven[:, 0].tolist() == [0, 0, 3, 3, 3] and uneven[0].tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert sorted(uneven.unique().tolist()) == list(range(6))
    with pytest.raises(ValueError, match="at least that many tokens"):
        grid_regions(4, 1)(None, (3, 3))
    with pytest.raises(ValueError, match="ints >= 1"):
        grid_regions(0, 2)


# ---- construction errors and the image plane ---------------------------------------------------

def test_unsupported_models_regions_and_heads_fail_at_construction():
    import transformers as tf
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                                   bos_token_id=0, eos_token_id=0))
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, num_attention_heads=2,
                                               hidden_size=16, intermediate_size=32,
                                               vocab_size=64))
    for model, name in ((gpt2, "gpt2"), (llama, "llama")):
        with pytest.raises(ValueError, match=rf"model_type '{name}'\) is not supported: its "
                                             r"config \(\w+Config\) names no image placeholder "
                                             r"token"):
            Tracer(model)
        assert model.config._attn_implementation != "headscope"  # nothing was bound
    model = tiny_model("qwen2_vl")
    for bad in (0, -3):
        with pytest.raises(ValueError, match=rf"'regions' must be a number of regions >= 1 "
                                             rf"per image, got {bad}"):
            Tracer(model, regions=bad)
    L, H = 2, 4
    with pytest.raises(ValueError, match=r"'head' must map features \(K, L\*H = 8\) to scores "
                                         r"\(K,\); on \(2, 8\) zeros it returned shape \(\)"):
        Tracer(model, regions=2, head=lambda f: f.sum())
    with pytest.raises(ValueError, match=r"'head' must map .* it raised RuntimeError"):
        Tracer(model, regions=2, head=torch.nn.Linear(12, 1))
    with pytest.raises(TypeError, match="'head' must be an AttributionHead or a callable"):
        Tracer(model, regions=2, head="head.safetensors")
    assert model.config.text_config._attn_implementation == "sdpa"  # none stayed bound
    linear = torch.nn.Linear(L * H, 1)
    with Tracer(model, regions=2, head=lambda f: linear(f)[:, 0]) as tr:
        spans = list(tr.generate(**_prompt(model), max_new_tokens=2, do_sample=False))
    assert spans and all(s.scores.shape == (2,) for s in spans)
    with Tracer(model, regions=1000) as tr, pytest.raises(ValueError, match=r"'regions' must be "
                                                                         r"in \[1, 16\]"):
        tr.generate_with(lambda s: None, **_prompt(model), max_new_tokens=1)



def test_llava_with_a_tower_of_no_fixed_grid_is_refused():
    """LLaVA's layout is one fixed square grid (CLIP, SigLIP towers); a Pixtral tower keeps
    each picture's aspect ratio, so its tokens would be placed wrongly: refused."""
    import transformers as tf
    from headscope.hf.families import family_of
    config = tf.LlavaConfig(vision_config=dict(model_type="pixtral", hidden_size=32,
                                               intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=16,
                                               patch_size=4, head_dim=16),
                            text_config=dict(model_type="llama", hidden_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, vocab_size=600),
                            image_token_index=500)
    ids = torch.full((1, 20), 500)
    with pytest.raises(NotImplementedError, match="pixtral vision tower has no fixed square "
                                                  "patch grid; supported towers: "
                                                  "clip_vision_model, siglip_vision_model"):
        family_of(config).images(config, {"input_ids": ids})
