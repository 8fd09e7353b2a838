"""Softmax against mixer attention in the shapes model's vision tower: caption accuracy of
the two shipped models on the same held-out scenes, and what the mixer's projection trades
when its Newton iterations are capped or its tolerance loosened (accuracy against the
tower's time).

The scenes are ``held_out_scenes(count, start=MIXER_EVAL_START)`` (seeds from
1_006_000_000), a range fixed before either model was measured on it and used by no other
measurement.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .accuracy import (caption_accuracy, describe_images, exact_descriptions,
                       held_out_scenes)
from ..metrics import bootstrap_interval

MIXER_EVAL_START = 6_000_000
OBJECT_RANGES = ((1, 4), (5, 9))
# (max_iter, tol) of every vision mixer; the last is the trained setting (use_mixer's).
SWEEP: Tuple[Tuple[int, float], ...] = ((1, 1e-10), (2, 1e-10), (3, 1e-10), (50, 1e-3),
                                        (50, 1e-10))


def compare_models(scenes: int, softmax_dir: Optional[Path] = None,
                   mixer_dir: Optional[Path] = None) -> Dict[str, dict]:
    """Caption accuracy of both models on ``scenes`` held-out scenes of each object range:
    ``{"1-4": {"softmax": ..., "mixer": ..., "exact_difference": {mean, interval95}}, ...}``
    with the paired bootstrap interval of mixer minus softmax exact descriptions."""
    from .model import MIXER_DIR, load
    models = {"softmax": load(softmax_dir, head=False)[:2],
              "mixer": load(mixer_dir if mixer_dir is not None else MIXER_DIR, head=False)[:2]}
    out = {}
    for lo, hi in OBJECT_RANGES:
        chosen = held_out_scenes(scenes, start=MIXER_EVAL_START, objects=(lo, hi))
        images = [image for _, image, _ in chosen]
        row, exact = {}, {}
        for name, (model, processor) in models.items():
            texts = describe_images(model, processor, images)
            row[name] = caption_accuracy(model, processor, chosen, texts=texts)
            exact[name] = torch.tensor(exact_descriptions(chosen, texts), dtype=torch.float64)
        difference = exact["mixer"] - exact["softmax"]
        row["exact_difference"] = {
            "mean": float(difference.mean()),
            "interval95": list(bootstrap_interval(difference)) if scenes > 1 else None}
        row["seeds"] = [chosen[0][0], chosen[-1][0]]
        out[f"{lo}-{hi}"] = row
    return out


def _mixers(model) -> List:
    from ..mixer import FactorMixer
    return [m for m in model.modules() if isinstance(m, FactorMixer)]


def _tower_inputs(processor, images) -> Dict[str, torch.Tensor]:
    batch = processor.image_processor(images=list(images), return_tensors="pt")
    return {"hidden_states": batch["pixel_values"], "grid_thw": batch["image_grid_thw"]}


def projection_sweep(scenes: int, rounds: int = 5, softmax_dir: Optional[Path] = None,
                     mixer_dir: Optional[Path] = None,
                     settings: Sequence[Tuple[int, float]] = SWEEP) -> dict:
    """For each ``(max_iter, tol)`` of ``settings`` put on every vision mixer (without the
    convergence check): exact descriptions on ``scenes`` held-out scenes of 1 to 4 objects,
    with their Wilson interval, and the vision tower's time per image on those scenes'
    images; the softmax model's tower is timed beside them (alternating rounds, one
    process; medians and ratios)."""
    from .model import MIXER_DIR, load
    mixer, processor = load(mixer_dir if mixer_dir is not None else MIXER_DIR, head=False)[:2]
    softmax = load(softmax_dir, head=False)[0]
    chosen = held_out_scenes(scenes, start=MIXER_EVAL_START)
    tower = _tower_inputs(processor, [image for _, image, _ in chosen])
    mixers = _mixers(mixer)
    trained = [(m.max_iter, m.tol, m.check) for m in mixers]

    def configure(max_iter: int, tol: float) -> None:
        for m in mixers:
            m.max_iter, m.tol, m.check = max_iter, tol, False

    rows = []
    try:
        for max_iter, tol in settings:
            configure(max_iter, tol)
            rows.append({"max_iter": max_iter, "tol": tol,
                         **caption_accuracy(mixer, processor, chosen)})
        times = {i: [] for i in range(-1, len(settings))}  # -1: the softmax tower
        with torch.no_grad():
            for _ in range(rounds):
                for i in times:
                    model = softmax if i < 0 else mixer
                    if i >= 0:
                        configure(*settings[i])
                    start = time.perf_counter()
                    model.model.visual(**tower)
                    times[i].append((time.perf_counter() - start) / len(chosen))
    finally:
        for m, (max_iter, tol, check) in zip(mixers, trained):
            m.max_iter, m.tol, m.check = max_iter, tol, check
    median = {i: sorted(t)[len(t) // 2] for i, t in times.items()}
    for i, row in enumerate(rows):
        row["tower_ms_per_image"] = 1e3 * median[i]
        row["tower_vs_softmax"] = median[i] / median[-1]
    return {"scenes": scenes, "rounds": rounds, "threads": torch.get_num_threads(),
            "seeds": [chosen[0][0], chosen[-1][0]],
            "softmax_tower_ms_per_image": 1e3 * median[-1], "settings": rows}


def table(compared: Dict[str, dict], sweep: Optional[dict] = None) -> str:
    """Markdown tables of :func:`compare_models` (and :func:`projection_sweep`)."""
    def pct(x):
        return f"{100 * x:.1f}%"

    def interval(pair):
        return "n/a" if pair is None else f"[{100 * pair[0]:.1f}, {100 * pair[1]:.1f}]"

    lines = ["| objects | scenes | softmax exact | mixer exact | mixer - softmax | softmax "
             "precision | mixer precision |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for objects, row in compared.items():
        s, m, d = row["softmax"], row["mixer"], row["exact_difference"]
        lines.append(f"| {objects} | {s['count']} | {pct(s['exact'])} "
                     f"{interval(s['exact_interval95'])} | {pct(m['exact'])} "
                     f"{interval(m['exact_interval95'])} | {100 * d['mean']:+.1f} "
                     f"{interval(d['interval95'])} | {pct(s['precision'])} | "
                     f"{pct(m['precision'])} |")
    if sweep is not None:
        lines += ["", f"Projection settings of the mixer model ({sweep['scenes']} scenes of 1 "
                  f"to 4 objects; vision tower timed on their images, {sweep['rounds']} "
                  f"rounds, {sweep['threads']} threads; softmax tower "
                  f"{sweep['softmax_tower_ms_per_image']:.2f} ms per image):", "",
                  "| max_iter | tol | exact | tower ms per image | vs softmax tower |",
                  "| --- | --- | --- | --- | --- |"]
        for row in sweep["settings"]:
            lines.append(f"| {row['max_iter']} | {row['tol']:g} | {pct(row['exact'])} "
                         f"{interval(row['exact_interval95'])} | "
                         f"{row['tower_ms_per_image']:.2f} | {row['tower_vs_softmax']:.2f}x |")
    return "\n".join(lines)
