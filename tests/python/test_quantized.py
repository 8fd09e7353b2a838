"""Quantized weights (docs/hf.md, "Quantized weights") and the commands in reduced
precision. On a tiny Qwen2-VL and a tiny Gemma 3 (sliding windows, bidirectional image
blocks) saved and loaded through transformers' quantization configs, for each scheme whose
backend runs on this CPU (torchao int8 weight-only, int8 dynamic-activation int8-weight and
int4 weight-only, optimum-quanto int8 and int4, bitsandbytes NF4):

- the Tracer contract on the same quantized model: logits bitwise unchanged, VAS equal to
  the reference on the eager attentions of the quantized model loaded with eager
  attention, greedy tokens equal to plain ``generate``, span features equal to eager
  region pooling of the teacher-forced sequence, the model restored;
- value-norm features and ``writes="residual"``, which read ``o_proj``'s quantized weight
  (``headscope.hf.quantized.dense_weight``), against references on its dense matrix;
- ``region_effects`` equal to ablating one region at a time with the model's own forward;
- ``gradient_scores`` and ``attnlrp_scores`` equal to those of a float model holding the
  quantized model's dense weights, or refused with a one-line reason where the scheme
  passes no gradient (a kernel without a backward, activations quantized in the forward,
  bitsandbytes' CPU inference layout).

Then ``explain``, ``collect`` and ``vas`` end to end with ``--quantize int8|int4`` and with
``--dtype bfloat16``: what each command writes equals a Python-API run on the model
``headscope.commands.models.load_model`` loads the same way."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("torchao")
pytest.importorskip("optimum.quanto")
pytest.importorskip("accelerate")
pytest.importorskip("bitsandbytes")
import transformers as tf  # noqa: E402

import headscope  # noqa: E402
from headscope.commands import main  # noqa: E402
from headscope.hf import Tracer, attnlrp_scores, gradient_scores, region_effects  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.quantized import dense_weight, dequantized, is_quantized  # noqa: E402
from headscope.hf.structure import output_projection, softmax_attention_layers  # noqa: E402
from headscope.hf.testing import (eager_reference, image_prompt, quarters,  # noqa: E402
                                  tiny_checkpoint, tiny_dataset, tiny_model, tiny_processor)
from conftest import usage_error  # noqa: E402
from test_effects import SPANS, _reference_effects  # noqa: E402
from test_family_contract import continued  # noqa: E402


def _torchao(kind: str):
    """torchao's config; ``set_inductor_config=False``: torchao would otherwise change
    torch._inductor's settings for the whole process (the other tests' torch.compile)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    if kind == "int4":  # the CPU's int4 layout (tinygemm's CPU kernel); group 32: the tiny
        # layers' 64 input columns (torchao leaves a layer whose width the group does not
        # divide unquantized)
        from torchao.prototype.quantization.int4.inference_workflow import \
            PrototypeInt4WeightOnlyConfig
        return tf.TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=32,
                                                              set_inductor_config=False))
    return tf.TorchAoConfig({"int8": Int8WeightOnlyConfig,
                             "int8-dynamic": Int8DynamicActivationInt8WeightConfig}[kind](
        set_inductor_config=False))


# scheme -> its transformers quantization config
SCHEMES = {
    "torchao-int8": lambda: _torchao("int8"),
    "torchao-int8-dynamic": lambda: _torchao("int8-dynamic"),
    "torchao-int4": lambda: _torchao("int4"),
    "quanto-int8": lambda: tf.QuantoConfig(weights="int8"),
    "quanto-int4": lambda: tf.QuantoConfig(weights="int4"),
    "bnb-nf4": lambda: tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
}
# schemes refused by gradient_scores and attnlrp_scores, and the reason's words
NO_GRADIENT = {"torchao-int8-dynamic": "output is not differentiable in it",
               "torchao-int4": "derivative for aten::_weight_int4pack_mm_for_cpu"}
