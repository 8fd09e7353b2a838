"""Attribution in space and time, measured on clips of the shapes world with the video
model: the video head against raw attention, AttnLRP and the gradient norm on space-time
regions (per-clip LDS; deletion and insertion AUC in heat order; pointing in space and in
time), as ``head_eval`` measures the picture head on scenes.

**Regions.** ``"cells"``: the world's 3 x 3 cells in each frame group (a quarter of the
clip: the two frames the model merges into one token), 36 regions of 4 tokens; or K Ward
regions over space and time.

**Pointing in space**: a region points at a sentence's object when its centre (the mean of
its tokens' cell centres) lies in the object's box on a frame the region covers and the
object is on. **Pointing in time**, on the sentences of an event (appears, disappears,
moves): the frame group with the hottest mean heat per image token holds the event's
frames (chance: one group in four).

**The video head** is fitted with the shipped picture head's recipe (``--target ranks
--span-weights spans --calibration origin``, its layouts' weights), chosen before any
clip was measured, on clips of the training stream (``clip(k, 1 + k % 3)``, k <
``HEAD_CLIPS``) collected once per layout of ``HEAD_LAYOUTS``; nothing is chosen on the
held-out ranges (``accuracy.CLIP_SEED_RANGES``).
"""
from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..features import FEATURE_BLOCKS
from ..metrics import in_box, per_token
from .accuracy import CLIP_OBJECTS, CLIP_RANGE_SIZE, CLIP_SEED_RANGES
from .clips import clip, match_clip_object, parse_clip_sentence
from .head_eval import (POSTHOC, SceneCache, finish_record, head_digest, measured_records,
                        model_and_heads, scored_spans, scorer_names, summarise_span_sets,
                        table, traced_answer, weights_digest)
from .heat_eval import hottest
from .model import VIDEO_DIR, clip_prompt, load
from .world import IMAGE_SIZE

if TYPE_CHECKING:
    from ..head import AttributionHead

WHO = "headscope.shapes.clip_eval"
CELLS = "cells"  # the world's 3 x 3 cells in each frame group
# The layouts the video head is fitted on and their weights: the picture head's recipe
# (grids of 9 and 4 tokens a region, Ward regions of three counts), on 144 video tokens.
HEAD_LAYOUTS = (("2x2", 0.25), (CELLS, 2.0), (8, 1.0), (16, 1.0), (32, 1.0))
HEAD_CLIPS = 200  # training-stream clips the video head is fitted on
CACHE_FORMAT = 1
MAX_NEW_TOKENS = 72

Layout = Union[str, int]


def traced_regions(layout: Layout):
    """What ``Tracer`` takes for ``layout``: ``"cells"`` (3 x 3 per frame group),
    ``"RxC"`` (a grid per frame group) or K Ward regions over space and time."""
    from ..hf import grid_regions
    from ..hf.regions import parse_grid
    if isinstance(layout, int):
        return layout
    return grid_regions(*((3, 3) if layout == CELLS else parse_grid(layout)))


def layout_name(layout: Layout) -> str:
    return f"{layout} Ward regions" if isinstance(layout, int) else \
        "the world's cells per quarter" if layout == CELLS else f"a {layout} grid per quarter"


def clip_seeds(which: str, count: int) -> List[Tuple[int, int]]:
    """``(seed, objects)`` of the first ``count`` clips of a held-out range
    (``accuracy.CLIP_SEED_RANGES``; 1 to 3 objects in turn), or of the training stream
    (``"train"``: seeds 0, 1, ...)."""
    if which != "train" and which not in CLIP_SEED_RANGES:
        raise ValueError(f"{WHO}: the seed range must be 'train' or one of "
                         f"{sorted(CLIP_SEED_RANGES)}, got {which!r}")
    if not 1 <= count <= CLIP_RANGE_SIZE:
        raise ValueError(f"{WHO}: argument 'count' must be in [1, {CLIP_RANGE_SIZE}], got "
                         f"{count}")
    first = 0 if which == "train" else CLIP_SEED_RANGES[which]
    lo, hi = CLIP_OBJECTS
    return [(first + k, lo + k % (hi - lo + 1)) for k in range(count)]


def object_on_tokens(centres: torch.Tensor, token_frames: torch.Tensor, obj) -> torch.Tensor:
    """``(T,)`` bool: the video tokens whose cell centre (``centres`` ``(T, 2)`` pixels)
    lies in the object's box on a frame the token covers (``token_frames`` ``(T, 2)``,
    first and last) where the object is on."""
    on = torch.zeros(len(centres), dtype=torch.bool)
    for f, box in enumerate(obj.boxes):
        if box is not None:
            covers = (token_frames[:, 0] <= f) & (f <= token_frames[:, 1])
            on |= covers & in_box(centres[:, 0], centres[:, 1], box)
    return on


