"""Is the attribution head more faithful than raw attention? Measured on fixed seed
ranges, per image, with the paired difference's uncertainty.

Two ranges of held-out scene seeds, fixed before any tuning and disjoint from every other
use of seeds in the project (training: ``0 .. steps * batch - 1``; caption accuracy:
``HELD_OUT_SEED + k``; the ``eval`` tables and the faithfulness figure: ``+ 500_000``; the
demo: ``+ 900_000``; hallucination: ``+ 2_000_000``; the mixer model: ``+ 6_000_000``):

- ``"dev"``: ``HELD_OUT_SEED + 3_000_000 + k``, for developing and choosing settings;
- ``"reported"``: ``HELD_OUT_SEED + 4_000_000 + k``, for the reported numbers only, never
  used to choose anything;
- ``"heat-reported"``: ``HELD_OUT_SEED + 7_000_000 + k``, registered before anything was
  measured on it, for reporting the head fitted across region layouts (on the world's
  cells and on Ward regions) once, after it was chosen on the dev range;
- ``"heat-done"``: ``HELD_OUT_SEED + 8_000_000 + k``, registered before anything was
  measured on it: its first 300 scenes with 8 Ward regions are the check of the heat map
  (is the named object painted hotter than the rest of the picture), measured once.

Scene ``k`` of a range has ``1 + k % 4`` objects. Each scene's description is generated
inside a ``Tracer`` with the world's 3 x 3 cells as regions (by default) and the head's
feature set (``features``: the set every head evaluated reads from; "both" when heads of
different sets are compared), and every span is scored by each head and by the raw
baseline of each feature block (``FEATURE_BLOCKS``: the block's pooled mass averaged over
layers and heads: raw attention, and raw value-norm-weighted attention) and by AttnLRP
(``headscope.hf.attnlrp_scores``, the log-probability target, timed per span) against
its true effects (``region_effects``, ``ablation="mask"``). Every score is reported on two
sets of spans (``SPAN_SETS``): the sentence spans, where spans made only of special tokens
(the end-of-text span) are left out (they name nothing; ``python -m headscope train``
leaves them out of the fit by default too), and all spans, the end-of-text span included.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..features import FEATURE_BLOCKS, feature_columns, feature_set_holding
from ..metrics import in_box, lds_per_image, mean_with_interval
from .accuracy import HELD_OUT_SEED
from .demo import WORLD_GRID
from .figures import region_centroids
from .heat_eval import heat_measures, heat_table, object_tokens, summarise_heat
from .model import load, prompt
from .world import IMAGE_SIZE, match_object, parse_sentence, scene

if TYPE_CHECKING:
    from ..head import AttributionHead

SEED_RANGES = {"dev": HELD_OUT_SEED + 3_000_000, "reported": HELD_OUT_SEED + 4_000_000,
               "heat-reported": HELD_OUT_SEED + 7_000_000,
               "heat-done": HELD_OUT_SEED + 8_000_000}
RANGE_SIZE = 1_000_000  # scenes per range: the next range starts past it
HEAD = "head"  # a single head's label
RAW_NAMES = {"attention": "raw attention",
             "attention*value_norm": "raw value-norm-weighted attention",
             "attnlrp": "AttnLRP (log p)", "gradient": "gradient norm"}
POSTHOC = ("attnlrp", "gradient")  # post-hoc baselines, computed after generation
# The span sets every score is reported on: the top level of the result is the sentence
# spans, "all_spans" holds the same summary with the special-token-only spans put back.
SPAN_SETS = ("sentence", "all")
WHO = "headscope.shapes.head_eval"
CACHE_FORMAT = 2  # raised when what a scene record holds changes (2: no pickle)
SETTINGS = "settings.json"  # a cache folder's settings

def range_scenes(which: str, count: int) -> List[Tuple[int, int]]:
    """``(seed, num_objects)`` of the first ``count`` scenes of the ``which`` range."""
    if which not in SEED_RANGES:
        raise ValueError(f"{WHO}: the seed range must be one of {sorted(SEED_RANGES)}, got "
                         f"{which!r}")
    if not 1 <= count <= RANGE_SIZE:
        raise ValueError(f"{WHO}: argument 'count' must be in [1, {RANGE_SIZE}], got {count}")
    first = SEED_RANGES[which]
    return [(first + k, 1 + k % 4) for k in range(count)]


def check_traced(heads: Mapping[str, "AttributionHead"], features: str) -> None:
    """Every head's blocks are among those of the traced feature set."""
    if features not in FEATURE_BLOCKS:
        raise ValueError(f"{WHO}: features must be one of {sorted(FEATURE_BLOCKS)}, got "
                         f"{features!r}")
    for label, head in heads.items():
        missing = [b for b in FEATURE_BLOCKS[head.feature_set]
                   if b not in FEATURE_BLOCKS[features]]
        if missing:
            raise ValueError(f"{WHO}: {label} reads feature set {head.feature_set!r}, whose "
                             f"{missing[0]!r} block features={features!r} does not trace; "
                             f"trace {head.feature_set!r} or 'both'")


