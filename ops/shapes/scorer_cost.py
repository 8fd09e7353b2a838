"""What each scorer of ``headscope.explain`` costs on the shapes model: the time of a
whole explained answer (generation under the tracer, each span's scores, VAS) with each
scorer, in alternating rounds in one process, against raw attention (which the tracer
computes while it generates), and the added time per span."""
from __future__ import annotations

import statistics
import time

import torch

from ..timing import round_ratios
from .accuracy import held_out_scenes
from .demo import DEFAULT_REGIONS
from .model import load, prompt
from .world import PROMPT


def measure_scorer_cost(rounds: int = 9, regions: int = DEFAULT_REGIONS,
                        max_new_tokens: int = 48, model_dir=None,
                        progress: bool = True) -> dict:
    """Seconds per explained answer of each scorer (``headscope.explainer.scorers
    .SCORERS``; the head is the model folder's) on one held-out 4-object scene, median over
    ``rounds`` rounds that take every scorer in turn after a warm-up; each scorer's ratio
    to raw attention (median [lowest, highest] over the rounds) and its added milliseconds
    per span (the median's difference over the answer's spans)."""
    from tqdm import tqdm

    from ..explainer import explain
    from ..explainer.scorers import SCORERS

    model, processor, head = load(model_dir)
    _, image, _ = held_out_scenes(4)[3]
    inputs = prompt(processor, image)
    scorers = [s for s in SCORERS if s != "head" or head is not None]
    spans = {}

    def run(scorer):
        start = time.perf_counter()
        result = explain(model, processor, [image], PROMPT, head if scorer == "head" else None,
                         scores=scorer, regions=regions, inputs=inputs,
                         max_new_tokens=max_new_tokens)
        spans[scorer] = len(result.spans)
        return time.perf_counter() - start

    seconds = {s: [] for s in scorers}
    for s in scorers:  # warm-up
        run(s)
    for _ in tqdm(range(rounds), desc="scorer rounds", disable=not progress):
        for s in scorers:
            seconds[s].append(run(s))
    base = statistics.median(seconds["attention"])
    return {"rounds": rounds, "regions": regions, "max_new_tokens": max_new_tokens,
            "threads": torch.get_num_threads(),
            "spans": spans["attention"],
            "seconds": {s: round(statistics.median(v), 4) for s, v in seconds.items()},
            "vs_attention": {s: round_ratios(v, seconds["attention"])
                             for s, v in seconds.items()},
            "added_ms_per_span": {s: round(1e3 * (statistics.median(v) - base) / spans[s], 1)
                                  for s, v in seconds.items()}}


def table(result: dict) -> str:
    """Markdown: each scorer's seconds per answer, ratio to raw attention, ms per span."""
    from ..explainer.scorers import SCORERS
    rows = []
    for s, sec in result["seconds"].items():
        mid, low, high = result["vs_attention"][s]
        rows.append(f"| {SCORERS[s]} (`{s}`) | {1e3 * sec:.0f} | {mid:.2f}x [{low:.2f}-{high:.2f}]"
                    f" | {result['added_ms_per_span'][s]:.1f} |")
    return "\n".join([
        f"One answer of {result['spans']} spans, {result['regions']} Ward regions, "
        f"{result['rounds']} rounds, {result['threads']} threads:", "",
        "| scores | ms per answer (median) | vs raw attention [range over rounds] | added ms "
        "per span |", "| --- | --- | --- | --- |", *rows])