# causal Qwen2-VL; Gemma 3: sliding-window and full layers, bidirectional image blocks
MODEL_TYPES = ("qwen2_vl", "gemma3")
# Bounds against the eager reference (docs/hf.md's table): VAS, and span features against
# eager region pooling, on the model that ran them; region effects against one region at a
# time (test_effects')
VAS_TOLERANCE = 1e-4
FEATURE_TOLERANCE = 1e-5
EFFECTS_TOLERANCE = dict(atol=2e-5, rtol=1e-4)
# Kernels that round activations (int8 dynamic activations; bitsandbytes' CPU layout, which
# computes in bfloat16) make the model loaded with sdpa and the same one loaded with eager
# attention, or a batch of ablations and one at a time, differ by more than float32
# rounding: outputs equal to 1e-7 round to different int8 or bfloat16 values in the next
# layer. Against those the bound is this one (measured up to 3e-3); the tracer on the
# eager-loaded model still equals the reference to the float bounds.
ROUNDS_ACTIVATIONS = {"torchao-int8-dynamic", "bnb-nf4"}
ROUNDING_TOLERANCE = 2e-2
N = 6  # generated tokens (test_effects.SPANS cover them)


def bound(scheme: str, tolerance: float) -> dict:
    """assert_close's bounds of a comparison across two computations of ``scheme``."""
    if scheme in ROUNDS_ACTIVATIONS:
        return dict(atol=ROUNDING_TOLERANCE, rtol=ROUNDING_TOLERANCE)
    return dict(atol=tolerance, rtol=tolerance)


def load(folder, scheme=None, attention="sdpa"):
    """The tiny checkpoint quantized by ``scheme`` while loading (None: as saved)."""
    config = None if scheme is None else SCHEMES[scheme]()
    return tf.AutoModelForImageTextToText.from_pretrained(
        folder, quantization_config=config, dtype=torch.float32, device_map="cpu",
        attn_implementation=attention).eval()


def saved_model(folder, model_type):
    """A tiny checkpoint whose vision width is 64 (bitsandbytes' CPU layout needs input
    widths that are multiples of its block of 64) and whose image tokens carry the
    picture: a matrix initialised to zeros (Gemma 3's projector) is drawn at random, so
    that input x gradient and AttnLRP have image embeddings to score."""
    model = tiny_model(model_type, vision_hidden=64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and not p.any():
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[0] ** -0.5)
    model.save_pretrained(folder)
    tiny_processor(model_type).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {t: saved_model(root / t, t) for t in MODEL_TYPES}


