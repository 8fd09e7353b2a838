"""Is the attribution head more faithful than raw attention? Measured on fixed seed
ranges, per image, with the paired difference's uncertainty.

Two ranges of held-out scene seeds, fixed before any tuning and disjoint from every other
use of seeds in the project (training: ``0 .. steps * batch - 1``; caption accuracy:
``HELD_OUT_SEED + k``; the ``eval`` tables and the faithfulness figure: ``+ 500_000``; the
demo: ``+ 900_000``; hallucination: ``+ 2_000_000``):

- ``"dev"``: ``HELD_OUT_SEED + 3_000_000 + k``, for developing and choosing settings;
- ``"reported"``: ``HELD_OUT_SEED + 4_000_000 + k``, for the reported numbers only, never
  used to choose anything.

Scene ``k`` of a range has ``1 + k % 4`` objects. Each scene's description is generated
inside a ``Tracer`` with the world's 3 x 3 cells as regions (by default) and every span is
scored by the head and by raw attention (the pooled attention mass averaged over layers
and heads) against its true effects (``region_effects``, ``ablation="mask"``). Spans made
only of special tokens (the end-of-text span) are left out of every score: they name
nothing, and their count is reported.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..metrics import in_box, lds_per_image, mean_with_interval, random_pointing
from .accuracy import HELD_OUT_SEED
from .demo import WORLD_GRID
from .figures import region_centroids
from .model import load, prompt
from .world import IMAGE_SIZE, match_object, parse_sentence, scene

SEED_RANGES = {"dev": HELD_OUT_SEED + 3_000_000, "reported": HELD_OUT_SEED + 4_000_000}
RANGE_SIZE = 1_000_000  # scenes per range: the next range starts past it
SCORERS = ("head", "attention")
WHO = "headscope.shapes.head_eval"


def range_scenes(which: str, count: int) -> List[Tuple[int, int]]:
    """``(seed, num_objects)`` of the first ``count`` scenes of the ``which`` range."""
    if which not in SEED_RANGES:
        raise ValueError(f"{WHO}: the seed range must be one of {sorted(SEED_RANGES)}, got "
                         f"{which!r}")
    if not 1 <= count <= RANGE_SIZE:
        raise ValueError(f"{WHO}: argument 'count' must be in [1, {RANGE_SIZE}], got {count}")
    first = SEED_RANGES[which]
    return [(first + k, 1 + k % 4) for k in range(count)]


def special_only(token_ids: Sequence[int], special_ids: Sequence[int]) -> bool:
    """Whether every token of a span is a special token (such as the end-of-text span)."""
    special = set(int(t) for t in special_ids)
    return all(int(t) in special for t in token_ids)


def scene_record(model, processor, head, regions, seed: int, num_objects: int,
                 max_new_tokens: int) -> dict:
    """One scene: each kept span's head and attention scores, true effects and pointing.
    ``regions``: as ``Tracer`` takes them."""
    from ..hf import Tracer, region_effects

    image, objects = scene(seed, num_objects)
    inputs = prompt(processor, image)
    spans = []
    # region_effects attaches to the model itself, so the tracer is closed before it runs
    with Tracer(model, regions=regions, vas=False, tokenizer=processor.tokenizer) as tracer:
        tracer.generate_with(spans.append, **inputs, max_new_tokens=max_new_tokens,
                             do_sample=False)
    (picture,) = tracer.images[0]
    labels = tracer.region_ids[0, picture.grid.positions].cpu().numpy()
    K = tracer.num_regions[0]
    centroids = region_centroids(labels, (picture.rows, picture.cols), IMAGE_SIZE, K)
    special = processor.tokenizer.all_special_ids
    kept = [s for s in spans if not special_only(s.token_ids.tolist(), special)]
    record = {"seed": seed, "objects": num_objects, "spans": len(kept),
              "special_spans": len(spans) - len(kept)}
    if not kept:
        return record
    features = torch.stack([s.features for s in kept]).float()  # (S, K, L*H)
    record["effects"] = region_effects(model, inputs, tracer.sequences, kept,
                                       tracer.region_ids, ablation="mask", progress=False)
    record["scores"] = {"head": head(features).float(), "attention": features.mean(-1)}
    pointing = []  # (hit per scorer, chance of a random region) per span naming an object
    for i, s in enumerate(kept):
        text = processor.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        obj = match_object(parse_sentence(text), objects)
        if obj is None:
            continue
        hits = {name: bool(in_box(*centroids[int(record["scores"][name][i].argmax())],
                                  obj.box)) for name in SCORERS}
        cell = torch.as_tensor(centroids, dtype=torch.float64)
        pointing.append((hits, random_pointing([(None, cell, obj.box)])))
    record["pointing"] = pointing
    return record


def summarise(records: List[dict]) -> dict:
    """Per-image LDS of each scorer, their paired difference (head minus attention) with
    its standard error and bootstrap 95% interval over scenes, and pointing."""
    scored = [r for r in records if r["spans"]]
    if not scored:
        raise ValueError(f"{WHO}: no scene has a span to score (every span is only special "
                         f"tokens)")
    effects = torch.cat([r["effects"] for r in scored])
    span_scene = torch.repeat_interleave(torch.arange(len(scored)),
                                         torch.tensor([r["spans"] for r in scored]))
    lds = {name: lds_per_image(torch.cat([r["scores"][name] for r in scored]), effects,
                               span_scene, len(scored)) for name in SCORERS}
    both = ~(torch.isnan(lds["head"]) | torch.isnan(lds["attention"]))
    cases = [c for r in scored for c in r["pointing"]]
    out = {"scenes": len(records), "scenes_scored": int(both.sum()),
           "spans": int(span_scene.numel()),
           "special_spans_left_out": sum(r["special_spans"] for r in records),
           "lds": {name: mean_with_interval(lds[name][both]) for name in SCORERS},
           "lds_difference": mean_with_interval(lds["head"][both] - lds["attention"][both]),
           "pointing_spans": len(cases),
           "pointing": {name: (sum(hits[name] for hits, _ in cases) / len(cases)
                               if cases else None) for name in SCORERS}}
    out["pointing"]["random"] = (sum(chance for _, chance in cases) / len(cases)
                                 if cases else None)
    return out


def evaluate_head(which: str = "reported", scenes: int = 300, *,
                  regions: Union[int, Tuple[int, int]] = WORLD_GRID, model_dir=None,
                  head_path: Optional[Path] = None, max_new_tokens: int = 48,
                  progress: bool = True) -> dict:
    """The head against raw attention on the first ``scenes`` scenes of the ``which`` seed
    range (``"dev"`` or ``"reported"``); ``regions``: ``(rows, cols)`` for a grid (the
    world's cells by default) or K for Ward regions; ``head_path``: a head other than the
    model folder's. Returns :func:`summarise`'s result with the settings."""
    from tqdm import tqdm

    from ..attribution import AttributionHead
    from ..hf import grid_regions

    chosen = range_scenes(which, scenes)
    model, processor, head = load(model_dir, head=head_path is None)
    if head_path is not None:
        head = AttributionHead.load(str(head_path))
    if head is None:
        raise FileNotFoundError(f"{WHO}: the model folder has no attribution head "
                                f"(head.safetensors); pass a head file")
    traced = regions if isinstance(regions, int) else grid_regions(*regions)
    records = []
    with torch.no_grad():
        for seed, num_objects in tqdm(chosen, desc=f"head vs attention ({which} seeds)",
                                      disable=not progress):
            records.append(scene_record(model, processor, head, traced, seed, num_objects,
                                        max_new_tokens))
    return {"seed_range": which, "seeds": [chosen[0][0], chosen[-1][0]],
            "regions": regions if isinstance(regions, int) else "{}x{} grid".format(*regions),
            "max_new_tokens": max_new_tokens, **summarise(records)}


def table(result: dict) -> str:
    """The result as markdown: per-image LDS with intervals, the difference, pointing."""
    def cell(m):
        if m["interval95"] is None:
            return "n/a" if m["mean"] is None else f"{m['mean']:.3f} (one scene)"
        return f"{m['mean']:.3f} ± {m['se']:.3f} [{m['interval95'][0]:.3f}, " \
               f"{m['interval95'][1]:.3f}]"

    p = result["pointing"]
    pct = {k: "n/a" if v is None else f"{100 * v:.1f}%" for k, v in p.items()}
    return "\n".join([
        f"{result['scenes']} scenes ({result['seed_range']} seeds {result['seeds'][0]}.."
        f"{result['seeds'][1]}, {result['regions']}), {result['scenes_scored']} with both "
        f"LDS defined; {result['spans']} spans, {result['special_spans_left_out']} "
        f"special-token-only spans left out; {result['pointing_spans']} spans name an "
        f"object of the image (pointing).", "",
        "| scores | per-image LDS (mean ± s.e. [bootstrap 95%]) | pointing |",
        "| --- | --- | --- |",
        f"| head | {cell(result['lds']['head'])} | {pct['head']} |",
        f"| raw attention | {cell(result['lds']['attention'])} | {pct['attention']} |",
        f"| head - raw attention (paired) | {cell(result['lds_difference'])} | |",
        f"| a uniformly random region (expected) | | {pct['random']} |"])
