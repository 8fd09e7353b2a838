"""Attention patterns other than plain causal through the Tracer and region_effects:
the contract of tests/python/test_hf.py on decoders the families' parametrisation does not
build (PaliGemma on Gemma, LLaVA on a Mistral decoder with a sliding window, LLaVA on Llama
4's text decoder with chunked and NoPE layers), PaliGemma 2's VAS through the q/k op with
its soft cap, mask functions the ops cannot express, and the pattern read from each
composition transformers builds."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
import test_family_contract as contract  # noqa: E402
from headscope.hf import Tracer  # noqa: E402
from headscope.hf.forward_vas import ForwardVAS  # noqa: E402
from headscope.hf.masks import Pattern, mask_function, read_pattern  # noqa: E402
from headscope.hf.testing import tiny_model  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

# Llama 4's text decoder (llama4_text) as the checkpoints lay it out, on two layers: a chunked
# layer with RoPE, then a global NoPE layer; chunks of 5, so that the test prompts (24 tokens,
# and 21 after 3 padding tokens) and their generations cross several chunk boundaries, and a
# decode step's chunked cache (the last 4 keys) starts past the chunks' origin. The Llama 4
# VLM cannot run in transformers 5.24 (test_families_llama4.py): its decoder runs behind LLaVA.
LLAMA4_TEXT = dict(model_type="llama4_text", attention_chunk_size=5, no_rope_layer_interval=2,
                   intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1)

# model type, the text config over the family's: decoders of other patterns
VARIANTS = {
    "paligemma_gemma": ("paligemma", dict(model_type="gemma")),
    "llava_mistral_window": ("llava", dict(model_type="mistral", sliding_window=8)),
    "llava_llama4_chunked": ("llava", LLAMA4_TEXT),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request):
    family, text = VARIANTS[request.param]
    return (tiny_model(family, text_overrides=text),
            tiny_model(family, text_overrides=text, attn_implementation="eager"))


@pytest.mark.parametrize("check", [
    contract.test_logits_unchanged_and_model_restored,
    contract.test_vas_features_equal_seed_on_eager_attentions,
    contract.test_left_padded_batch_equals_rows_alone,
    contract.test_left_padded_generation_equals_rows_alone,
    contract.test_generate_same_tokens_and_span_features_equal_region_pool],
    ids=lambda f: f.__name__[5:])
def test_contract(models, check):
    check(models)


def test_mistral_window_binds_in_the_test_prompts(models):
    """The window must hide keys in the prompts above, or the tests prove nothing."""
    model, _ = models
    window = getattr(model.config.text_config, "sliding_window", None)
    if window is None:
        pytest.skip("no window")
    assert contract.prompt(model, batch=2)["input_ids"].shape[1] > 2 * window


def test_llama4_chunks_bind_in_the_test_prompts(models):
    """Chunked and NoPE layers, chunks far shorter than the prompts, or the tests prove
    nothing."""
    model, _ = models
    text = model.config.text_config
    if getattr(text, "attention_chunk_size", None) is None:
        pytest.skip("no chunks")
    assert text.layer_types == ["chunked_attention", "full_attention"]
    assert text.no_rope_layers == [1, 0]  # RoPE on the chunked layer, none on the global one
    assert contract.prompt(model, batch=2)["input_ids"].shape[1] > 4 * text.attention_chunk_size


def _span_feature_error(model, eager, steps=7):
    """Max |span features - eager region pooling of the teacher-forced sequence| of a
    greedy generation of ``steps`` tokens from the contract's left-padded batch."""
    import headscope
    inputs = contract.prompt(model, batch=2)
    every3 = lambda ids: len(ids) % 3 == 0  # noqa: E731
    with Tracer(model, regions=4, vas=False, splitter=every3) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=steps, do_sample=False,
                                 eos_token_id=None))
    P = inputs["input_ids"].shape[1]
    full = dict(inputs, input_ids=tr.sequences,
                attention_mask=torch.nn.functional.pad(inputs["attention_mask"], (0, steps),
                                                       value=1))
    _, attns, _ = contract.eager_run(eager, full)
    rid = torch.nn.functional.pad(tr.region_ids, (0, steps), value=-1)
    error = 0.0
    for s in spans:
        w = torch.zeros(2, P + steps)
        w[:, P + s.start - 1:P + s.end - 1] = 1.0
        want = headscope.stack_layers([headscope.region_pool(a.float(), w, rid, max(tr.num_regions))
                                       for a in attns])[s.batch_index, :s.features.shape[0]]
        error = max(error, float((s.features - want).abs().max()))
    return error


