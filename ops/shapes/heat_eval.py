"""The field's yardsticks of a heat map, on the shapes world: per sentence span, the
deletion and insertion AUC of its regions taken in heat order (each region's score per
image token, hottest first; :func:`headscope.hf.heat_curves`), with the true single-region
effects' order and random orders as references; pointing by the painted heat (the region
hottest per image token); whether the named object is painted hotter than the rest of the
picture; and the R^2 of a head's predicted effects. ``head-eval`` (``head_eval.py``) adds
them to every scene it measures.

**Hotter than the rest**: over the image tokens whose cell centre lies in the named
object's box (the object's tokens; every object of the world covers at least one), the
mean heat per image token (the painted heat: the token's region's score per image token)
is above the mean over the picture's other image tokens.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..metrics import (hotter_than_rest, in_box, mean_with_interval, per_token, per_image,
                       r_squared)

CURVES = ("deletion", "insertion")
REFERENCES = ("effects", "random")  # the true-effect order, random orders
REFERENCE_NAMES = {"effects": "true-effect order (reference)",
                   "random": "random order (reference)"}
RANDOM_ORDERS = 2  # random orders per span, averaged


def object_tokens(token_boxes: torch.Tensor, box: Sequence[float], image_size: int
                  ) -> torch.Tensor:
    """``(T,)`` bool: the image tokens (``token_boxes`` ``(T, 4)``, normalised to the
    picture) whose cell centre lies in ``box`` (pixels of a ``image_size`` picture)."""
    centre_x = (token_boxes[:, 0] + token_boxes[:, 2]) / 2 * image_size
    centre_y = (token_boxes[:, 1] + token_boxes[:, 3]) / 2 * image_size
    return in_box(centre_x, centre_y, box)


def heat_measures(model, inputs, sequences, spans: Sequence, region_ids: torch.Tensor,
                  scores: Mapping[str, torch.Tensor], effects: torch.Tensor,
                  named: List[Tuple[int, torch.Tensor, torch.Tensor]],
                  token_labels: torch.Tensor, seed: int) -> dict:
    """One scene's (or clip's) yardsticks. ``scores``: each scorer's ``(S, K)`` region
    scores; ``effects``: the spans' single-region effects; ``named``: ``(span, hits,
    on_object)`` of each span that names an object, ``hits`` ``(K,)`` bool the regions
    that point at it (their centre on the object) and ``on_object`` ``(T,)`` bool its image
    tokens; ``token_labels`` ``(T,)``: each image token's region. Curves are measured on
    the sentence spans (``spans`` whose ``special`` is false)."""
    from ..hf import heat_curves
    from ..hf.curves import region_tokens

    sentence = torch.tensor([not getattr(s, "special", False) for s in spans])
    kept = sentence.nonzero().squeeze(1).tolist()
    out: Dict = {"sentence": sentence}
    if kept:
        curves, total = heat_curves(model, inputs, sequences, [spans[i] for i in kept],
                                    region_ids, {k: v[kept] for k, v in scores.items()},
                                    effects=effects[kept], random=RANDOM_ORDERS, seed=seed)
        out.update(curves=curves, total=total)
    tokens = region_tokens(region_ids, len(effects[0]) if len(effects) else None)
    pointing, hotter = [], []
    for i, hits, on_object in named:
        heats = {name: per_token(value[i], tokens) for name, value in scores.items()}
        heats["effects"] = per_token(effects[i], tokens)
        pointing.append({name: bool(hits[int(hottest(heat))]) for name, heat in heats.items()})
        hotter.append({name: hotter_than_rest(heat[token_labels], on_object)
                       for name, heat in heats.items()})
    out.update(pointing=pointing, hotter=hotter)
    return out


def hottest(heat: torch.Tensor) -> torch.Tensor:
    """The index of the largest entry of ``heat`` along its last dimension, NaN
    (a region without tokens) never chosen."""
    return torch.nan_to_num(heat, nan=-torch.inf).argmax(-1)


def summarise_heat(records: List[dict], heads: Sequence[str], baselines: Sequence[str]
                   ) -> Optional[dict]:
    """Over the scenes' sentence spans: each scorer's and reference's deletion and
    insertion AUC (per image: the mean over its spans where removing every image token has
    a positive effect; then mean, standard error and bootstrap 95% interval over images),
    each head's paired difference to each baseline, pointing by the painted heat and the
    share of object-naming spans painted hotter on the object than elsewhere, and each
    head's R^2 of its predicted effects (every sentence span and region pooled; and over
    all spans, the end-of-text ones included, as ``r_squared_all_spans``). None
    when no record was measured with the yardsticks."""
    scorers = [*heads, *baselines]
    names = [*scorers, *REFERENCES]
    scored = [r for r in records if "heat" in r and "curves" in r["heat"]]
    if not scored:
        return None
    out: Dict = {"scenes": len(scored),
                 "spans": sum(int(r["heat"]["total"].numel()) for r in scored)}
    for curve in CURVES:
        values = {name: torch.cat([r["heat"]["curves"][name][curve] for r in scored])
                  for name in names}
        span_scene = torch.repeat_interleave(
            torch.arange(len(scored)), torch.tensor([r["heat"]["total"].numel() for r in scored]))
        images = {name: per_image(v, span_scene, len(scored)) for name, v in values.items()}
        defined = ~torch.isnan(images[names[0]])
        out[curve] = {name: mean_with_interval(images[name][defined]) for name in names}
        out[f"{curve}_difference"] = {
            f"{h} - {b}": mean_with_interval(images[h][defined] - images[b][defined])
            for h in heads for b in [*baselines, *heads[heads.index(h) + 1:]]}
        out["scenes_scored"] = int(defined.sum())
    pointing = [c for r in scored for c in r["heat"]["pointing"]]
    hotter = [c for r in scored for c in r["heat"]["hotter"]]
    out["pointing_spans"] = len(pointing)
    out["pointing"] = {name: _share([c[name] for c in pointing]) for name in [*scorers,
                                                                               "effects"]}
    out["hotter"] = {name: _share([c[name] for c in hotter if c[name] is not None])
                     for name in [*scorers, "effects"]}
    for key, every in (("r_squared", False), ("r_squared_all_spans", True)):
        out[key] = {}
        for head in heads:
            keeps = [torch.ones_like(r["heat"]["sentence"]) if every else r["heat"]["sentence"]
                     for r in scored]
            out[key][head] = r_squared(
                torch.cat([r["scores"][head][k] for r, k in zip(scored, keeps)]),
                torch.cat([r["effects"][k] for r, k in zip(scored, keeps)]))
    return out


def _share(values: List[bool]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def heat_table(heat: dict, name, visuals: str = "scenes") -> str:
    """Markdown: deletion and insertion AUC per scorer and reference with intervals, each
    head's paired differences, pointing by heat, hotter than the rest, R^2. ``name``: a
    scorer's display name; ``visuals``: what the items are called (scenes, clips)."""
    def cell(m):
        if m["mean"] is None:
            return "n/a"
        if m["interval95"] is None:
            return f"{m['mean']:.3f}"
        return f"{m['mean']:.3f} [{m['interval95'][0]:.3f}, {m['interval95'][1]:.3f}]"

    def pct(v):
        return "" if v is None else f"{100 * v:.1f}%"
    rows = []
    for s in heat["deletion"]:
        label = REFERENCE_NAMES.get(s) or name(s)
        rows.append(f"| {label} | {cell(heat['deletion'][s])} | {cell(heat['insertion'][s])} | "
                    f"{pct(heat['pointing'].get(s))} | {pct(heat['hotter'].get(s))} | "
                    + ("" if heat["r_squared"].get(s) is None
                       else f"{heat['r_squared'][s]:.3f}") + " |")
    for pair in heat["deletion_difference"]:
        a, b = pair.split(" - ")
        rows.append(f"| {name(a)} - {name(b)} (paired) | "
                    f"{cell(heat['deletion_difference'][pair])} | "
                    f"{cell(heat['insertion_difference'][pair])} | | | |")
    every = "; ".join(f"{name(h)} {v:.3f}" for h, v in heat.get("r_squared_all_spans", {}).items()
                      if v is not None)
    return "\n".join([
        f"Heat map yardsticks on {heat['spans']} sentence spans of {heat['scenes_scored']} "
        f"{visuals} (deletion and insertion AUC: mean over images [bootstrap 95%]; regions in "
        f"order of score per image token); {heat['pointing_spans']} spans name an object.",
        "", "| scores | deletion AUC | insertion AUC | pointing by heat | object hotter than "
        "the rest | R^2 (nats) |", "| --- | --- | --- | --- | --- | --- |", *rows,
        *([f"R^2 over all spans (the end-of-text spans included): {every}."] if every
          else [])])


