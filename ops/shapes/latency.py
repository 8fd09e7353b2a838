"""Per-token latency of the shapes model's generation with streaming span attribution
against plain ``generate``, measured in one process in alternating rounds."""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from ..bench._util import round_ratios
from ..bench.hf import _Clock
from .accuracy import held_out_scenes
from .demo import DEFAULT_REGIONS
from .model import load, prompt


def measure_latency(rounds: int = 7, new_tokens: int = 40, model_dir=None,
                    regions: int = DEFAULT_REGIONS, progress: bool = True) -> dict:
    """Median time per generated token (interval between streamer calls after the
    prefill) of plain ``generate``, ``Tracer.generate`` (spans through an iterator) and
    ``Tracer.generate_with`` (spans to a callback), each with the attribution head (or raw
    attention) applied to every span, on one held-out 4-object scene; ``new_tokens``
    tokens (end of sequence ignored) per call. Ratios: median over rounds [min, max]."""
    from tqdm import tqdm

    from ..hf import Tracer

    model, processor, head = load(model_dir)
    _, image, _ = held_out_scenes(4)[3]
    inputs = prompt(processor, image)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    tracer = Tracer(model, regions=regions, vas=False, head=head,
                    tokenizer=processor.tokenizer)
    tracer.detach()
    per_token = {"plain": [], "traced": [], "callback": []}

    def plain():
        clock = _Clock()
        model.generate(**inputs, **gen, streamer=clock)
        return clock

    def traced():
        clock = _Clock()
        with tracer.attach():
            spans = list(tracer.generate(**inputs, **gen, streamer=clock))
        assert spans[-1].end == new_tokens
        return clock

    def callback():
        clock = _Clock()
        spans = []
        with tracer.attach():
            tracer.generate_with(spans.append, **inputs, **gen, streamer=clock)
        assert spans[-1].end == new_tokens
        return clock

    runs = {"plain": plain, "traced": traced, "callback": callback}
    with torch.no_grad():
        for fn in runs.values():  # warm-up
            fn()
        for _ in tqdm(range(rounds), desc="latency rounds", disable=not progress):
            for name, fn in runs.items():
                per_token[name].append(fn().per_token())
    return {"new_tokens": new_tokens, "rounds": rounds, "threads": torch.get_num_threads(),
            "ms_per_token": {k: round(1e3 * statistics.median(v), 3)
                             for k, v in per_token.items()},
            "traced_vs_plain": round_ratios(per_token["traced"], per_token["plain"]),
            "callback_vs_plain": round_ratios(per_token["callback"], per_token["plain"])}


def format_latency(result: dict, out: Callable[[str], None] = print) -> None:
    ms = result["ms_per_token"]
    out(f"per token over {result['new_tokens']} tokens, {result['rounds']} rounds, "
        f"{result['threads']} threads:")
    out(f"  plain generate            {ms['plain']:8.3f} ms")
    for key, label, ratio in (("traced", "Tracer.generate", "traced_vs_plain"),
                              ("callback", "Tracer.generate_with", "callback_vs_plain")):
        mid, low, high = result[ratio]
        out(f"  {label:25} {ms[key]:8.3f} ms  {mid:.3f}x plain [{low:.3f}-{high:.3f}]")