def scene_record(model, processor, heads: Mapping[str, "AttributionHead"], regions, seed: int,
                 num_objects: int, max_new_tokens: int, features: str = "attention") -> dict:
    """One scene: each span's scores (each head's, by its label, each raw block's, by the
    block's name, and AttnLRP's as ``"attnlrp"``), true effects, whether it is made only of
    special tokens (``special``), pointing and the seconds AttnLRP took. ``regions``: as
    ``Tracer`` takes them; ``features``: the set traced, holding every head's blocks."""
    image, objects = scene(seed, num_objects)
    inputs = prompt(processor, image)
    tracer, spans, record = scored_spans(model, processor, inputs, heads, regions,
                                         max_new_tokens, features)
    record.update(seed=seed, objects=num_objects)
    if not spans:
        return record
    (picture,) = tracer.images[0]
    labels = tracer.region_ids[0, picture.grid.positions].cpu().numpy()
    centroids = region_centroids(labels, (picture.rows, picture.cols), IMAGE_SIZE,
                                 tracer.num_regions[0])
    cell = torch.as_tensor(centroids, dtype=torch.float64)
    named = []  # (span, regions pointing at the object, its tokens) per span naming one
    for i, s in enumerate(spans):
        text = processor.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        obj = match_object(parse_sentence(text), objects)
        if obj is not None:
            named.append((i, in_box(*cell.unbind(1), obj.box),
                          object_tokens(picture.boxes, obj.box, IMAGE_SIZE)))
    finish_record(record, model, inputs, tracer, spans, named,
                  tracer.region_ids[0, picture.positions].cpu(), seed)
    return record


def traced_answer(model, processor, inputs, regions, max_new_tokens: int, features: str):
    """``(tracer, spans)``: the greedy answer to ``inputs`` generated inside a ``Tracer``
    with ``regions`` and ``features``, the tracer closed (``region_effects`` and the post-hoc
    scorers attach to the model themselves)."""
    from ..hf import Tracer
    spans = []
    with Tracer(model, regions=regions, vas=False, tokenizer=processor.tokenizer,
                features=features) as tracer:
        tracer.generate_with(spans.append, **inputs, max_new_tokens=max_new_tokens,
                             do_sample=False)
    return tracer, spans