def across_layouts(layouts: Mapping[str, List[dict]], scorers: Sequence[str]) -> dict:
    """Which scorer takes the best deletion and insertion over several region layouts of
    the same scenes (``layouts``: each layout's scene records, as ``head-eval --cache``
    keeps them): per scene, each layout's mean over its sentence spans of deletion plus
    insertion AUC, averaged over the layouts; the mean over the scenes measured on every
    layout, with its bootstrap 95% interval, for each of ``scorers``, and the paired
    difference of the best to each other scorer."""
    per_layout = []
    for records in layouts.values():
        values = {}
        for r in records:
            curves = r.get("heat", {}).get("curves")
            if curves is None:
                continue
            defined = ~torch.isnan(curves["effects"]["deletion"])
            if defined.any():
                values[r["seed"]] = {n: float((curves[n]["deletion"] + curves[n]["insertion"])
                                              [defined].mean()) for n in scorers}
        per_layout.append(values)
    seeds = sorted(set.intersection(*(set(v) for v in per_layout)))
    score = {n: torch.tensor([sum(v[s][n] for v in per_layout) / len(per_layout)
                              for s in seeds], dtype=torch.float64) for n in scorers}
    means = {n: mean_with_interval(v) for n, v in score.items()}
    best = max(scorers, key=lambda n: means[n]["mean"])
    return {"layouts": list(layouts), "scenes": len(seeds), "deletion_plus_insertion": means,
            "best": best, "best_minus": {n: mean_with_interval(score[best] - score[n])
                                         for n in scorers if n != best}}


def across_layouts_table(result: dict, name) -> str:
    """Markdown of :func:`across_layouts`."""
    def cell(m):
        return f"{m['mean']:.3f} [{m['interval95'][0]:.3f}, {m['interval95'][1]:.3f}]"
    m = result["deletion_plus_insertion"]
    rows = [f"| {name(n)} | {cell(v)} | "
            + ("best |" if n == result["best"] else f"{cell(result['best_minus'][n])} |")
            for n, v in sorted(m.items(), key=lambda kv: -kv[1]["mean"])]
    return "\n".join([
        f"Deletion + insertion AUC averaged over {', '.join(result['layouts'])}, on the "
        f"{result['scenes']} scenes measured on each (mean [bootstrap 95%]):", "",
        f"| scores | deletion + insertion | {name(result['best'])} minus it (paired) |",
        "| --- | --- | --- |", *rows])
