"""The Tracer's one state (tr.phase) through a forward, a generation, a span's consumer
and the answer's VAS pass; answer_vas, the public call for the answer's VAS; and the key
tables that hold region ids, padding and value norms once for the prefill and every
decode step."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from headscope.hf import Tracer  # noqa: E402
from headscope.hf.rows import KeyTable  # noqa: E402
from headscope.hf.testing import image_prompt, tiny_model  # noqa: E402
from headscope.hf.tracer import Phase  # noqa: E402


@pytest.fixture(scope="module")
def model():
    model = tiny_model("qwen2_vl")
    model.generation_config.eos_token_id = None
    return model


def _prompt(model, batch=1):
    return image_prompt(model, grids=((8, 8), (6, 4))[:batch], text_before=(3, 2)[:batch],
                        text_after=(5, 3)[:batch], seed=0)


def _phases_at_forwards(model):
    """A list that gets the tracer's phase as each decoder forward starts (a hook
    registered after the tracer's sees the phase it set)."""
    seen = []
    return seen, lambda tr: model.get_decoder().register_forward_pre_hook(
        lambda *_: seen.append(tr.phase))


def test_phases_of_forwards_and_a_generation(model):
    inputs = _prompt(model)
    seen, hook_on = _phases_at_forwards(model)
    with Tracer(model, regions=2, vas=True, splitter=lambda ids: len(ids) == 2) as tr:
        assert tr.phase is Phase.READY and tr.attached
        handle = hook_on(tr)
        with torch.no_grad():
            model(**inputs)
        assert seen == [Phase.VAS]
        at_spans = []
        spans = tr.generate_with(lambda span: at_spans.append(tr.phase), **inputs,
                                 max_new_tokens=4, do_sample=False)
        assert spans.shape[1] == inputs["input_ids"].shape[1] + 4
        # the prefill, then one decode step per token after the first
        assert seen[1:] == [Phase.PREFILL, Phase.DECODE, Phase.DECODE, Phase.DECODE]
        assert at_spans == [Phase.PAUSED, Phase.PAUSED]
        assert tr.phase is Phase.READY and tr.rows is None
        tr.vas_features()  # the answer's pass
        assert seen[-1] is Phase.ANSWER and len(seen) == 6 and tr.phase is Phase.READY
        handle.remove()
    assert tr.phase is Phase.DETACHED and not tr.attached


def test_generation_without_regions_computes_nothing_per_step(model):
    inputs = _prompt(model)
    seen, hook_on = _phases_at_forwards(model)
    with Tracer(model, regions=None, vas=False) as tr:
        handle = hook_on(tr)
        spans = list(tr.generate(**inputs, max_new_tokens=3, do_sample=False))
        handle.remove()
    assert seen == [Phase.GENERATING] * 3
    assert len(spans) == 1 and spans[0].features.shape == (0, tr.feature_width)


def test_answer_vas_runs_the_final_forward_at_each_call(model):
    inputs = _prompt(model, batch=2)
    seen, hook_on = _phases_at_forwards(model)
    with Tracer(model, regions=2, vas=True) as tr:
        with pytest.raises(RuntimeError, match="no generate has finished"):
            tr.answer_vas()
        list(tr.generate(**inputs, max_new_tokens=3, do_sample=False))
        handle = hook_on(tr)
        kept = tr.vas_features()
        again = tr.vas_features()  # reused: no forward
        assert seen == [Phase.ANSWER] and torch.equal(kept, again)
        assert torch.equal(tr.answer_vas(), kept) and seen == [Phase.ANSWER] * 2
        tr.detach()
        assert torch.equal(tr.answer_vas(), kept)  # attached for its forward only
        assert seen == [Phase.ANSWER] * 3 and tr.phase is Phase.DETACHED
        assert not model._forward_pre_hooks
        handle.remove()
        # the same as a plain forward over the final sequence's inputs
        tr.attach()
        with torch.no_grad():
            model(**tr.generation.answer.inputs)
        torch.testing.assert_close(tr.vas_features(), kept, atol=1e-5, rtol=1e-5)
    with Tracer(model, regions=2, vas=False) as tr:
        list(tr.generate(**inputs, max_new_tokens=2, do_sample=False))
        with pytest.raises(RuntimeError, match="VAS is off"):
            tr.answer_vas()