def scored_spans(model, processor, inputs, heads: Mapping[str, "AttributionHead"], regions,
                 max_new_tokens: int, features: str):
    """``(tracer, spans, record)``: the greedy answer to ``inputs`` generated inside a
    ``Tracer`` with ``regions`` and ``features``, its spans, and a record of each span's
    scores (each head's, each raw block's, AttnLRP's and the gradient norm's), true
    single-region effects and ``special`` flags (only ``spans`` and ``special`` without a
    span)."""
    import time

    from ..hf import attnlrp_scores, gradient_norm_scores, region_effects

    tracer, spans = traced_answer(model, processor, inputs, regions, max_new_tokens, features)
    record = {"spans": len(spans),
              "special": torch.tensor([s.special for s in spans], dtype=torch.bool)}
    if not spans:
        return tracer, spans, record
    traced = torch.stack([s.features for s in spans]).float()  # (S, K, F)
    record["effects"] = region_effects(model, inputs, tracer.sequences, spans,
                                       tracer.region_ids, ablation="mask", progress=False)
    start = time.perf_counter()
    attnlrp = attnlrp_scores(model, inputs, tracer.sequences, spans, tracer.region_ids)
    middle = time.perf_counter()
    gradient = gradient_norm_scores(model, inputs, tracer.sequences, spans, tracer.region_ids)
    record["seconds"] = {"attnlrp": middle - start, "gradient": time.perf_counter() - middle}
    record["scores"] = {
        **{label: head(feature_columns(traced, features, head.feature_set)).float()
           for label, head in heads.items()},
        **{block: feature_columns(traced, features, block).mean(-1)
           for block in FEATURE_BLOCKS[features]},
        "attnlrp": attnlrp, "gradient": gradient}
    record["features"] = traced  # heads fitted later score the same spans
    return tracer, spans, record


def finish_record(record: dict, model, inputs, tracer, spans: Sequence, named: List[tuple],
                  token_labels: torch.Tensor, seed: int) -> None:
    """Adds to ``record`` (as :func:`scored_spans` made it) pointing by each scorer's
    region totals (``(hits per scorer, chance of a random region)`` per span of ``named``,
    as :func:`~headscope.shapes.heat_eval.heat_measures` takes it), the image tokens per
    region and the heat map's yardsticks."""
    from ..hf.curves import region_tokens
    tokens = region_tokens(tracer.region_ids, tracer.num_regions[0])
    record["pointing"] = [
        ({name: bool(hits[int(scores[i].argmax())]) for name, scores in record["scores"].items()},
         float(hits[tokens > 0].double().mean()))
        for i, hits, _ in named]
    record["tokens"] = tokens
    record["heat"] = heat_measures(
        model, inputs, tracer.sequences, spans, tracer.region_ids, record["scores"],
        record["effects"], named, token_labels, seed)


def compared_pairs(heads: Sequence[str], baselines: Sequence[str]) -> List[Tuple[str, str]]:
    """The paired differences reported: each head against each baseline, then each head
    against each later head."""
    return [(h, b) for h in heads for b in baselines] + \
        [(a, b) for i, a in enumerate(heads) for b in heads[i + 1:]]


def span_set(records: List[dict], which: str) -> List[dict]:
    """The records restricted to the spans of set ``which`` (``SPAN_SETS``): ``"sentence"``
    leaves out each record's special-token-only spans, ``"all"`` keeps every span; each
    record's ``special_spans`` counts the spans it left out."""
    if which not in SPAN_SETS:
        raise ValueError(f"{WHO}: the span set must be one of {list(SPAN_SETS)}, got "
                         f"{which!r}")
    out = []
    for r in records:
        keep = torch.ones(r["spans"], dtype=torch.bool) if which == "all" else ~r["special"]
        kept = {**r, "spans": int(keep.sum()), "special_spans": int((~keep).sum())}
        if "effects" in r:
            kept["effects"] = r["effects"][keep]
            kept["scores"] = {name: v[keep] for name, v in r["scores"].items()}
        out.append(kept)
    return out