def test_llama4_chunked_decode_needs_the_chunk_origin(models, monkeypatch):
    """A decode step's chunked cache holds only the last chunk - 1 keys: the ops count the
    chunks from the origin the Tracer hands them (left padding - kv_offset). Without it
    (chunks counted from the cache's first key) the span features of the chunked layer
    are wrong."""
    model, eager = models
    if getattr(model.config.text_config, "attention_chunk_size", None) is None:
        pytest.skip("no chunks")
    assert _span_feature_error(model, eager) < 1e-5
    monkeypatch.setattr(Pattern, "chunk_origin", lambda self, start: None)
    assert _span_feature_error(model, eager) > 1e-2


def test_paligemma2_vas_through_the_qk_op_with_soft_cap(monkeypatch):
    """PaliGemma 2 runs eager only (its soft cap), whose weights VAS then reads: with them
    withheld, vas_head_stats_qk gets the window, the prefix block and the soft cap, and
    gives the reference's features."""
    model = tiny_model("paligemma")
    assert model.config.text_config.attn_logit_softcapping
    inputs = contract.prompt(model, batch=2)
    _, attns, writes = contract.eager_run(model, inputs)
    import headscope
    want, _ = headscope.vas_features(attns, writes, inputs["attention_mask"],
                                     left_padding=True)
    add = ForwardVAS.add
    monkeypatch.setattr(ForwardVAS, "add", lambda self, layer, module, q, k, out, weights, *rest:
                        add(self, layer, module, q, k, out, None, *rest))
    with torch.no_grad(), Tracer(model, vas=True) as tr:
        model(**inputs)
        got = tr.vas_features()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_patterns_read_from_transformers_compositions():
    blocks = torch.tensor([[-1, 0, 0, -1]])
    gemma3_sliding = mu.and_masks(mu.or_masks(mu.causal_mask_function,
                                              mu.blockwise_overlay(blocks)),
                                  mu.sliding_window_overlay(3))
    paligemma2 = mu.or_masks(mu.sliding_window_causal_mask_function(3),
                             mu.blockwise_overlay(blocks))
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.int64))
    for fn, want in ((mu.causal_mask_function, dict()),
                     (mu.sliding_window_causal_mask_function(5), dict(window=5)),
                     (gemma3_sliding, dict(window=3, window_bounds_blocks=True)),
                     (paligemma2, dict(window=3, window_bounds_blocks=False)),
                     (chunked, dict(chunk=4))):
        pattern = read_pattern(fn)
        for name, value in want.items():
            assert getattr(pattern, name) == value, (fn, name)
        assert (pattern.blocks is not None) == (fn in (gemma3_sliding, paligemma2))
        # rebuilt, the pattern masks exactly as the original
        again = mask_function(pattern, 1)
        q, kv = torch.arange(4)[:, None], torch.arange(4)[None, :]
        b, h = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        assert torch.equal(fn(b, h, q, kv), again(b, h, q, kv)), fn
    assert read_pattern(mu.causal_mask_function) == Pattern()


@pytest.mark.parametrize("fn, match", [
    (lambda b, h, q, kv: q >= kv, "the mask function"),
    (mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(
        torch.zeros(1, 4096, dtype=torch.int64))), "packed_sequence_mask_function"),
    (mu.bidirectional_mask_function, "bidirectional_mask_function")])
def test_unexpressible_mask_functions_raise(fn, match, monkeypatch):
    """A mask the ops cannot express stops the traced forward with what it was, never a
    wrong number."""
    model = tiny_model("qwen2_vl")
    inputs = contract.prompt(model)
    from headscope.hf import backend
    with Tracer(model, vas=True) as tr:
        mask = tr.mask
        monkeypatch.setattr(tr, "mask", lambda *args, **kwargs: mask(
            *args, **dict(kwargs, mask_function=fn, allow_is_causal_skip=False)))
        with pytest.raises(NotImplementedError, match=match), torch.no_grad():
            model(**inputs)
    assert backend.NAME != model.config.text_config._attn_implementation
