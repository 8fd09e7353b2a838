"""What headscope cannot read raises an error naming what and why, never the model type
alone: Llama 3.2 Vision (cross-attention to the picture, no image tokens), a model whose
config names no image placeholder (Qwen3-Next, a text model), a decoder with no softmax
attention layer, and an answer that holds an image token (prompt plus answer is then no
valid model input). Hybrid decoders (Qwen3.5) are not refused."""
from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")
from headscope.hf import Tracer  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing import IMAGE_TOKEN, image_prompt, tiny_model  # noqa: E402

TINY_TEXT = dict(vocab_size=64, pad_token_id=0, hidden_size=16, intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def test_llama_3_2_vision_is_refused_for_its_cross_attention():
    config = tf.MllamaConfig(text_config=dict(TINY_TEXT, cross_attention_layers=[1]),
                             vision_config=dict(hidden_size=16, num_hidden_layers=1,
                                                num_global_layers=1, attention_heads=2,
                                                intermediate_size=32, image_size=28,
                                                patch_size=14, vision_output_dim=32))
    with pytest.raises(ValueError, match=r"model_type 'mllama'\) is not supported: Llama 3.2 "
                                         r"Vision \(mllama\) reads its pictures through "
                                         r"cross-attention"):
        family_of(config)
    model = tf.MllamaForConditionalGeneration(config).eval()
    before = model.config.text_config._attn_implementation
    with pytest.raises(ValueError, match="no regions to attribute to"):
        Tracer(model)
    assert model.config.text_config._attn_implementation == before  # nothing was bound


def test_a_model_with_no_image_placeholder_is_refused_naming_why():
    """Qwen3-Next is a text model: its config names no image token, so no sequence of it
    holds image tokens."""
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                  linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2)
    config = tf.Qwen3NextConfig(**TINY_TEXT, **linear, num_experts=2, num_experts_per_tok=1,
                                moe_intermediate_size=16)
    with pytest.raises(ValueError, match=r"model_type 'qwen3_next'\) is not supported: its config "
                                         r"\(Qwen3NextConfig\) names no image placeholder token"):
        family_of(config)
    model = tf.Qwen3NextForCausalLM(config).eval()
    with pytest.raises(ValueError, match="its sequence holds no image tokens"):
        Tracer(model)
    assert model.config._attn_implementation != "headscope"


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_hybrid_decoders_are_not_refused_by_model_type(name):
    """Qwen3.5's gated delta nets are not traced, its softmax layers are, through the
    Qwen-VL family (test_families_qwen_layout.py)."""
    from headscope.hf.families.qwen_vl import QwenVL
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                  linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2)
    cls = tf.Qwen3_5Config if name == "qwen3_5" else tf.Qwen3_5MoeConfig
    assert type(family_of(cls(text_config=dict(TINY_TEXT, **linear)))) is QwenVL


def test_a_decoder_with_no_softmax_layer_is_refused_naming_why():
    """An LFM2-VL whose decoder layers are all short convolutions forms no attention
    weights at all."""
    from headscope.hf.testing.newest import RECIPES
    recipe = RECIPES["lfm2_vl"][1]()
    recipe.config.text_config.layer_types = ["conv"] * recipe.config.text_config.num_hidden_layers
    model = recipe.cls(recipe.config).eval()
    before = model.config.text_config._attn_implementation
    with pytest.raises(ValueError, match=r"Lfm2Model has no softmax attention layer \(no decoder "
                                         r"module dispatches through transformers' attention "
                                         r"interface\)"):
        Tracer(model)
    assert model.config.text_config._attn_implementation == before


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_an_answer_holding_an_image_token_is_refused_before_the_model_fails(family):
    model = tiny_model(family)
    fam = family_of(model)
    inputs = image_prompt(model, grids={"llava": ((8, 8),), "idefics3": ((2, 2),)}.get(
        family, ((8, 8),)))
    answer = torch.tensor([[7, 9, IMAGE_TOKEN, 11]])
    fam.check_answer(model.config, answer[:, :2])  # no image token: nothing to say
    with pytest.raises(ValueError, match=rf"answer holds the image token {IMAGE_TOKEN} \(row 0, "
                                         rf"answer token 2; 1 in all\).*"
                                         rf"suppress_tokens=\[{IMAGE_TOKEN}\]"):
        fam.check_answer(model.config, answer)
    # what the error advises keeps the token out of the answer
    logits_bias = torch.zeros(model.config.text_config.vocab_size)
    logits_bias[IMAGE_TOKEN] = 1e4  # the model would pick it at every step
    bias = model.lm_head.register_forward_hook(lambda m, a, out: out + logits_bias)
    try:
        with torch.no_grad():
            forced = model.generate(**inputs, max_new_tokens=2, do_sample=False)
            kept = model.generate(**inputs, max_new_tokens=2, do_sample=False,
                                  suppress_tokens=[IMAGE_TOKEN])
    finally:
        bias.remove()
    P = inputs["input_ids"].shape[1]
    with pytest.raises(ValueError, match="answer holds the image token"):
        fam.check_answer(model.config, forced[:, P:])
    fam.check_answer(model.config, kept[:, P:])
    # what the check stands in front of: the model itself refuses prompt plus answer, with
    # an error that says nothing of the answer
    final = dict(inputs, input_ids=torch.cat([inputs["input_ids"], answer], 1),
                 attention_mask=torch.cat([inputs["attention_mask"],
                                           torch.ones_like(answer)], 1))
    final.pop("mm_token_type_ids", None)
    with pytest.raises(Exception) as failure, torch.no_grad():
        model(**final)
    assert "answer" not in str(failure.value)


def test_tracer_and_effects_refuse_an_answer_holding_an_image_token():
    """The Tracer keeps the generation (its spans, tr.sequences) and refuses at the VAS
    pass over prompt plus answer; region_effects refuses before running the model."""
    from headscope.hf import region_effects
    model = tiny_model("qwen2_vl")
    inputs = image_prompt(model, grids=((8, 8),))
    logits_bias = torch.zeros(model.config.text_config.vocab_size)
    logits_bias[IMAGE_TOKEN] = 1e4
    bias = model.lm_head.register_forward_hook(lambda m, a, out: out + logits_bias)
    try:
        with Tracer(model, regions=2) as tr, torch.no_grad():
            spans = list(tr.generate(**inputs, max_new_tokens=3, do_sample=False))
            P = inputs["input_ids"].shape[1]
            assert tr.sequences is not None and bool((tr.sequences[:, P:] == IMAGE_TOKEN).all())
            assert len(spans) == 1 and spans[0].features.shape[0] == 2
            with pytest.raises(ValueError, match=r"headscope\.hf\.Tracer: the generated answer "
                                                 r"holds the image token"):
                tr.vas_features()
    finally:
        bias.remove()
    region_ids = torch.full_like(inputs["input_ids"], -1)
    region_ids[inputs["input_ids"] == IMAGE_TOKEN] = 0
    with pytest.raises(ValueError, match=r"headscope\.hf\.region_effects: the generated answer "
                                         r"holds the image token"):
        region_effects(model, inputs, tr.sequences, [(0, 3)], region_ids, progress=False)
