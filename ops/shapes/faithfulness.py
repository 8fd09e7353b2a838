"""Faithfulness against time per token on the shapes model, the vStream paper's headline
figure: the trained attribution head, raw attention, gradient baselines and AttnLRP scored against
the true region ablation effects of each span of held-out descriptions.

Faithfulness: LDS (Spearman across regions per span, averaged over a scene's spans, then
over scenes, as ``python -m headscope eval`` does) and R^2 of predicted against true
effects over every (span, region) pair; the head predicts effects, so its R^2 is of its
predictions as they are; attention and gradients are not in effect units, so theirs is of
the best least-squares affine fit (one per method, over all spans). Time per generated
token: what each method adds to generation (see :func:`measure_faithfulness`).
"""
from __future__ import annotations

import time
from typing import List, Optional

import torch

from ..features import feature_columns, feature_set_holding
from ..hf import attnlrp_scores, gradient_scores, region_effects
from ..metrics import defined_mean, lds_per_image
from .accuracy import HELD_OUT_SEED
from .demo import DEFAULT_REGIONS
from .model import load, prompt
from .world import scene

# The head evaluation's held-out scenes (docs/shapes.md): HELD_OUT_SEED + EVAL_OFFSET + k.
EVAL_OFFSET = 500_000
METHODS = ("head", "attention", "gradient", "gradient_norm", "attnlrp",
           "perturbation")
LABELS = {"head": "trained head", "attention": "raw attention",
          "gradient": "input x gradient", "gradient_norm": "gradient norm",
          "attnlrp": "AttnLRP (log p)", "perturbation": "perturbation (exact ablation)"}


def r_squared(predicted: torch.Tensor, true: torch.Tensor) -> float:
    """``1 - SS_res / SS_tot`` of ``predicted`` as predictions of ``true`` (pooled)."""
    predicted, true = predicted.double().flatten(), true.double().flatten()
    residual = (true - predicted).square().sum()
    total = (true - true.mean()).square().sum()
    return float(1 - residual / total)


def affine_r_squared(scores: torch.Tensor, true: torch.Tensor) -> float:
    """R^2 of the least-squares fit ``true ~ a * scores + b`` (pooled)."""
    x, y = scores.double().flatten(), true.double().flatten()
    design = torch.stack([x, torch.ones_like(x)], 1)
    coef = torch.linalg.lstsq(design, y.unsqueeze(1)).solution
    return r_squared((design @ coef).squeeze(1), y)


def lds(scores: torch.Tensor, effects: torch.Tensor, span_scene: torch.Tensor,
        scenes: int) -> Optional[float]:
    """Spearman across regions per span, averaged per scene, then over scenes."""
    return defined_mean(lds_per_image(scores, effects, span_scene, scenes))


def scene_record(model, processor, head, seed: int, num_objects: int, regions: int,
                 max_new_tokens: int) -> dict:
    """One held-out scene: its description's spans, their true effects (mask ablation),
    every method's scores and the seconds each method took."""
    from ..hf import Tracer

    image, _ = scene(seed, num_objects)
    inputs = dict(prompt(processor, image))  # region_effects takes a plain dict
    spans = []
    # the head's columns and raw attention's
    features = feature_set_holding([head.feature_set, "attention"])
    with torch.no_grad(), Tracer(model, regions=regions, vas=False,
                                 tokenizer=processor.tokenizer, features=features) as tr:
        tr.generate_with(spans.append, **inputs, max_new_tokens=max_new_tokens,
                         do_sample=False)
    traced = torch.stack([s.features for s in spans])  # (S, K, F)
    head_features = feature_columns(traced, features, head.feature_set)
    attention = feature_columns(traced, features, "attention")
    scores = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        scores["head"] = head(head_features).float()
        t1 = time.perf_counter()
        scores["attention"] = attention.mean(-1)
        t2 = time.perf_counter()
        effects = region_effects(model, inputs, tr.sequences, spans, tr.region_ids,
                                 ablation="mask", progress=False)
        t3 = time.perf_counter()
    scores["gradient"], scores["gradient_norm"] = gradient_scores(
        model, inputs, tr.sequences, spans, tr.region_ids)
    t4 = time.perf_counter()
    scores["attnlrp"] = attnlrp_scores(model, inputs, tr.sequences, spans, tr.region_ids)
    t5 = time.perf_counter()
    scores["perturbation"] = effects
    seconds = {"head": t1 - t0, "attention": t2 - t1, "perturbation": t3 - t2,
               "gradient": t4 - t3, "gradient_norm": t4 - t3, "attnlrp": t5 - t4}
    return {"seed": seed, "objects": num_objects, "tokens": spans[-1].end,
            "spans": len(spans), "effects": effects, "scores": scores, "seconds": seconds}


