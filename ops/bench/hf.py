"""The transformers integration (headscope.hf.Tracer) against plain inference and against
the usual way (eager attention with ``output_attentions=True`` and hooks on the
o_proj inputs), in one process, alternating:

* prefill: one forward over an image prompt (``logits_to_keep=1``, as generate's
  prefill), plain sdpa vs the tracer (VAS of every layer + Ward regions) vs eager with
  output_attentions + hooks + ``headscope.vas_features``; time and extra peak memory, and
  how the peak grows with the prompt's length;
* decode: time per generated token (the decode's time over its steps) of plain
  ``generate`` vs ``Tracer.generate`` streaming span attribution to a loop vs
  ``Tracer.generate_with`` (spans to a callback) vs ``Tracer.generate`` with
  ``features="both"`` (attention and value-norm-weighted columns) vs eager ``generate``
  with ``output_attentions=True``; the cost of the answer's VAS (one extra forward); peak
  memory of each generation.

* effects: ``region_effects`` of K = 8 regions on a 16-token answer after a 256-token
  image (two layers of the model below; ``--quick``: the tiny test model) batched (8 ablations per forward, the prompt's
  text before the image computed once) against one ablation per forward and against one
  plain model forward per region (attention mask with the region's keys masked out);
* collect: per example of ``python -m headscope collect`` on the tiny Qwen2-VL checkpoint
  and synthetic images, the time of plain generation, of the span features the Tracer
  adds, and of the ablation passes.

Prefill and decode run twice: on the Qwen2-VL model below, and on a Gemma-3-4B-shaped
decoder cut to 6 layers (5 sliding-window, 1 global; one 256-token image and 64 text
tokens, the prompt then grown to 4096 tokens), whose sliding layers the tracer pools step
by step.

Model: Qwen2-VL-2B-shaped text decoder (hidden 1536, 12 heads, 2 KV heads, head dim 128,
intermediate 8960, vocabulary 151936), 4 layers, random weights, a one-block vision tower;
one image of 1024 tokens and 64 text tokens (``--quick``: 256 image tokens, 2 layers).
"""
from __future__ import annotations

import statistics
import time

import torch

from ._util import mib, peak_bytes, print_table
from ..timing import TokenClock, interleaved, round_ratios

K_REGIONS = 16


def _model(quick: bool, attn: str, spec: str = "qwen2_vl", layers: int = 0,
           dtype: torch.dtype = torch.float32):
    """The Qwen2-VL-2B-shaped model (``layers`` of its decoder, default 4, ``quick`` 2;
    input and output embeddings tied, as in Qwen2-VL-2B) or the cut Gemma-3-4B."""
    from ..hf.testing import tiny_model
    if spec == "gemma3":
        return _gemma3(quick, attn)
    return tiny_model("qwen2_vl", hidden=1536, layers=layers or (2 if quick else 4), heads=12,
                      kv_heads=2, intermediate=8960, vocab=151936, vision_hidden=64,
                      attn_implementation=attn, dtype=dtype,
                      overrides={"tie_word_embeddings": True})


def _gemma3(quick: bool, attn: str):
    """Gemma-3-4B's decoder cut to 6 layers, 5 sliding-window (1024) and 1 global, its
    head counts and sizes (8 query and 4 key/value heads of 256), 256 tokens per image;
    a 32k vocabulary (262k would only add the embedding's memory: logits_to_keep=1).
    ``quick``: one sliding and one global layer of a quarter of the width, window 64."""
    from ..hf.testing import tiny_model
    layers = ["sliding_attention"] + (["full_attention"] if quick else
                                      ["sliding_attention"] * 4 + ["full_attention"])
    head_dim = 64 if quick else 256
    return tiny_model(
        "gemma3", hidden=640 if quick else 2560, layers=len(layers), heads=8, kv_heads=4,
        intermediate=2560 if quick else 10240, vocab=32768, vision_hidden=64,
        attn_implementation=attn,
        overrides={"mm_tokens_per_image": 64 if quick else 256,
                   "vision_config": {"image_size": 32 if quick else 64},
                   "text_config": {"sliding_window": 64 if quick else 1024, "layer_types": layers,
                                   "head_dim": head_dim, "query_pre_attn_scalar": head_dim}})