def token_centres(boxes: torch.Tensor) -> torch.Tensor:
    """``(T, 2)``: the centre (x, y) in pixels of the clip of each token's box (``boxes``
    ``(T, 4)``, normalised to the frame)."""
    return torch.stack([(boxes[:, 0] + boxes[:, 2]) / 2,
                        (boxes[:, 1] + boxes[:, 3]) / 2], 1) * IMAGE_SIZE


def region_hits(labels: torch.Tensor, centres: torch.Tensor, token_frames: torch.Tensor,
                K: int, obj) -> torch.Tensor:
    """``(K,)`` bool: the regions that point at ``obj`` in space (see the module's
    docstring); ``labels`` ``(T,)`` each token's region."""
    hits = torch.zeros(K, dtype=torch.bool)
    for k in range(K):
        mine = labels == k
        if not mine.any():
            continue
        x, y = centres[mine].mean(0).tolist()
        first, last = int(token_frames[mine, 0].min()), int(token_frames[mine, 1].max())
        hits[k] = any(obj.boxes[f] is not None and bool(in_box(x, y, obj.boxes[f]))
                      for f in range(first, last + 1))
    return hits


def hottest_group(heat: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor,
                  num_groups: int) -> int:
    """The frame group of the hottest mean heat per image token: ``heat`` ``(K,)`` per
    token of each region, ``labels`` and ``groups`` ``(T,)`` each token's region and
    group."""
    token_heat = heat[labels].nan_to_num(nan=0.0)
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, groups, token_heat)
    count = torch.bincount(groups, minlength=num_groups).double()
    return int(hottest(total / count.masked_fill(count == 0, float("nan"))))


def clip_record(model, processor, heads: Mapping[str, "AttributionHead"], regions, seed: int,
                num_objects: int, max_new_tokens: int = MAX_NEW_TOKENS,
                features: str = "attention") -> dict:
    """One clip, as ``head_eval.scene_record`` measures a scene, with pointing in space
    over space-time regions and ``time_pointing``: per sentence of an event, whether each
    scorer's (and the true effects') hottest frame group holds the event's frames."""
    from ..hf.curves import region_tokens
    frames, objects = clip(seed, num_objects)
    inputs = clip_prompt(processor, frames)
    tracer, spans, record = scored_spans(model, processor, inputs, heads, regions,
                                         max_new_tokens, features)
    record.update(seed=seed, objects=num_objects)
    if not spans:
        return record
    (video,) = tracer.videos[0]
    labels = tracer.region_ids[0, video.positions].cpu()
    K = tracer.num_regions[0]
    centres, token_frames = token_centres(video.boxes), video.token_frames
    groups = video.token_groups
    tokens = region_tokens(tracer.region_ids, K)
    named, in_time = [], []
    for i, s in enumerate(spans):
        text = processor.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        obj = match_clip_object(parse_clip_sentence(text), objects)
        if obj is None:
            continue
        named.append((i, region_hits(labels, centres, token_frames, K, obj),
                      object_on_tokens(centres, token_frames, obj)))
        if obj.quarter is not None:
            event = set(obj.event_frames)
            heats = {**record["scores"], "effects": record["effects"]}
            in_time.append({name: set(video.groups[hottest_group(
                per_token(value[i], tokens), labels, groups, len(video.groups))].frames)
                <= event for name, value in heats.items()})
    record["time_pointing"] = in_time
    record["groups"] = len(video.groups)
    finish_record(record, model, inputs, tracer, spans, named, labels, seed)
    return record


def summarise_time(records: List[dict], names: Sequence[str]) -> dict:
    """Pointing in time over the records' event sentences: each scorer's share of hits,
    the true effects' and a random frame group's (expected)."""
    cases = [c for r in records for c in r.get("time_pointing", [])]
    groups = [r["groups"] for r in records for _ in r.get("time_pointing", [])]
    share = {name: (sum(c[name] for c in cases) / len(cases) if cases else None)
             for name in [*names, "effects"]}
    share["random"] = sum(1 / g for g in groups) / len(groups) if groups else None
    return {"spans": len(cases), "share": share}