def summarise(records: List[dict], heads: Sequence[str] = (HEAD,),
              baselines: Sequence[str] = ("attention",), spans: str = "sentence") -> dict:
    """Per-image LDS of each head (by label) and each raw baseline (by block name), the
    paired difference of each head to each baseline (``lds_difference["head - attention"]``)
    and, with several heads, of each head to each later one, with its standard error and
    bootstrap 95% interval over scenes, pointing, and the milliseconds per span of each
    baseline every record timed (``seconds``, over every span of the record), on the span
    set ``spans`` (:func:`span_set`). Scenes count where every scorer's LDS is defined."""
    chosen = span_set(records, spans)
    scored = [r for r in chosen if r["spans"]]
    if not scored:
        raise ValueError(f"{WHO}: no scene has a span to score (every span is only special "
                         f"tokens)")
    scorers = [*heads, *baselines]
    effects = torch.cat([r["effects"] for r in scored])
    span_scene = torch.repeat_interleave(torch.arange(len(scored)),
                                         torch.tensor([r["spans"] for r in scored]))
    lds = {name: lds_per_image(torch.cat([r["scores"][name] for r in scored]), effects,
                               span_scene, len(scored)) for name in scorers}
    defined = ~torch.stack([torch.isnan(lds[name]) for name in scorers]).any(0)
    cases = [c for r in scored for c in r["pointing"]]
    out = {"span_set": spans, "scenes": len(records), "scenes_scored": int(defined.sum()),
           "spans": int(span_scene.numel()),
           "special_spans_left_out": sum(r["special_spans"] for r in chosen),
           "heads": list(heads), "baselines": list(baselines),
           "lds": {name: mean_with_interval(lds[name][defined]) for name in scorers},
           "lds_difference": {f"{a} - {b}": mean_with_interval(lds[a][defined]
                                                               - lds[b][defined])
                              for a, b in compared_pairs(heads, baselines)},
           "pointing_spans": len(cases),
           "pointing": {name: (sum(hits[name] for hits, _ in cases) / len(cases)
                               if cases else None) for name in scorers}}
    out["pointing"]["random"] = (sum(chance for _, chance in cases) / len(cases)
                                 if cases else None)
    timed_records = [r for r in records if r["spans"]]
    timed = [name for name in baselines
             if all(name in r.get("seconds", {}) for r in timed_records)]
    every_span = sum(r["spans"] for r in timed_records)
    out["ms_per_span"] = {name: 1e3 * sum(r["seconds"][name] for r in timed_records)
                          / every_span for name in timed}
    return out


def summarise_span_sets(records: List[dict], heads: Sequence[str] = (HEAD,),
                        baselines: Sequence[str] = ("attention",)) -> dict:
    """:func:`summarise` on the sentence spans, with the same summary on all spans (the
    end-of-text span included) as ``"all_spans"``, and the heat map's yardsticks on the
    sentence spans (``heat_eval.summarise_heat``) as ``"heat"``."""
    return {**summarise(records, heads, baselines, "sentence"),
            "all_spans": summarise(records, heads, baselines, "all"),
            "heat": summarise_heat(records, heads, baselines)}


def head_labels(paths: Sequence[Path]) -> List[str]:
    """``"head"`` for one head file; ``"head:NAME"`` for several, NAME each file's name
    without its suffix (never a raw baseline's name)."""
    if len(paths) == 1:
        return [HEAD]
    labels = [f"{HEAD}:{Path(p).stem}" for p in paths]
    if len(set(labels)) < len(labels):
        raise ValueError(f"{WHO}: the head files {[str(p) for p in paths]} share a name; "
                         f"name them apart (each result is labelled by its file's name)")
    return labels