@pytest.fixture(scope="module", params=[(s, t) for t in MODEL_TYPES for s in SCHEMES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, checkpoints):
    """A quantized model (sdpa), the same quantized with eager attention, a one-picture
    prompt and the traced greedy generation: spans of 3 tokens, region ids."""
    scheme, model_type = request.param
    folder = checkpoints[model_type]
    model, eager = load(folder, scheme), load(folder, scheme, "eager")
    assert any(is_quantized(m.weight) for m in family_of(model).decoder(model).modules()
               if isinstance(m, torch.nn.Linear))
    inputs = image_prompt(model, grids=((8, 8),), text_before=(3,), text_after=(5,))
    # N tokens, none an image token (which would make prompt plus answer no valid input)
    generate = dict(max_new_tokens=N, do_sample=False, eos_token_id=None,
                    suppress_tokens=list(family_of(model).media_token_ids(model.config)))
    every3 = lambda ids: len(ids) % 3 == 0  # noqa: E731
    with Tracer(model, regions=4, vas=True, splitter=every3) as tr:
        spans = list(tr.generate(**inputs, **generate))
        final_vas = tr.vas_features()
    return dict(scheme=scheme, folder=folder, model=model, eager=eager, inputs=inputs,
                generate=generate, spans=spans, sequences=tr.sequences,
                region_ids=tr.region_ids, num_regions=tr.num_regions[0], final_vas=final_vas)


def teacher_forced(case, sequences):
    """The prompt's inputs over a generated sequence."""
    inputs, model = case["inputs"], case["model"]
    full = dict(inputs, input_ids=sequences,
                attention_mask=torch.nn.functional.pad(inputs["attention_mask"], (0, N),
                                                       value=1))
    full.update(continued(model, inputs, N))
    return full


# ---- the weights ---------------------------------------------------------------------------

def test_dense_weight_is_what_the_forward_multiplies_by(case):
    """Every quantized linear layer of the decoder computes ``x W^T + b`` with W its
    dense_weight (to the rounding of its kernel: bfloat16 in bitsandbytes' CPU layout),
    and reading it leaves the layer as it was; value_norm_factors takes a weight with a
    dequantize() of its own and names the way for one without."""
    from headscope.hf import value_norm_factors
    model = load(case["folder"], case["scheme"])  # bitsandbytes: in its stored layout
    x = torch.randn(5, model.config.get_text_config().hidden_size,
                    generator=torch.Generator().manual_seed(0))
    o_proj = output_projection(softmax_attention_layers(family_of(model).decoder(model))[0])
    packed = getattr(getattr(o_proj.weight, "quant_state", None), "packing_format_for_cpu", None)
    dense = dense_weight(o_proj)
    assert type(dense) is torch.Tensor and dense.shape == (o_proj.out_features,
                                                           o_proj.in_features)
    assert getattr(getattr(o_proj.weight, "quant_state", None), "packing_format_for_cpu",
                   None) == packed
    with torch.no_grad():
        out = o_proj(x)
        error = float((out - x @ dense.T - (0 if o_proj.bias is None else o_proj.bias)).norm()
                      / out.norm())
    assert error < (ROUNDING_TOLERANCE if case["scheme"] in ROUNDS_ACTIVATIONS else 1e-6), error
    H = model.config.get_text_config().num_attention_heads
    if dequantized(o_proj.weight) is not None:
        torch.testing.assert_close(value_norm_factors(o_proj.weight, H),
                                   value_norm_factors(dense, H))
    else:
        with pytest.raises(ValueError, match=r"value_norm_factors: o_proj_weight is a "
                                             r"quantized \w+ with no dequantize\(\); pass "
                                             r"headscope.hf.quantized.dense_weight"):
            value_norm_factors(o_proj.weight, H)


# ---- the Tracer contract ----------------------------------------------------------------

def test_tracer_contract_on_the_quantized_model(case):
    """On the quantized model loaded with sdpa: logits bitwise, VAS and span features
    against the reference on the eager attentions of the same quantized model loaded with
    eager attention (the scheme's bound), greedy tokens as plain generate, restored after;
    traced with eager attention itself, VAS equal to that reference to the float bound."""
    model, eager, inputs, scheme = case["model"], case["eager"], case["inputs"], case["scheme"]
    batch = image_prompt(model, grids=((8, 8), (8, 8)), text_before=(3, 2), text_after=(5, 3))
    with torch.no_grad():
        plain = model(**batch).logits
        with Tracer(model, regions=4, vas=True) as tr:
            assert torch.equal(model(**batch).logits, plain)
            model(**inputs)
            vas = tr.vas_features()
        assert torch.equal(model(**batch).logits, plain)  # restored
        with Tracer(eager, vas=True) as tr:
            eager(**inputs)
            eager_vas = tr.vas_features()
    assert model.config.get_text_config()._attn_implementation == "sdpa"
    _, attns, writes = eager_reference(eager, inputs)
    want, _ = headscope.vas_features(attns, writes, inputs["attention_mask"])
    torch.testing.assert_close(eager_vas, want, atol=VAS_TOLERANCE, rtol=VAS_TOLERANCE)
    torch.testing.assert_close(vas, want, **bound(scheme, VAS_TOLERANCE))
    # greedy tokens as plain generate; span features as eager region pooling of the
    # teacher-forced sequence; the answer's VAS as the reference over it
    generated = model.generate(**inputs, **case["generate"])
    assert torch.equal(case["sequences"], generated)
    assert [(s.start, s.end) for s in case["spans"]] == [(0, 3), (3, 6)]
    full = teacher_forced(case, case["sequences"])
    _, attns, writes = eager_reference(eager, full)
    for s, want in zip(case["spans"], pooled(attns, case["region_ids"], case["spans"])):
        torch.testing.assert_close(s.features, want.float(), **bound(scheme, FEATURE_TOLERANCE))
    want_vas, _ = headscope.vas_features(attns, writes, full["attention_mask"])
    torch.testing.assert_close(case["final_vas"], want_vas, **bound(scheme, VAS_TOLERANCE))


def pooled(attns, region_ids, spans, norms=None):
    """Each span's ``(K, L*H)`` float64 reference features: the eager attentions (times
    each key's value norm, ``norms`` per layer ``(H, T)``) summed over each region's keys
    and averaged over the rows that predicted the span's tokens."""
    P = region_ids.shape[1]
    rid = torch.nn.functional.pad(region_ids, (0, N), value=-1)[0]
    K = int(rid.max()) + 1
    regions = torch.nn.functional.one_hot(rid.clamp(min=0), K).double() * (rid >= 0)[:, None]
    out = []
    for s in spans:
        rows = slice(P + s.start - 1, P + s.end - 1)
        out.append(torch.cat([
            torch.einsum("hqt,ht,tk->kh", a[0, :, rows].double(),
                         torch.ones(a.shape[1], a.shape[3], dtype=torch.float64)
                         if norms is None else norms[layer], regions)
            / (rows.stop - rows.start) for layer, a in enumerate(attns)], dim=-1))
    return out


def test_value_norms_and_residual_writes_read_the_quantized_o_proj(case):
    """Both read each layer's o_proj through its dense matrix: span features weighted by
    ``||W_O^h v_j||`` and VAS of the heads' writes into the residual stream, against
    references (in float64 but for the VAS op's float32) on the eager attentions, the
    v_proj outputs and that matrix; on the model loaded with eager attention, which
    computes what the reference reads."""
    eager, inputs = case["eager"], case["inputs"]
    every3 = lambda ids: len(ids) % 3 == 0  # noqa: E731
    with Tracer(eager, regions=4, vas=False, splitter=every3, features="both") as tr:
        spans = list(tr.generate(**inputs, **case["generate"]))
    full = teacher_forced(case, tr.sequences)
    layers = softmax_attention_layers(family_of(eager).decoder(eager))
    values, hooks = [], [layer.v_proj.register_forward_hook(
        lambda module, args, out: values.append(out)) for layer in layers]
    try:
        _, attns, writes = eager_reference(eager, full)
    finally:
        for h in hooks:
            h.remove()
    H = attns[0].shape[1]
    norms = []
    for layer, v in zip(layers, values):
        W = dense_weight(output_projection(layer)).double()
        Wh = W.reshape(W.shape[0], H, -1)                                  # (hidden, H, Dh)
        v = v[0].double().reshape(v.shape[1], -1, Wh.shape[2])            # (T, Hkv, Dh)
        v = v.repeat_interleave(H // v.shape[1], dim=1)                   # head h reads h // G
        norms.append(torch.linalg.vector_norm(torch.einsum("ohd,thd->hto", Wh, v), dim=-1))
    width = len(layers) * H
    for s, plain, weighted in zip(spans, pooled(attns, tr.region_ids, spans),
                                  pooled(attns, tr.region_ids, spans, norms)):
        torch.testing.assert_close(s.features[:, :width].double(), plain,
                                   atol=FEATURE_TOLERANCE, rtol=FEATURE_TOLERANCE)
        torch.testing.assert_close(s.features[:, width:].double(), weighted,
                                   atol=FEATURE_TOLERANCE, rtol=FEATURE_TOLERANCE)
        assert s.features[:, width:].abs().max() > 1e-3
    with torch.no_grad(), Tracer(eager, vas=True, writes="residual") as tr:
        eager(**full)
        stats = tr.vas_head_stats()
    want = []
    for layer, a, o in zip(layers, attns, writes):
        W = dense_weight(output_projection(layer)).double()
        resid = torch.einsum("bhtd,ehd->bhte", o.double(), W.reshape(W.shape[0], H, -1))
        want.append(headscope.vas_head_stats(a, resid.float(), full["attention_mask"].sum(-1)))
    torch.testing.assert_close(stats, torch.stack(want, 1), atol=VAS_TOLERANCE,
                               rtol=VAS_TOLERANCE)


# ---- region effects and gradients ---------------------------------------------------------

def test_region_effects_equal_one_region_at_a_time(case):
    model = case["model"]
    effects = region_effects(model, case["inputs"], case["sequences"], SPANS,
                             case["region_ids"], progress=False)
    want = _reference_effects(model, case["inputs"], case["sequences"], case["region_ids"],
                              [[k] for k in range(case["num_regions"])], "mask")
    tolerance = EFFECTS_TOLERANCE if case["scheme"] not in ROUNDS_ACTIVATIONS \
        else bound(case["scheme"], 0)
    torch.testing.assert_close(effects, want, **tolerance)
    assert effects.abs().max() > 1e-3


def dequantized_twin(folder, scheme, model):
    """The model loaded again with ``model``'s quantized decoder and output layers in
    plain linear layers holding their dense weights (its vision tower as ``model``'s, so
    that both decoders get the same inputs)."""
    twin = load(folder, scheme)
    decoder = family_of(twin).decoder(twin)
    names = {id(m): name for name, m in twin.named_modules()}
    for module in list(decoder.modules()) + [twin.get_output_embeddings()]:
        if not isinstance(module, torch.nn.Linear) or not is_quantized(module.weight):
            continue
        name = names[id(module)]
        dense = torch.nn.Linear(module.in_features, module.out_features,
                                bias=module.bias is not None)
        with torch.no_grad():
            dense.weight.copy_(dense_weight(model.get_submodule(name)))
            if module.bias is not None:
                dense.bias.copy_(module.bias)
        parent, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent), child, dense)
    return twin