def test_a_consumer_that_detaches_and_attaches_again_keeps_the_generation(model):
    """Between two decode steps the consumer may detach and attach the tracer: the
    generation goes on traced, the model hook stays off until it ends."""
    inputs = _prompt(model)
    every2 = lambda ids: len(ids) % 2 == 0  # noqa: E731

    def reattach(span):
        tr.detach()
        tr.attach()
        assert tr.phase is Phase.PAUSED and not model._forward_pre_hooks

    with Tracer(model, regions=2, vas=False, splitter=every2) as tr:
        want = []
        tr.generate_with(want.append, **inputs, max_new_tokens=4, do_sample=False)
        got = []
        tr.generate_with(lambda span: (got.append(span), reattach(span)), **inputs,
                         max_new_tokens=4, do_sample=False)
        assert len(model._forward_pre_hooks) == 1 and tr.phase is Phase.READY
    assert [(s.start, s.end) for s in got] == [(0, 2), (2, 4)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.features, b.features)


def test_output_projection_hooks_only_while_a_forward_computes_vas(model):
    """What each head writes is read at its layer's o_proj by a forward pre-hook that lives
    only as long as a forward computing VAS (the answer's pass included): none in a
    generation's forwards, none left by an interrupted forward once the next one starts,
    none after detach."""
    from headscope.hf.structure import output_projection, softmax_attention_layers
    projections = [output_projection(m) for m in softmax_attention_layers(model.get_decoder())]
    hooked = lambda: sum(len(p._forward_pre_hooks) for p in projections)  # noqa: E731
    inputs = _prompt(model)
    at_forwards = []
    with Tracer(model, regions=2, vas=True, splitter=lambda ids: len(ids) == 2) as tr:
        handle = model.get_decoder().register_forward_pre_hook(
            lambda *_: at_forwards.append((tr.phase, hooked())))
        with torch.no_grad():
            model(**inputs)
        assert hooked() == 0
        list(tr.generate(**inputs, max_new_tokens=3, do_sample=False))
        tr.vas_features()
        L = len(projections)
        assert at_forwards == [(Phase.VAS, L), (Phase.PREFILL, 0), (Phase.DECODE, 0),
                               (Phase.DECODE, 0), (Phase.ANSWER, L)]
        assert hooked() == 0

        def fail(*_):
            raise KeyError("stop")
        stop = softmax_attention_layers(model.get_decoder())[-1].register_forward_pre_hook(fail)
        with pytest.raises(KeyError), torch.no_grad():
            model(**inputs)
        stop.remove()
        assert hooked() == L  # left by the interrupted forward
        at_forwards.clear()
        list(tr.generate(**inputs, max_new_tokens=2, do_sample=False))
        assert at_forwards == [(Phase.PREFILL, 0), (Phase.DECODE, 0)]
        with torch.no_grad():
            model(**inputs)
        stop = softmax_attention_layers(model.get_decoder())[-1].register_forward_pre_hook(fail)
        with pytest.raises(KeyError), torch.no_grad():
            model(**inputs)
        stop.remove()
        handle.remove()
    assert hooked() == 0


def test_key_table_reads_generated_keys_as_fill():
    prompt = torch.tensor([[0, 1, -1], [1, 1, 0]])
    table = KeyTable(prompt, -1)
    assert torch.equal(table.upto(2), prompt[:, :2])
    grown = table.upto(5)
    assert torch.equal(grown, torch.tensor([[0, 1, -1, -1, -1], [1, 1, 0, -1, -1]]))
    assert table.values.shape[1] >= 3 + 64  # grows in steps, not per key
    before = table.values
    table.upto(40)
    assert table.values is before  # no copy within the grown tensor
    assert torch.equal(table.prompt, prompt)