def _inputs(model, image_side: int, device, text: int = 64):
    """One image prompt of ``text`` text tokens (20 before the image): Qwen2-VL's image
    is image_side x image_side tokens ((2 image_side)^2 patches), Gemma 3's its fixed
    size."""
    from ..hf.testing import image_prompt
    inputs = image_prompt(model, grids=((2 * image_side, 2 * image_side),), text_before=(20,),
                          text_after=(text - 22,))
    return {k: v.to(device) for k, v in inputs.items()}


def _eager_today(model_eager, inputs):
    """Today's way: eager attention, output_attentions=True, hooks on the o_proj inputs,
    then the VAS features from the stored attentions."""
    import headscope
    from ..hf.testing import eager_reference
    _, attentions, writes = eager_reference(model_eager, inputs, logits_to_keep=1)
    return headscope.vas_features(attentions, writes, inputs["attention_mask"])[0]


def _traced_forward(tracer, model, inputs):
    """One forward with the tracer attached (detached again after): its VAS features."""
    tracer.attach()
    try:
        model(**inputs, logits_to_keep=1)
        return tracer.vas_features()
    finally:
        tracer.detach()


@torch.no_grad()
def bench_prefill(device, quick: bool, spec: str = "qwen2_vl") -> dict:
    from ..hf import Tracer
    model = _model(quick, "sdpa", spec).to(device)
    eager = _model(quick, "eager", spec).to(device)
    side = 16 if quick else 32
    inputs = _inputs(model, side, device)
    T = inputs["input_ids"].shape[1]
    tracer = Tracer(model, regions=K_REGIONS, vas=True)
    tracer.detach()

    def plain():
        return model(**inputs, logits_to_keep=1)

    def traced():
        return _traced_forward(tracer, model, inputs)

    torch.testing.assert_close(traced(), _eager_today(eager, inputs), atol=1e-4, rtol=1e-4)
    t = interleaved({"plain": plain, "traced": traced, "eager": lambda: _eager_today(eager, inputs)},
                    device, rounds=3 if quick else 5)
    r_traced = round_ratios(t["traced"], t["plain"])
    r_eager = round_ratios(t["eager"], t["plain"])
    rows = [{"what": "plain sdpa forward", "T": T, "ms": 1e3 * statistics.median(t["plain"]),
             "vs_plain": 1.0, "peak_MiB": mib(peak_bytes(plain, device))},
            {"what": "Tracer (VAS + regions)", "T": T,
             "ms": 1e3 * statistics.median(t["traced"]), "vs_plain": r_traced[0],
             "range": f"{r_traced[1]:.3f}-{r_traced[2]:.3f}",
             "peak_MiB": mib(peak_bytes(traced, device))},
            {"what": "eager + output_attentions", "T": T,
             "ms": 1e3 * statistics.median(t["eager"]), "vs_plain": r_eager[0],
             "range": f"{r_eager[1]:.3f}-{r_eager[2]:.3f}",
             "peak_MiB": mib(peak_bytes(lambda: _eager_today(eager, inputs), device))}]
    growth = []
    if spec == "gemma3":  # a fixed image: the prompt grows by its text
        sizes = [(side, n) for n in ((64, 512) if quick else (64, 1024, 4096 - 256))]
    else:
        sizes = [(s, 64) for s in ((8, 16) if quick else (16, 32, 48))]
    for s, text in sizes:
        inp = _inputs(model, s, device, text)
        growth.append({"what": "peak growth", "T": inp["input_ids"].shape[1],
                       "plain_MiB": mib(peak_bytes(lambda: model(**inp, logits_to_keep=1),
                                                   device)),
                       "traced_MiB": mib(peak_bytes(lambda: _traced_forward(tracer, model, inp),
                                                    device)),
                       "eager_MiB": mib(peak_bytes(lambda: _eager_today(eager, inp), device))})
    L = model.config.text_config.num_hidden_layers
    print_table(f"prefill, {spec}, one image prompt, {L} layers ({device.type}, float32)", rows,
                ["what", "T", "ms", "vs_plain", "range", "peak_MiB"])
    print_table("extra peak memory against prompt length", growth,
                ["what", "T", "plain_MiB", "traced_MiB", "eager_MiB"])
    return {"rows": rows, "growth": growth}