def bitsandbytes_repacked(model) -> bool:
    """Whether bitsandbytes put the model's 4-bit weights into its CPU inference layout
    (at its first forward without gradients, on CPUs with AVX512-BF16)."""
    return any(getattr(getattr(m.weight, "quant_state", None), "packing_format_for_cpu", False)
               for m in model.modules() if isinstance(m, torch.nn.Linear))


def assert_gradients_as_the_twins(model, twin, case):
    args = (case["inputs"], case["sequences"], case["spans"], case["region_ids"])
    scores, norms = gradient_scores(model, *args)
    want_scores, want_norms = gradient_scores(twin, *args)
    torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-3)
    torch.testing.assert_close(norms, want_norms, atol=1e-5, rtol=1e-3)
    assert scores.abs().max() > 1e-4 and norms.min() > 1e-4
    relevance = attnlrp_scores(model, *args)
    torch.testing.assert_close(relevance, attnlrp_scores(twin, *args), atol=1e-5, rtol=1e-3)
    assert relevance.abs().max() > 1e-4


def assert_refused(model, case, reason):
    args = (case["inputs"], case["sequences"], case["spans"], case["region_ids"])
    for who, scores in (("gradient_scores", gradient_scores), ("attnlrp_scores", attnlrp_scores)):
        with pytest.raises(NotImplementedError, match=f"headscope.hf.{who}: ") as e:
            scores(model, *args)
        assert reason in str(e.value) and "\n" not in str(e.value)