def evaluate_head(which: str = "reported", scenes: int = 300, *,
                  regions: Union[int, Tuple[int, int]] = WORLD_GRID, model_dir=None,
                  head_path: Union[None, Path, Sequence[Path]] = None,
                  features: Optional[str] = None, max_new_tokens: int = 48,
                  progress: bool = True, cache: Optional[Path] = None) -> dict:
    """The head against the raw baseline of each feature block and AttnLRP on the first
    ``scenes`` scenes of the ``which`` seed range (``"dev"`` or ``"reported"``); ``regions``:
    ``(rows, cols)`` for a grid (the world's cells by default) or K for Ward regions;
    ``head_path``: a head file other than the model folder's, or several (compared on the
    same spans, labelled ``head:NAME`` by file name); ``features``: the set to trace (default:
    the heads' own set, "both" for heads of different sets), which must hold every head's
    blocks; its blocks are the raw baselines; ``cache``: a folder that keeps each scene's
    record as it is measured, so that a rerun with the same settings resumes (another
    setting is refused). Returns :func:`summarise_span_sets`' result with the settings."""
    from ..hf import grid_regions

    chosen = range_scenes(which, scenes)
    model, processor, heads, features = model_and_heads(model_dir, head_path, features)
    traced = regions if isinstance(regions, int) else grid_regions(*regions)
    regions_name = regions if isinstance(regions, int) else "{}x{} grid".format(*regions)
    store = None if cache is None else SceneCache(cache, {
        "format": CACHE_FORMAT, "regions": regions_name, "features": features, "max_new_tokens": max_new_tokens,
        "model": "shipped" if model_dir is None else str(Path(model_dir).resolve()),
        "heads": {label: head_digest(h) for label, h in heads.items()}})
    records = measured_records(
        chosen, store, lambda seed, objects: scene_record(
            model, processor, heads, traced, seed, objects, max_new_tokens, features),
        f"head vs raw baselines ({which} seeds)", progress)
    return {"seed_range": which, "seeds": [chosen[0][0], chosen[-1][0]],
            "regions": regions_name,
            "max_new_tokens": max_new_tokens, "features": features,
            "head_feature_sets": {label: h.feature_set for label, h in heads.items()},
            **summarise_span_sets(records, list(heads), [*FEATURE_BLOCKS[features], *POSTHOC])}


def model_and_heads(model_dir, head_path: Union[None, Path, Sequence[Path]],
                    features: Optional[str]):
    """``(model, processor, heads, features)``: the shapes model in ``model_dir`` (None: the
    shipped one), its heads by label (the folder's own, or the files of ``head_path``,
    labelled by :func:`head_labels`) and the feature set to trace (``features``, or the
    heads' own), checked to hold every head's blocks."""
    from ..head import AttributionHead
    paths = [head_path] if isinstance(head_path, (str, Path)) else list(head_path or [])
    model, processor, head = load(model_dir, head=not paths)
    if paths:
        heads = {label: AttributionHead.load(str(path))
                 for label, path in zip(head_labels(paths), paths)}
    elif head is None:
        raise FileNotFoundError(f"{WHO}: the model folder has no attribution head "
                                f"(head.safetensors); pass a head file")
    else:
        heads = {HEAD: head}
    features = features or feature_set_holding(h.feature_set for h in heads.values())
    check_traced(heads, features)
    return model, processor, heads, features


def measured_records(chosen: Sequence[Tuple[int, int]], store: Optional["SceneCache"],
                     measure, desc: str, progress: bool) -> List[dict]:
    """The record of each ``(seed, objects)`` of ``chosen``: from ``store`` where it holds
    one, else ``measure(seed, objects)`` (kept in ``store``), with a progress bar."""
    from tqdm import tqdm
    records = []
    with torch.no_grad():
        for seed, objects in tqdm(chosen, desc=desc, disable=not progress):
            record = None if store is None else store.get(seed)
            if record is None:
                record = measure(seed, objects)
                if store is not None:
                    store.put(seed, record)
            records.append(record)
    return records


def head_digest(head) -> str:
    """SHA-256 of a head's tensors: which head a cached record was scored with."""
    return weights_digest(head, head.feature_set)


