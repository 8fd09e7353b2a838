"""Per-token latency of the shapes model's generation with streaming span attribution
against plain ``generate``, measured in one process in alternating rounds."""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from ..timing import TokenClock, round_ratios
from .accuracy import held_out_scenes
from .demo import DEFAULT_REGIONS
from .model import load, prompt


def measure_latency(rounds: int = 7, new_tokens: int = 40, model_dir=None,
                    regions: int = DEFAULT_REGIONS, progress: bool = True) -> dict:
    """Time per generated token of plain ``generate``, ``Tracer.generate`` (spans through
    an iterator) and ``Tracer.generate_with`` (spans to a callback), each with the
    attribution head (or raw attention) applied to every span, on one held-out 4-object
    scene; ``new_tokens`` tokens (end of sequence ignored) per call, rounds alternating in
    one process. ``ms_per_token``: the decode's time over its steps (span ends included),
    median over rounds; ``median_step_ms``: the median interval between steps. Ratios:
    per round, median over rounds [min, max]."""
    from tqdm import tqdm

    from ..hf import Tracer

    model, processor, head = load(model_dir)
    _, image, _ = held_out_scenes(4)[3]
    inputs = prompt(processor, image)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    tracer = Tracer(model, regions=regions, vas=False, head=head,
                    tokenizer=processor.tokenizer)
    tracer.detach()

    def plain():
        clock = TokenClock()
        model.generate(**inputs, **gen, streamer=clock)
        return clock

    def traced():
        clock = TokenClock()
        with tracer.attach():
            spans = list(tracer.generate(**inputs, **gen, streamer=clock))
        assert spans[-1].end == new_tokens
        return clock

    def callback():
        clock = TokenClock()
        spans = []
        with tracer.attach():
            tracer.generate_with(spans.append, **inputs, **gen, streamer=clock)
        assert spans[-1].end == new_tokens
        return clock

    runs = {"plain": plain, "traced": traced, "callback": callback}
    mean = {name: [] for name in runs}
    step = {name: [] for name in runs}
    with torch.no_grad():
        for fn in runs.values():  # warm-up
            fn()
        for _ in tqdm(range(rounds), desc="latency rounds", disable=not progress):
            for name, fn in runs.items():
                clock = fn()
                mean[name].append(clock.mean_per_token())
                step[name].append(clock.per_token())
    result = {"new_tokens": new_tokens, "rounds": rounds, "threads": torch.get_num_threads(),
              "ms_per_token": {k: round(1e3 * statistics.median(v), 3) for k, v in mean.items()},
              "median_step_ms": {k: round(1e3 * statistics.median(v), 3)
                                 for k, v in step.items()}}
    for name in ("traced", "callback"):
        result[f"{name}_vs_plain"] = round_ratios(mean[name], mean["plain"])
        result[f"{name}_step_vs_plain"] = round_ratios(step[name], step["plain"])
    return result


LABELS = (("traced", "Tracer.generate"), ("callback", "Tracer.generate_with"))


def format_latency(result: dict, out: Callable[[str], None] = print) -> None:
    ms, step = result["ms_per_token"], result["median_step_ms"]
    out(f"per token over {result['new_tokens']} tokens, {result['rounds']} rounds, "
        f"{result['threads']} threads (decode time over steps; median step):")
    out(f"  plain generate            {ms['plain']:8.3f} ms             {step['plain']:8.3f} ms")
    for key, label in LABELS:
        mid, low, high = result[f"{key}_vs_plain"]
        smid = result[f"{key}_step_vs_plain"][0]
        out(f"  {label:25} {ms[key]:8.3f} ms  {mid:.3f}x plain [{low:.3f}-{high:.3f}]  "
            f"{step[key]:8.3f} ms  {smid:.3f}x")