@torch.no_grad()
def bench_decode(device, quick: bool, spec: str = "qwen2_vl") -> dict:
    from ..hf import Tracer
    model = _model(quick, "sdpa", spec).to(device)
    eager = _model(quick, "eager", spec).to(device)
    inputs = _inputs(model, 16 if quick else 32, device)
    new = 16 if quick else 64
    gen = dict(max_new_tokens=new, do_sample=False, eos_token_id=None)
    tracer = Tracer(model, regions=K_REGIONS, vas=True)
    tracer.detach()
    tracer_both = Tracer(model, regions=K_REGIONS, vas=True, features="both")
    tracer_both.detach()
    per_token = {"plain": [], "traced": [], "callback": [], "both": [], "eager": []}
    spans = []

    def plain():
        clock = TokenClock()
        model.generate(**inputs, **gen, streamer=clock)
        per_token["plain"].append(clock.mean_per_token())

    def traced():
        clock = TokenClock()
        tracer.attach()
        try:
            spans[:] = list(tracer.generate(**inputs, **gen, streamer=clock))
        finally:
            tracer.detach()
        per_token["traced"].append(clock.mean_per_token())

    def callback():
        clock = TokenClock()
        got = []
        tracer.attach()
        try:
            tracer.generate_with(got.append, **inputs, **gen, streamer=clock)
        finally:
            tracer.detach()
        assert len(got) == 1 and got[0].end == new
        per_token["callback"].append(clock.mean_per_token())

    def both():
        clock = TokenClock()
        tracer_both.attach()
        try:
            got = list(tracer_both.generate(**inputs, **gen, streamer=clock))
        finally:
            tracer_both.detach()
        assert len(got) == 1 and got[0].features.shape[1] == 2 * spans[0].features.shape[1]
        per_token["both"].append(clock.mean_per_token())

    def today():
        clock = TokenClock()
        eager.generate(**inputs, **gen, streamer=clock, output_attentions=True,
                       return_dict_in_generate=True)
        per_token["eager"].append(clock.mean_per_token())

    for _ in range(2 if quick else 3):
        for fn in (plain, traced, callback, both, today):
            fn()
    assert len(spans) == 1 and spans[0].end == new
    ratio = round_ratios(per_token["traced"], per_token["plain"])
    ratio_cb = round_ratios(per_token["callback"], per_token["plain"])
    ratio_eager = round_ratios(per_token["eager"], per_token["plain"])
    ratio_both = round_ratios(per_token["both"], per_token["plain"])
    both_vs_attention = round_ratios(per_token["both"], per_token["traced"])

    tracer.attach()
    list(tracer.generate(**inputs, **gen))
    tracer.detach()
    t_vas = statistics.median(interleaved({"vas": tracer.answer_vas}, device, rounds=3)["vas"])
    t_prefill = statistics.median(interleaved(
        {"p": lambda: model(**inputs, logits_to_keep=1)}, device, rounds=3)["p"])
    rows = [{"what": "plain generate", "ms_per_token": 1e3 * statistics.median(per_token["plain"]),
             "vs_plain": 1.0, "peak_MiB": mib(peak_bytes(plain, device))},
            {"what": "Tracer.generate (spans)",
             "ms_per_token": 1e3 * statistics.median(per_token["traced"]), "vs_plain": ratio[0],
             "range": f"{ratio[1]:.3f}-{ratio[2]:.3f}", "peak_MiB": mib(peak_bytes(traced, device))},
            {"what": "Tracer.generate_with (callback)",
             "ms_per_token": 1e3 * statistics.median(per_token["callback"]),
             "vs_plain": ratio_cb[0], "range": f"{ratio_cb[1]:.3f}-{ratio_cb[2]:.3f}",
             "peak_MiB": mib(peak_bytes(callback, device))},
            {"what": 'Tracer.generate, features="both"',
             "ms_per_token": 1e3 * statistics.median(per_token["both"]),
             "vs_plain": ratio_both[0], "range": f"{ratio_both[1]:.3f}-{ratio_both[2]:.3f}",
             "vs_attention": both_vs_attention[0], "peak_MiB": mib(peak_bytes(both, device))},
            {"what": "eager + output_attentions",
             "ms_per_token": 1e3 * statistics.median(per_token["eager"]),
             "vs_plain": ratio_eager[0], "range": f"{ratio_eager[1]:.3f}-{ratio_eager[2]:.3f}",
             "peak_MiB": mib(peak_bytes(today, device))},
            {"what": "answer VAS (extra forward)", "ms": 1e3 * t_vas,
             "vs_prefill": t_vas / t_prefill}]
    T = inputs["input_ids"].shape[1]
    print_table(f"decode, {spec}, {new} new tokens after a {T}-token prompt ({device.type}, "
                f"float32)", rows,
                ["what", "ms_per_token", "vs_plain", "range", "vs_attention", "peak_MiB", "ms",
                 "vs_prefill"])
    return {"rows": rows}