def weights_digest(module, salt: str = "") -> str:
    """SHA-256 of ``salt`` and a module's tensors (which weights a cached record was
    measured with)."""
    import hashlib
    digest = hashlib.sha256(salt.encode())
    for value in module.state_dict().values():
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class SceneCache:
    """A folder of scene records (``scene-SEED.safetensors``, each written atomically by
    ``headscope.io.save_state``: loading one runs no code) and the settings they were
    measured with (``settings.json``); other settings are refused."""

    def __init__(self, folder: Path, settings: dict):
        import json

        from ..io import write_json
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / SETTINGS
        if path.is_file():
            held = json.loads(path.read_text())
            if held != settings:
                differ = sorted(k for k in set(held) | set(settings)
                                if held.get(k) != settings.get(k))
                raise ValueError(f"{WHO}: the cache {self.folder} holds scenes measured with "
                                 f"other settings ({', '.join(differ)}); use another folder")
        else:
            write_json(path, settings)

    def get(self, seed: int) -> Optional[dict]:
        from ..io import load_state
        path = self.folder / f"scene-{seed}.safetensors"
        return load_state(path) if path.is_file() else None

    def put(self, seed: int, record: dict) -> None:
        from ..io import save_state
        save_state(self.folder / f"scene-{seed}.safetensors", record)

    @staticmethod
    def records(folder: Path) -> List[dict]:
        """Every scene record of a cache folder, in seed order."""
        from ..io import load_state
        paths = sorted(Path(folder).glob("scene-*.safetensors"),
                       key=lambda p: int(p.stem.split("-")[1]))
        return [load_state(p) for p in paths]


def scorer_names(result: dict):
    """A function naming each scorer of ``result`` for a table: the raw baselines' names,
    each head's label with its feature set."""
    sets = result.get("head_feature_sets", {})

    def name(scorer):
        if scorer in RAW_NAMES:
            return RAW_NAMES[scorer]
        return f"{scorer} ({sets[scorer]})" if scorer in sets else scorer
    return name


def table(result: dict, visuals: str = "scenes") -> str:
    """The result as markdown: per-image LDS with intervals of each head and raw baseline,
    and each head's paired difference to each baseline, on the sentence spans and on all
    spans; pointing. ``visuals``: what the result's items are called (scenes, clips)."""
    def cell(m):
        if m["interval95"] is None:
            return "n/a" if m["mean"] is None else f"{m['mean']:.3f} (one scene)"
        return f"{m['mean']:.3f} ± {m['se']:.3f} [{m['interval95'][0]:.3f}, " \
               f"{m['interval95'][1]:.3f}]"

    name = scorer_names(result)

    every = result["all_spans"]
    p = result["pointing"]
    pct = {k: "n/a" if v is None else f"{100 * v:.1f}%" for k, v in p.items()}
    rows = [f"| {name(s)} | {cell(result['lds'][s])} | {cell(every['lds'][s])} | {pct[s]} |"
            for s in [*result["heads"], *result["baselines"]]]
    rows += [f"| {name(a)} - {name(b)} (paired) | "
             f"{cell(result['lds_difference'][f'{a} - {b}'])} | "
             f"{cell(every['lds_difference'][f'{a} - {b}'])} | |"
             for a, b in compared_pairs(result["heads"], result["baselines"])]
    features = f", features {result['features']}" if "features" in result else ""
    regions = f"{result['regions']} Ward regions" if isinstance(result["regions"], int) \
        else result["regions"]
    timed = "; ".join(f"{name(k)}: {v:.1f} ms per span"
                      for k, v in result.get("ms_per_span", {}).items())
    return "\n".join([
        f"{result['scenes']} {visuals} ({result['seed_range']} seeds {result['seeds'][0]}.."
        f"{result['seeds'][1]}, {regions}{features}). Sentence spans: "
        f"{result['spans']} ({result['special_spans_left_out']} special-token-only spans "
        f"left out), {result['scenes_scored']} {visuals} with every LDS defined; all spans: "
        f"{every['spans']}, {every['scenes_scored']} {visuals}; {result['pointing_spans']} "
        f"spans name an object of the image (pointing).", "",
        "| scores | per-image LDS, sentence spans (mean ± s.e. [bootstrap 95%]) | "
        "per-image LDS, all spans | pointing |",
        "| --- | --- | --- | --- |", *rows,
        f"| a uniformly random region (expected) | | | {pct['random']} |",
        *([f"Post-hoc cost: {timed} (after generation, this process's threads)."]
          if timed else []),
        *(["", heat_table(result["heat"], name, visuals)] if result.get("heat") else [])])