def _summary(records: List[dict], latency: dict) -> dict:
    """Faithfulness and ms per token of every method over the scenes' records."""
    effects = torch.cat([r["effects"] for r in records])
    span_scene = torch.repeat_interleave(torch.arange(len(records)),
                                         torch.tensor([r["spans"] for r in records]))
    tokens = sum(r["tokens"] for r in records)
    ms = latency["ms_per_token"]
    tracer_added = ms["callback"] - ms["plain"]
    methods = {}
    for name in METHODS:
        scores = torch.cat([r["scores"][name] for r in records])
        own = 1e3 * sum(r["seconds"][name] for r in records) / tokens
        streamed = name in ("head", "attention")
        methods[name] = {
            "label": LABELS[name],
            "lds": lds(scores, effects, span_scene, len(records)),
            "r2": r_squared(scores, effects) if name in ("head", "perturbation")
            else affine_r_squared(scores, effects),
            "r2_of": {"head": "predictions as they are",
                      "perturbation": "by construction"}.get(name, "best affine fit"),
            # streamed scores: the tracer's added time (a negative difference is
            # noise, counted as 0) and the scores computed from its features
            "ms_per_token": max(tracer_added, 0.0) + own if streamed else own,
            "score_ms_per_token": own,
            "ms_per_span": 1e3 * sum(r["seconds"][name] for r in records)
            / int(span_scene.numel())}
    head_ms = methods["head"]["ms_per_token"]
    for m in methods.values():
        m["vs_head"] = m["ms_per_token"] / head_ms
    return {"methods": methods, "spans": int(span_scene.numel()), "tokens": tokens,
            "tracer_added_ms_per_token": tracer_added}


def measure_faithfulness(scenes: int = 40, *, regions: int = DEFAULT_REGIONS,
                         max_new_tokens: int = 48, latency: Optional[dict] = None,
                         latency_rounds: int = 7, latency_tokens: int = 40, model_dir=None,
                         progress: bool = True) -> dict:
    """Faithfulness (LDS, R^2) and time per generated token of each method on ``scenes``
    held-out scenes (seeds ``HELD_OUT_SEED + EVAL_OFFSET + k``, ``1 + k % 4`` objects: the
    head evaluation's).

    Time per token: the head and raw attention stream from the tracer's pooled features,
    so theirs is the tracer's added time over plain ``generate`` (``latency``, a result of
    :func:`~headscope.shapes.latency.measure_latency`, measured here when None:
    per-token time of ``generate_with`` minus plain ``generate``, alternating rounds in
    this process) plus the time to compute the scores from the features. The gradient
    methods: one forward over the whole sequence and one backward per span, per generated
    token. Perturbation: the exact ablation (``region_effects``, one forward per region),
    per generated token; its scores are the effects themselves (faithfulness 1 by
    construction)."""
    from tqdm import tqdm

    from .latency import measure_latency

    if scenes < 1:
        raise ValueError(f"headscope.shapes.measure_faithfulness: argument 'scenes' must be "
                         f">= 1, got {scenes}")
    if latency is None:
        latency = measure_latency(rounds=latency_rounds, new_tokens=latency_tokens,
                                  model_dir=model_dir, progress=progress)
    model, processor, head = load(model_dir)
    if head is None:
        raise FileNotFoundError("headscope.shapes.measure_faithfulness: the model folder has "
                                "no attribution head (head.safetensors)")
    records = []
    first = HELD_OUT_SEED + EVAL_OFFSET
    for k in tqdm(range(scenes), desc="faithfulness scenes", disable=not progress):
        records.append(scene_record(model, processor, head, first + k, 1 + k % 4, regions,
                                    max_new_tokens))
    return {"scenes": scenes, "seeds": [first, first + scenes - 1], "regions": regions,
            "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(),
            "latency": latency, **_summary(records, latency),
            "per_scene": [{k: r[k] for k in ("seed", "objects", "tokens", "spans")}
                          | {"seconds": r["seconds"]} for r in records]}


def table(result: dict) -> str:
    """The result as a markdown table."""
    lines = ["| method | LDS | R^2 | R^2 of | ms per token | of which scoring | ms per span "
             "| vs head |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in result["methods"].values():
        lines.append(f"| {m['label']} | {m['lds']:.3f} | {m['r2']:.3f} | {m['r2_of']} | "
                     f"{m['ms_per_token']:.3f} | {m['score_ms_per_token']:.4f} | "
                     f"{m['ms_per_span']:.2f} | {m['vs_head']:.1f}x |")
    return "\n".join(lines)