def test_gradients_equal_the_dequantized_models_or_are_refused(case):
    """Input x gradient and AttnLRP of the quantized model equal those of the float model
    holding its dense weights (the quantized layers' backward is their dense weights'),
    or are refused with the reason. bitsandbytes: refused once its weights are in its CPU
    inference layout (the traced generation put them there, on CPUs with AVX512-BF16),
    equal on a freshly loaded model."""
    model, scheme = case["model"], case["scheme"]
    if scheme in NO_GRADIENT:
        assert_refused(model, case, NO_GRADIENT[scheme])
        return
    if scheme == "bnb-nf4" and bitsandbytes_repacked(model):
        assert_refused(model, case, "bitsandbytes repacked its 4-bit weight")
        model = load(case["folder"], scheme)
    assert_gradients_as_the_twins(model, dequantized_twin(case["folder"], scheme, model), case)


# ---- the commands: --quantize and bfloat16 ----------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Qwen2-VL checkpoint, a picture and a DATA folder of one image."""
    root = tmp_path_factory.mktemp("commands")
    picture = root / "quarters.png"
    quarters(40, 48, ((200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40))).save(
        picture)
    return tiny_checkpoint(root / "model", "qwen2_vl"), picture, tiny_dataset(root / "data", 1)


# each command runs once with each of these
LOADINGS = [pytest.param(("float32", "int8"), id="int8"),
            pytest.param(("float32", "int4"), id="int4"),
            pytest.param(("bfloat16", None), id="bfloat16")]