def _naive_effects(model, inputs, sequences, rid, K: int) -> torch.Tensor:
    """One full forward of the model per region, the region's keys masked out through the
    attention mask: the way without region_effects (vision tower and prefix every time)."""
    P = inputs["input_ids"].shape[1]
    N = sequences.shape[1] - P
    full = dict(inputs, input_ids=sequences)
    for name in ("attention_mask", "mm_token_type_ids"):
        full[name] = torch.nn.functional.pad(full[name], (0, N), value=int(name == "attention_mask"))
    targets = sequences[0, P:, None]
    got = {}  # the positions of the unmasked sequence (Qwen-VL's rope index takes no holes)
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: got.update(kw),
                                                         with_kwargs=True)
    model(**full, logits_to_keep=1)
    hook.remove()
    full["position_ids"] = got["position_ids"]

    def logp(removed):
        mask = full["attention_mask"] * ~torch.nn.functional.pad(removed, (0, N))
        logits = model(**dict(full, attention_mask=mask)).logits[0, P - 1:P - 1 + N].float()
        return logits.log_softmax(-1).gather(1, targets).squeeze(1)

    base = logp(torch.zeros(P, dtype=torch.bool, device=sequences.device))
    return torch.stack([(base - logp(rid[0] == k)).sum() for k in range(K)])


