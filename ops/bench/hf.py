"""The transformers integration (headscope.hf.Tracer) against plain inference and against
the usual way (eager attention with ``output_attentions=True`` and hooks on the
o_proj inputs), in one process, alternating:

* prefill: one forward over an image prompt (``logits_to_keep=1``, as generate's
  prefill), plain sdpa vs the tracer (VAS of every layer + Ward regions) vs eager with
  output_attentions + hooks + ``headscope.vas_features``; time and extra peak memory, and
  how the peak grows with the prompt's length;
* decode: time per generated token (median interval between streamer calls) of plain
  ``generate`` vs ``Tracer.generate`` streaming span attribution (which generates on a
  second thread; plain generate on a second thread is timed too, to tell the two costs
  apart), vs ``Tracer.generate_with`` (generate on the caller's thread, spans to a
  callback on a worker) vs eager ``generate`` with ``output_attentions=True``; the cost of
  the answer's VAS (one extra forward); peak memory of each generation.

Model: Qwen2-VL-2B-shaped text decoder (hidden 1536, 12 heads, 2 KV heads, head dim 128,
intermediate 8960, vocabulary 151936), 4 layers, random weights, a one-block vision tower;
one image of 1024 tokens and 64 text tokens (``--quick``: 256 image tokens, 2 layers).
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

from ._util import interleaved, mib, peak_bytes, print_table, round_ratios

K_REGIONS = 16


def _model(quick: bool, attn: str):
    from headscope.hf.testing import tiny_model
    return tiny_model("qwen2_vl", hidden=1536, layers=2 if quick else 4, heads=12, kv_heads=2,
                      intermediate=8960, vocab=151936, vision_hidden=64,
                      attn_implementation=attn)


def _inputs(model, image_side: int, device):
    from headscope.hf.testing import image_prompt
    # image_side x image_side tokens = (2 image_side)^2 patches; 64 text tokens in all
    inputs = image_prompt(model, grids=((2 * image_side, 2 * image_side),), text_before=(20,),
                          text_after=(42,))
    return {k: v.to(device) for k, v in inputs.items()}


class _Clock:
    """A streamer that notes when generate hands over each token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def per_token(self) -> float:
        gaps = [b - a for a, b in zip(self.times[1:], self.times[2:])]  # after the prefill
        return statistics.median(gaps)


def _eager_today(model_eager, inputs):
    """Today's way: eager attention, output_attentions=True, hooks on the o_proj inputs,
    then the VAS features from the stored attentions."""
    import headscope
    from headscope.hf.testing import eager_reference
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
def bench_prefill(device, quick: bool) -> dict:
    from headscope.hf import Tracer
    model, eager = _model(quick, "sdpa").to(device), _model(quick, "eager").to(device)
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
    for s in ((8, 16) if quick else (16, 32, 48)):
        inp = _inputs(model, s, device)
        growth.append({"what": "peak growth", "T": inp["input_ids"].shape[1],
                       "plain_MiB": mib(peak_bytes(lambda: model(**inp, logits_to_keep=1),
                                                   device)),
                       "traced_MiB": mib(peak_bytes(lambda: _traced_forward(tracer, model, inp),
                                                    device)),
                       "eager_MiB": mib(peak_bytes(lambda: _eager_today(eager, inp), device))})
    L = model.config.text_config.num_hidden_layers
    print_table(f"prefill, one image prompt, {L} layers ({device.type}, float32)", rows,
                ["what", "T", "ms", "vs_plain", "range", "peak_MiB"])
    print_table("extra peak memory against prompt length", growth,
                ["what", "T", "plain_MiB", "traced_MiB", "eager_MiB"])
    return {"rows": rows, "growth": growth}