def loaded(folder, loading):
    from headscope.commands.models import load_model
    dtype, quantize = loading
    model, processor = load_model(str(folder), dtype, torch.device("cpu"), quantize)
    assert model.dtype == getattr(torch, dtype)
    assert any(is_quantized(m.weight) for m in model.modules()
               if isinstance(m, torch.nn.Linear)) == (quantize is not None)
    return model, processor


def options(loading):
    dtype, quantize = loading
    return ["--dtype", dtype] + ([] if quantize is None else ["--quantize", quantize])


@pytest.mark.parametrize("loading", LOADINGS)
def test_explain_command(saved, loading, tmp_path, capsys):
    from PIL import Image

    from headscope.explainer import prompt_inputs
    from headscope.hf import grid_regions
    folder, picture, _ = saved
    out = tmp_path / "out"
    code = main(["explain", "--model", str(folder), "--image", str(picture), "--prompt",
                 "describe the image .", "--regions", "2x2", "--max-new-tokens", "6",
                 "--out", str(out), *options(loading)])
    assert code == 0, capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["model"].endswith(f"({loading[1]} weights)" if loading[1] else "model")
    model, processor = loaded(folder, loading)
    inputs = prompt_inputs(processor, [Image.open(picture).convert("RGB")],
                           "describe the image .")
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2),
                                 tokenizer=processor.tokenizer) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=6, do_sample=False))
        vas = tr.vas_features()[0]
    assert [(s["start"], s["end"], s["token_ids"]) for s in report["spans"]] == \
        [(s.start, s.end, s.token_ids.tolist()) for s in spans]
    for ours, theirs in zip(report["spans"], spans):
        assert torch.equal(torch.tensor(ours["features"]), theirs.features)
        assert torch.isfinite(theirs.features).all() and theirs.features.abs().max() > 0
    reported = torch.tensor([report["vas_features"][c] for c in headscope.VAS_COLUMNS])
    assert torch.isfinite(vas).all()
    assert torch.equal(reported, vas.float())


@pytest.mark.parametrize("loading", LOADINGS)
def test_collect_command(saved, loading, tmp_path, capsys):
    from headscope.commands.collect import prompt_inputs
    from headscope.commands.collection import read_collection
    from headscope.commands.data import load_image, read_examples
    folder, _, data = saved
    out = tmp_path / "collection"
    argv = ["collect", "--model", str(folder), "--data", str(data), "--out", str(out),
            "--regions", "4", "--max-new-tokens", "4", "--subsets", "0", "--attnlrp",
            *options(loading)]
    assert main(argv) == 0
    collection = read_collection(out)
    assert json.loads((out / "manifest.json").read_text())["quantize"] == loading[1]
    # the example again, by hand, on the model load_model gives
    model, processor = loaded(folder, loading)
    (example,) = read_examples(data)
    inputs = prompt_inputs(processor, example, load_image(example), torch.device("cpu"))
    spans = []
    with torch.no_grad(), Tracer(model, regions=4, vas=False,
                                 tokenizer=processor.tokenizer) as tr:
        tr.generate_with(spans.append, **inputs, max_new_tokens=4, do_sample=False)
    t = collection.tensors
    mine = t["span_example"] == 0
    assert bool(mine.all())
    assert t["span_bounds"][mine].tolist() == [[s.start, s.end] for s in spans]
    torch.testing.assert_close(t["features"][mine], torch.stack([s.features for s in spans]))
    effects = region_effects(model, inputs, tr.sequences, spans, tr.region_ids, progress=False)
    torch.testing.assert_close(t["effects"][mine], effects)
    torch.testing.assert_close(t["attnlrp"][mine], attnlrp_scores(
        model, inputs, tr.sequences, spans, tr.region_ids))
    assert torch.isfinite(t["effects"]).all() and t["effects"].abs().max() > 0
    # resuming with other weights is refused: the manifest says how the model was loaded
    other = [a for a in argv if a not in ("--quantize", "int8", "int4")] if loading[1] \
        else argv + ["--quantize", "int8"]
    assert "quantize" in usage_error(capsys, *other)