@torch.no_grad()
def bench_effects(device, quick: bool) -> dict:
    """region_effects (mask ablation of K regions on one answer span) batched against one
    ablation per forward and against one plain model forward per region."""
    from ..hf import Tracer, region_effects
    from ..hf.testing import tiny_model
    # every ablation is a forward over the image and the answer: two layers of the
    # 2B-shaped decoder, or the tiny test model for --quick
    model = (tiny_model("qwen2_vl") if quick else _model(True, "sdpa")).to(device)
    inputs = _inputs(model, 16, device)
    K = 8
    new = 8 if quick else 16
    with Tracer(model, regions=K, vas=False) as tr:
        list(tr.generate(**inputs, max_new_tokens=new, do_sample=False, eos_token_id=None))
    sequences, rid = tr.sequences, tr.region_ids
    spans = [(0, new)]

    def batched():
        return region_effects(model, inputs, sequences, spans, rid, batch_size=8,
                              progress=False)

    def one_at_a_time():
        return region_effects(model, inputs, sequences, spans, rid, batch_size=1,
                              progress=False)

    def naive():
        return _naive_effects(model, inputs, sequences, rid, K)

    torch.testing.assert_close(batched()[0], naive().float(), atol=1e-3, rtol=1e-3)
    t = interleaved({"batched": batched, "one": one_at_a_time, "naive": naive}, device,
                    rounds=2 if quick else 5)
    r_one = round_ratios(t["one"], t["batched"])
    r_naive = round_ratios(t["naive"], t["batched"])
    rows = [{"what": "region_effects, batch 8", "s": statistics.median(t["batched"]),
             "vs_batched": 1.0},
            {"what": "region_effects, batch 1", "s": statistics.median(t["one"]),
             "vs_batched": r_one[0], "range": f"{r_one[1]:.3f}-{r_one[2]:.3f}"},
            {"what": "plain forward per region", "s": statistics.median(t["naive"]),
             "vs_batched": r_naive[0], "range": f"{r_naive[1]:.3f}-{r_naive[2]:.3f}"}]
    print_table(f"ablation effects of K = {K} regions + reference, T = {sequences.shape[1]} "
                f"({device.type}, float32)", rows, ["what", "s", "vs_batched", "range"])
    return {"rows": rows}


@torch.no_grad()
def bench_collect(device, quick: bool) -> dict:
    """Per example of ``python -m headscope collect`` (its ``collect_example``) on the tiny
    Qwen2-VL checkpoint and synthetic images (the CI's size), each example timed right
    after a plain ``generate`` of the same prompt: generation, the span features the Tracer
    adds to it, and the ablation passes."""
    import argparse
    import tempfile
    from pathlib import Path

    from ..commands.collect import add_arguments, collect_example, prompt_inputs
    from ..commands.data import load_image, read_examples
    from ..commands.models import load_model
    from ..hf.testing import tiny_checkpoint, tiny_dataset
    images, new = (2, 8) if quick else (8, 16)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--regions", "8", "--max-new-tokens", str(new)])
    plain, traced, ablation = [], [], []
    with tempfile.TemporaryDirectory() as root:
        model_dir = tiny_checkpoint(Path(root) / "model")
        examples = read_examples(tiny_dataset(Path(root) / "data", images))
        model, processor = load_model(str(model_dir), "float32", device)
        collect_example(model, processor, examples[0], args)  # warm-up
        for example in examples:
            inputs = prompt_inputs(processor, example, load_image(example), device)
            t0 = time.perf_counter()
            model.generate(**inputs, max_new_tokens=new, do_sample=False)
            plain.append(time.perf_counter() - t0)
            seconds = collect_example(model, processor, example, args)["seconds"].tolist()
            traced.append(seconds[0])
            ablation.append(seconds[1])
    generation = statistics.median(plain)
    features = statistics.median(t - p for t, p in zip(traced, plain))
    ablations = statistics.median(ablation)
    total = statistics.median(t + a for t, a in zip(traced, ablation))
    rows = [{"what": "generation", "ms": 1e3 * generation, "share": generation / total},
            {"what": "span features (Tracer)", "ms": 1e3 * features, "share": features / total},
            {"what": "ablation passes", "ms": 1e3 * ablations, "share": ablations / total},
            {"what": "collect, per example", "ms": 1e3 * total, "share": 1.0}]
    print_table(f"collect per example: tiny Qwen2-VL, {images} images, {new} new tokens, "
                f"K = 8, 8 subsets (medians)", rows, ["what", "ms", "share"])
    return {"rows": rows}


def run(device, quick: bool = False) -> dict:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install headscope[hf]): hf family skipped")
        return {}
    transformers.logging.set_verbosity_error()  # the vision tower's sdpa warns on attentions
    return {"prefill": bench_prefill(device, quick), "decode": bench_decode(device, quick),
            "prefill_gemma3": bench_prefill(device, quick, "gemma3"),
            "decode_gemma3": bench_decode(device, quick, "gemma3"),
            "effects": bench_effects(device, quick), "collect": bench_collect(device, quick)}