@torch.no_grad()
def bench_decode(device, quick: bool) -> dict:
    from headscope.hf import Tracer
    model, eager = _model(quick, "sdpa").to(device), _model(quick, "eager").to(device)
    inputs = _inputs(model, 16 if quick else 32, device)
    new = 16 if quick else 64
    gen = dict(max_new_tokens=new, do_sample=False, eos_token_id=None)
    tracer = Tracer(model, regions=K_REGIONS, vas=True)
    tracer.detach()
    per_token = {"plain": [], "threaded": [], "traced": [], "callback": [], "eager": []}
    spans = []

    def plain():
        clock = _Clock()
        model.generate(**inputs, **gen, streamer=clock)
        per_token["plain"].append(clock.per_token())

    def threaded():
        """Plain generate on a second thread, as Tracer.generate runs it."""
        clock = _Clock()
        thread = threading.Thread(target=lambda: model.generate(**inputs, **gen, streamer=clock))
        thread.start()
        thread.join()
        per_token["threaded"].append(clock.per_token())

    def traced():
        clock = _Clock()
        tracer.attach()
        try:
            spans[:] = list(tracer.generate(**inputs, **gen, streamer=clock))
        finally:
            tracer.detach()
        per_token["traced"].append(clock.per_token())

    def callback():
        clock = _Clock()
        got = []
        tracer.attach()
        try:
            tracer.generate_with(got.append, **inputs, **gen, streamer=clock)
        finally:
            tracer.detach()
        assert len(got) == 1 and got[0].end == new
        per_token["callback"].append(clock.per_token())

    def today():
        clock = _Clock()
        eager.generate(**inputs, **gen, streamer=clock, output_attentions=True,
                       return_dict_in_generate=True)
        per_token["eager"].append(clock.per_token())

    for _ in range(2 if quick else 3):
        for fn in (plain, threaded, traced, callback, today):
            fn()
    assert len(spans) == 1 and spans[0].end == new
    ratio = round_ratios(per_token["traced"], per_token["plain"])
    ratio_thread = round_ratios(per_token["threaded"], per_token["plain"])
    ratio_own = round_ratios(per_token["traced"], per_token["threaded"])
    ratio_cb = round_ratios(per_token["callback"], per_token["plain"])
    ratio_eager = round_ratios(per_token["eager"], per_token["plain"])

    def answer_vas():
        tracer.attach()
        try:
            tracer._final = final
            return tracer.vas_features()
        finally:
            tracer.detach()
    tracer.attach()
    list(tracer.generate(**inputs, **gen))
    final = tracer._final
    tracer.detach()
    t_vas = statistics.median(interleaved({"vas": answer_vas}, device, rounds=3)["vas"])
    t_prefill = statistics.median(interleaved(
        {"p": lambda: model(**inputs, logits_to_keep=1)}, device, rounds=3)["p"])
    rows = [{"what": "plain generate", "ms_per_token": 1e3 * statistics.median(per_token["plain"]),
             "vs_plain": 1.0, "peak_MiB": mib(peak_bytes(plain, device))},
            {"what": "plain generate, own thread",
             "ms_per_token": 1e3 * statistics.median(per_token["threaded"]),
             "vs_plain": ratio_thread[0], "range": f"{ratio_thread[1]:.3f}-{ratio_thread[2]:.3f}"},
            {"what": "Tracer.generate (spans)",
             "ms_per_token": 1e3 * statistics.median(per_token["traced"]), "vs_plain": ratio[0],
             "range": f"{ratio[1]:.3f}-{ratio[2]:.3f}", "peak_MiB": mib(peak_bytes(traced, device)),
             "vs_threaded": ratio_own[0]},
            {"what": "Tracer.generate_with (callback)",
             "ms_per_token": 1e3 * statistics.median(per_token["callback"]),
             "vs_plain": ratio_cb[0], "range": f"{ratio_cb[1]:.3f}-{ratio_cb[2]:.3f}",
             "peak_MiB": mib(peak_bytes(callback, device))},
            {"what": "eager + output_attentions",
             "ms_per_token": 1e3 * statistics.median(per_token["eager"]),
             "vs_plain": ratio_eager[0], "range": f"{ratio_eager[1]:.3f}-{ratio_eager[2]:.3f}",
             "peak_MiB": mib(peak_bytes(today, device))},
            {"what": "answer VAS (extra forward)", "ms": 1e3 * t_vas,
             "vs_prefill": t_vas / t_prefill}]
    print_table(f"decode, {new} new tokens after a {inputs['input_ids'].shape[1]}-token prompt "
                f"({device.type}, float32)", rows,
                ["what", "ms_per_token", "vs_plain", "range", "vs_threaded", "peak_MiB", "ms",
                 "vs_prefill"])
    return {"rows": rows}


def run(device, quick: bool = False) -> dict:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install headscope[hf]): hf family skipped")
        return {}
    transformers.logging.set_verbosity_error()  # the vision tower's sdpa warns on attentions
    return {"prefill": bench_prefill(device, quick), "decode": bench_decode(device, quick)}