@pytest.mark.parametrize("loading", LOADINGS)
def test_vas_command(saved, loading, tmp_path):
    from PIL import Image

    from headscope.commands.models import chat_inputs
    from headscope.commands.vas_table import read_table
    folder, _, data = saved
    out = tmp_path / "table"
    assert main(["vas", "--model", str(folder), "--data", str(data), "--out", str(out),
                 "--max-new-tokens", "3", *options(loading)]) == 0
    _, table = read_table(out)
    model, processor = loaded(folder, loading)
    image_ids = list(family_of(model).media_token_ids(model.config))
    records = [json.loads(x) for x in (data / "data.jsonl").read_text().splitlines()]
    assert table.num_rows == len(records) == 1
    for row, record in zip(table.to_pylist(), records):
        inputs = chat_inputs(processor, record["prompt"],
                             [Image.open(data / record["image"]).convert("RGB")], "cpu")
        with torch.no_grad(), Tracer(model, regions=None, vas=True) as tr:
            tr.generate_with(lambda span: None, **inputs, max_new_tokens=3, do_sample=False,
                             suppress_tokens=image_ids)
            want = tr.vas_features()[0]
        features = torch.tensor([row[c] for c in headscope.VAS_COLUMNS])
        assert torch.isfinite(features).all()
        torch.testing.assert_close(features, want, atol=1e-6, rtol=1e-6)


def test_explain_on_weights_that_pass_no_gradient(checkpoints, tmp_path):
    """torchao's dynamic int8 activations pass the gradient through their quantization
    scale only: explain's default without a head (the gradient norm) falls back to raw
    attention with a warning that says why, the page names it; asking for the gradient
    norm or AttnLRP is refused before anything is generated."""
    from headscope import explain
    folder = checkpoints["qwen2_vl"]
    model = load(folder, "torchao-int8-dynamic")
    processor = tf.AutoProcessor.from_pretrained(folder)
    picture = quarters(40, 48, ((200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40)))
    reason = NO_GRADIENT["torchao-int8-dynamic"]
    with pytest.warns(UserWarning, match=f"the page shows raw attention: .*{reason}"):
        result = explain(model, processor, [picture], "describe the image .", regions="2x2",
                         max_new_tokens=4)
    assert result.scorer == "attention" and result.report()["scorer"] == "attention"
    assert result.spans
    for span in result.spans:
        assert torch.equal(span.scores, span.attention) and span.scores.abs().max() > 0
    for scores in ("gradient", "attnlrp"):
        with pytest.raises(ValueError, match=f"scores='{scores}' cannot run on this model: "
                                             f".*{reason}"):
            explain(model, None, [picture], "describe the image .", scores=scores)


def test_quantize_refuses_a_bad_value_and_missing_packages(saved, tmp_path, capsys,
                                                           monkeypatch):
    import importlib.util
    folder, picture, _ = saved
    argv = ["explain", "--model", folder, "--image", picture, "--prompt", "x", "--out",
            tmp_path / "out"]
    assert "invalid choice: 'int3'" in usage_error(capsys, *argv, "--quantize", "int3")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "optimum" else find_spec(name, *a))
    assert "int8 needs optimum-quanto (pip install optimum-quanto" in \
        usage_error(capsys, *argv, "--quantize", "int8")
    assert not (tmp_path / "out").exists()