def evaluate_clips(which: str = "reported", clips: int = 150, *, layout: Layout = CELLS,
                   model_dir=None, head_path: Union[None, Path, Sequence[Path]] = None,
                   features: Optional[str] = None, max_new_tokens: int = MAX_NEW_TOKENS,
                   progress: bool = True, cache: Optional[Path] = None) -> dict:
    """The video head against the raw baselines, AttnLRP and the gradient norm on the
    first ``clips`` clips of the ``which`` range, as ``head_eval.evaluate_head`` on
    scenes (same arguments; ``layout``: ``"cells"``, ``"RxC"`` or K Ward regions), with
    pointing in time (``"time"``)."""
    chosen = clip_seeds(which, clips)
    model_dir = VIDEO_DIR if model_dir is None else Path(model_dir)
    model, processor, heads, features = model_and_heads(model_dir, head_path, features)
    store = None if cache is None else SceneCache(cache, {
        "format": CACHE_FORMAT, "layout": layout, "features": features,
        "max_new_tokens": max_new_tokens, "model": str(model_dir.resolve()),
        "heads": {label: head_digest(h) for label, h in heads.items()}})
    regions = traced_regions(layout)
    records = measured_records(
        chosen, store, lambda seed, objects: clip_record(
            model, processor, heads, regions, seed, objects, max_new_tokens, features),
        f"clips: head vs baselines ({which} seeds)", progress)
    baselines = [*FEATURE_BLOCKS[features], *POSTHOC]
    return {"seed_range": which, "seeds": [chosen[0][0], chosen[-1][0]],
            "regions": layout_name(layout), "max_new_tokens": max_new_tokens,
            "features": features,
            "head_feature_sets": {label: h.feature_set for label, h in heads.items()},
            **summarise_span_sets(records, list(heads), baselines),
            "time": summarise_time(records, [*heads, *baselines])}


def collect_clips(model, processor, layout: Layout, clips: int = HEAD_CLIPS,
                  features: str = "both", max_new_tokens: int = MAX_NEW_TOKENS,
                  progress: bool = True, cache: Optional[Path] = None) -> Dict[str, torch.Tensor]:
    """The training-stream clips' sentence spans as a head is fitted on them:
    ``features`` ``(S, K, F)`` and single-region ``effects`` ``(S, K)`` under ``layout``;
    ``cache``: a folder keeping each clip's spans (a rerun resumes)."""
    from ..hf import region_effects
    store = None if cache is None else SceneCache(cache, {
        "format": CACHE_FORMAT, "layout": layout, "features": features,
        "max_new_tokens": max_new_tokens, "model": weights_digest(model)})
    regions = traced_regions(layout)

    def measure(seed: int, num_objects: int) -> dict:
        frames, _ = clip(seed, num_objects)
        inputs = clip_prompt(processor, frames)
        tracer, spans = traced_answer(model, processor, inputs, regions, max_new_tokens,
                                      features)
        spans = [s for s in spans if not s.special]
        part = {"sentences": len(spans)}
        if spans:
            part["features"] = torch.stack([s.features for s in spans]).float()
            part["effects"] = region_effects(model, inputs, tracer.sequences, spans,
                                             tracer.region_ids, ablation="mask", progress=False)
        return part
    parts = [p for p in measured_records(clip_seeds("train", clips), store, measure,
                                         f"collect clips ({layout_name(layout)})", progress)
             if p["sentences"]]
    if not parts:
        raise ValueError(f"{WHO}: no clip of the training stream gave a sentence span")
    return {k: torch.cat([p[k] for p in parts]) for k in ("features", "effects")}


def fit_clip_head(model_dir=None, clips: int = HEAD_CLIPS, *, progress: bool = True,
                  cache: Optional[Path] = None, layouts=HEAD_LAYOUTS):
    """The video head: collected on ``clips`` training-stream clips per layout of
    ``layouts`` (``(layout, weight)``) and fitted with the picture head's recipe.
    ``cache``: a folder with one sub-folder per layout (a rerun resumes)."""
    from ..commands.collection import Collection
    from ..commands.train import fit
    model_dir = VIDEO_DIR if model_dir is None else Path(model_dir)
    model, processor, _ = load(model_dir, head=False)
    config = model.config.text_config
    manifest = {"num_layers": config.num_hidden_layers,
                "num_heads": config.num_attention_heads, "feature_set": "both"}
    datas = []
    for layout, _ in layouts:
        where = None if cache is None else Path(cache) / str(layout)
        tensors = collect_clips(model, processor, layout, clips, progress=progress,
                                cache=where)
        datas.append(Collection(manifest, tensors, [], []))
    recipe = Namespace(target="ranks", effect_weight=0.5, span_weights="spans",
                       calibration="origin", loss="lstsq", ridge=0.0, special_span_weight=None,
                       data_weight=[w for _, w in layouts])
    return fit(datas, recipe)


def time_table(result: dict, name) -> str:
    """Markdown: pointing in time per scorer."""
    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"
    t = result["time"]
    rows = [f"| {name(n)} | {pct(v)} |"
            for n, v in t["share"].items() if n not in ("effects", "random")]
    return "\n".join([
        f"Pointing in time on {t['spans']} sentences of an event (appears, disappears, "
        f"moves): the frame group of the hottest heat per image token holds the event's "
        f"frames.", "", "| scores | pointing in time |", "| --- | --- |", *rows,
        f"| true-effect order (reference) | {pct(t['share']['effects'])} |",
        f"| a uniformly random frame group (expected) | {pct(t['share']['random'])} |"])


def clip_table(result: dict) -> str:
    """The result as markdown: ``head_eval.table``'s tables and pointing in time."""
    return table(result, "clips") + "\n\n" + time_table(result, scorer_names(result))
