"""``python -m headscope.shapes reproduce``: every measurement of docs/shapes.md in one
command, in order: caption accuracy, the shipped head against raw attention, raw
value-norm-weighted attention, AttnLRP and the gradient norm on the heat-reported seed
range, on the world's cells and on 8 Ward regions (per-image LDS with the paired
differences' intervals, pointing, the heat map's yardsticks: deletion and insertion AUC,
pointing by heat, object hotter than the rest, R^2), the page's heat-check on the heat-done
range, what each scorer of ``headscope.explain`` costs, the shipped head against the same
raw baselines,
AttnLRP and random pointing (``python -m headscope eval`` on the held-out scenes, with Ward
regions and with the world's 3 x 3 cells; the head is the shipped one, not refitted),
latency, the
faithfulness figure, hallucination detection (on ordinary scenes of 1 to 4 objects and
on hard ones of 5 to 9), and the model with mixer vision attention against the softmax one
(caption accuracy, projection settings); then the video model: its exact descriptions of
held-out clips, and the video head against the same baselines over space-time regions (the
world's cells in each quarter, and 16 Ward regions; pointing in space and in time).

Each step's result goes into ``OUT/results.json`` (and ``OUT/results.md``) as soon as it
finishes, written atomically; a rerun skips the steps already there with the same
settings, model and format, so an interrupted run resumes where it stopped. A step whose
measurement has changed since (its ``FORMATS`` number) runs again, and so does a step that
reuses one that ran again (``USES``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Dict, Optional

from ..io import write_json, write_text
from .accuracy import HELD_OUT_SEED
from .faithfulness import EVAL_OFFSET

RESULTS = "results.json"
STEPS = ("accuracy", "head_vs_attention", "head_vs_attention_ward", "heat_check",
         "scorer_cost", "head_eval", "head_eval_grid", "latency", "faithfulness",
         "hallucination", "hallucination_hard", "mixer", "video_accuracy", "video_head_cells",
         "video_head_ward")
FULL = {"accuracy": {"scenes": 200},
        "head_vs_attention": {"seeds": "heat-reported", "scenes": 300, "grid": [3, 3],
                              "features": "both"},
        "head_vs_attention_ward": {"seeds": "heat-reported", "scenes": 300, "regions": 8,
                                   "features": "both"},
        "heat_check": {"seeds": "heat-done", "scenes": 300, "regions": 8},
        "scorer_cost": {"rounds": 9, "regions": 8, "tokens": 48},
        "head_eval": {"scenes": 60, "regions": 8, "max_new_tokens": 48, "subsets": 8,
                      "features": "both"},
        "head_eval_grid": {"scenes": 60, "grid": "3x3", "max_new_tokens": 48, "subsets": 8,
                           "features": "both"},
        "latency": {"rounds": 9, "tokens": 40},
        "faithfulness": {"scenes": 40, "regions": 8},
        "hallucination": {"fit": 1000, "test": 1000, "objects": [1, 4]},
        "hallucination_hard": {"fit": 500, "test": 500, "objects": [5, 9]},
        "mixer": {"scenes": 300, "sweep_scenes": 100, "rounds": 5},
        "video_accuracy": {"clips": 300},
        "video_head_cells": {"seeds": "reported", "clips": 150, "layout": "cells"},
        "video_head_ward": {"seeds": "reported", "clips": 150, "layout": 16}}
QUICK = {"accuracy": {"scenes": 4},
         "head_vs_attention": {"seeds": "heat-reported", "scenes": 2, "grid": [3, 3],
                               "features": "both"},
         "head_vs_attention_ward": {"seeds": "heat-reported", "scenes": 2, "regions": 8,
                                    "features": "both"},
         "heat_check": {"seeds": "heat-done", "scenes": 2, "regions": 8},
         "scorer_cost": {"rounds": 1, "regions": 8, "tokens": 12},
         "head_eval": {"scenes": 2, "regions": 8, "max_new_tokens": 48, "subsets": 2,
                       "features": "both"},
         "head_eval_grid": {"scenes": 2, "grid": "3x3", "max_new_tokens": 48, "subsets": 2,
                            "features": "both"},
         "latency": {"rounds": 1, "tokens": 8},
         "faithfulness": {"scenes": 1, "regions": 8},
         "hallucination": {"fit": 2, "test": 2, "objects": [1, 4]},
         "hallucination_hard": {"fit": 2, "test": 2, "objects": [5, 9]},
         "mixer": {"scenes": 2, "sweep_scenes": 2, "rounds": 1},
         "video_accuracy": {"clips": 2},
         "video_head_cells": {"seeds": "reported", "clips": 1, "layout": "cells"},
         "video_head_ward": {"seeds": "reported", "clips": 1, "layout": 16}}
# A step's format: raised when what it measures changes (latency 2: time per token is the
# decode's time over its steps, span ends included; the head evaluations 2: a raw baseline
# per feature block, the head reading its own block of features="both"; 3: AttnLRP beside
# them, with its time per span; 4: deletion and insertion, pointing by heat; head_vs_attention
# 4: every score on the sentence spans and on all spans; 5: the gradient norm and the heat
# map's yardsticks; faithfulness 3: AttnLRP and ms per span; hallucination 2: AUROC within
# object counts and of the count alone).
FORMATS = {"accuracy": 1, "head_vs_attention": 5, "head_vs_attention_ward": 1,
           "heat_check": 1, "scorer_cost": 1, "head_eval": 4, "head_eval_grid": 4,
           "latency": 2, "faithfulness": 3, "hallucination": 2, "hallucination_hard": 2,
           "mixer": 1, "video_accuracy": 1, "video_head_cells": 1, "video_head_ward": 1}
USES = {"faithfulness": ("latency",)}  # steps whose result this one takes in
EVAL_KEYS = ("lds", "lds_pooled", "pearson", "subset_lds", "pointing", "pointing_heat",
             "pointing_spans")


def _accuracy(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .accuracy import caption_accuracy, held_out_scenes
    from .model import load
    model, processor, _ = load(model_dir, head=False)
    return {"seeds": [HELD_OUT_SEED, HELD_OUT_SEED + s["scenes"] - 1],
            **caption_accuracy(model, processor, held_out_scenes(s["scenes"]))}


def _head_vs_attention(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .head_eval import evaluate_head
    return evaluate_head(s["seeds"], s["scenes"],
                         regions=tuple(s["grid"]) if "grid" in s else s["regions"],
                         model_dir=model_dir, features=s["features"])


def _heat_check(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .heat_check import check_pages
    return check_pages(s["seeds"], s["scenes"], s["regions"], model_dir=model_dir)


def _scorer_cost(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .scorer_cost import measure_scorer_cost
    return measure_scorer_cost(s["rounds"], s["regions"], s["tokens"], model_dir=model_dir)


def _head_eval(out: Path, s: dict, done: dict, model_dir) -> dict:
    from ..commands import main as commands_main
    from .dataset import write_dataset
    from .model import DATA_DIR, HEAD_FILE
    folder = Path(model_dir) if model_dir is not None else DATA_DIR
    first = HELD_OUT_SEED + EVAL_OFFSET
    data = write_dataset(out / "head-eval-data", first, s["scenes"])
    if "grid" in s:
        report, regions = out / "head-eval-grid.json", ["--grid", s["grid"]]
    else:
        report, regions = out / "head-eval.json", ["--regions", str(s["regions"])]
    code = commands_main(["eval", "--model", str(folder), "--head", str(folder / HEAD_FILE),
                          "--data", str(data), "--report", str(report), *regions,
                          "--subsets", str(s["subsets"]), "--features", s["features"],
                          "--max-new-tokens", str(s["max_new_tokens"]), "--attnlrp"])
    if code != 0:
        raise RuntimeError(f"headscope.shapes reproduce: python -m headscope eval exited "
                           f"{code}")
    results = json.loads(report.read_text())
    return {"seeds": [first, first + s["scenes"] - 1], "spans": results["spans"],
            "baselines": results["baselines"],
            "ms_per_span": {scorer: results[scorer]["ms_per_span"]
                            for scorer in results["baselines"]
                            if "ms_per_span" in results[scorer]},
            **{scorer: {k: results[scorer][k] for k in EVAL_KEYS if k in results[scorer]}
               for scorer in ("head", *results["baselines"], "random")},
            "curves": results.get("curves")}


def _latency(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .latency import measure_latency
    return measure_latency(rounds=s["rounds"], new_tokens=s["tokens"], model_dir=model_dir)


def _faithfulness(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .faithfulness import measure_faithfulness
    from .faithfulness_figure import write_faithfulness
    result = measure_faithfulness(s["scenes"], regions=s["regions"], model_dir=model_dir,
                                  latency=done["latency"]["result"])
    files = write_faithfulness(out / "faithfulness", result)
    return {k: v for k, v in result.items() if k != "per_scene"} | {"files": files}


def _hallucination(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .hallucination import measure_hallucination
    return measure_hallucination(s["fit"], s["test"], model_dir, objects=tuple(s["objects"]))


def _mixer(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .mixer_eval import compare_models, projection_sweep
    return {"accuracy": compare_models(s["scenes"], softmax_dir=model_dir),
            "sweep": projection_sweep(s["sweep_scenes"], rounds=s["rounds"],
                                      softmax_dir=model_dir)}


def _video_accuracy(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .accuracy import CLIP_SEED_RANGES, clip_accuracy, held_out_clips
    from .model import VIDEO_DIR, load
    model, processor, _ = load(VIDEO_DIR, head=False)
    first = CLIP_SEED_RANGES["accuracy"]
    return {"seeds": [first, first + s["clips"] - 1],
            **clip_accuracy(model, processor, held_out_clips(s["clips"]))}


def _video_head(out: Path, s: dict, done: dict, model_dir) -> dict:
    from .clip_eval import evaluate_clips
    return evaluate_clips(s["seeds"], s["clips"], layout=s["layout"])


RUN: Dict[str, Callable] = {"accuracy": _accuracy, "head_vs_attention": _head_vs_attention,
                            "head_vs_attention_ward": _head_vs_attention,
                            "heat_check": _heat_check, "scorer_cost": _scorer_cost,
                            "head_eval": _head_eval,
                            "head_eval_grid": _head_eval,
                            "latency": _latency, "faithfulness": _faithfulness,
                            "hallucination": _hallucination,
                            "hallucination_hard": _hallucination, "mixer": _mixer,
                            "video_accuracy": _video_accuracy, "video_head_cells": _video_head,
                            "video_head_ward": _video_head}


def _save(out: Path, results: dict) -> None:
    from .reproduce_report import markdown
    write_json(out / RESULTS, results)
    write_text(out / "results.md", markdown(results))


def reproduce(out: Path, quick: bool = False, model_dir: Optional[Path] = None,
              echo: Callable[[str], None] = print) -> dict:
    """Runs (or resumes) every step into ``out``; returns the results."""
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    results = json.loads(path.read_text()) if path.is_file() else {"steps": {}}
    model = str(Path(model_dir).resolve()) if model_dir is not None else "shipped"
    results.update(quick=quick, threads=torch.get_num_threads())
    settings = QUICK if quick else FULL
    ran = set()
    for i, name in enumerate(STEPS, 1):
        step = results["steps"].get(name)
        if step is not None and not ran.intersection(USES.get(name, ())) and \
                (step["settings"], step["model"], step.get("format", 1)) == \
                (settings[name], model, FORMATS[name]):
            echo(f"[{i}/{len(STEPS)}] {name}: done in an earlier run, skipped")
            continue
        ran.add(name)
        echo(f"[{i}/{len(STEPS)}] {name} {settings[name]} ...")
        start = time.perf_counter()
        result = RUN[name](out, settings[name], results["steps"], model_dir)
        seconds = time.perf_counter() - start
        results["steps"][name] = {"settings": settings[name], "model": model,
                                  "format": FORMATS[name], "seconds": round(seconds, 1),
                                  "result": result}
        _save(out, results)
        echo(f"[{i}/{len(STEPS)}] {name}: done in {seconds:.1f} s")
    _save(out, results)
    echo(f"wrote {out / RESULTS} and {out / 'results.md'}")
    return results
