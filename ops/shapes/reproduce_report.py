"""``results.md`` of ``python -m headscope.shapes reproduce``: one section per finished
step, its numbers as tables."""
from __future__ import annotations

from .clip_eval import clip_table
from .faithfulness import table as faithfulness_table
from .head_eval import RAW_NAMES, table as head_vs_attention_table
from .heat_check import table as heat_check_table
from .latency import LABELS as LATENCY_LABELS
from .mixer_eval import table as mixer_table
from .scorer_cost import table as scorer_cost_table


def _cell(v, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _accuracy(r: dict) -> list:
    return [f"Caption accuracy on {r['count']} held-out scenes (seeds {r['seeds'][0]}.."
            f"{r['seeds'][1]}):", "",
            "| exact | precision | recall | colour | shape | place |",
            "| --- | --- | --- | --- | --- | --- |",
            "| " + " | ".join(f"{100 * r[k]:.1f}%" for k in
                             ("exact", "precision", "recall", "colour", "shape", "position"))
            + " |"]


def _video_accuracy(r: dict) -> list:
    low, high = r["exact_interval95"]
    fields = ("exact", "precision", "recall", "colour", "shape", "event", "position",
              "to_position", "quarter")
    return [f"Exact descriptions of {r['count']} held-out clips (seeds {r['seeds'][0]}.."
            f"{r['seeds'][1]}): {100 * r['exact']:.1f}% [Wilson 95%: {100 * low:.1f}, "
            f"{100 * high:.1f}].", "",
            "| " + " | ".join(fields) + " |", "| " + " | ".join("---" for _ in fields) + " |",
            "| " + " | ".join(f"{100 * r[k]:.1f}%" for k in fields) + " |"]


def _head_eval(r: dict, regions: str = "8 Ward regions") -> list:
    lines = [f"The shipped head against the raw baseline of each feature block and a random "
             f"region (`python -m "
             f"headscope eval`, {regions}, seeds {r['seeds'][0]}..{r['seeds'][1]}, "
             f"{r['spans']} spans, {r['head']['pointing_spans']} pointing cases):", "",
             "| scores | LDS (mean over images) | LDS pooled | Pearson | subset LDS | pointing |",
             "| --- | --- | --- | --- | --- | --- |"]
    for scorer in ("head", *r["baselines"]):
        m = r[scorer]
        lines.append(f"| {RAW_NAMES.get(scorer, scorer)} | " + " | ".join(_cell(m[k]) for k in
                                                  ("lds", "lds_pooled", "pearson",
                                                   "subset_lds", "pointing")) + " |")
    lines.append(f"| random region (expected) | | | | | {_cell(r['random']['pointing'])} |")
    lines += [f"{RAW_NAMES.get(scorer, scorer)}: {ms:.1f} ms per span"
              for scorer, ms in r.get("ms_per_span", {}).items()]
    curves = r.get("curves")
    if curves:
        lines += ["", f"Deletion and insertion AUC ({curves['spans']} sentence spans, "
                      f"{curves['images']} images; mean [bootstrap 95%]; pointing by heat: "
                      f"the region hottest per image token):", "",
                  "| scores | deletion AUC | insertion AUC | pointing by heat |",
                  "| --- | --- | --- | --- |"]
        for scorer in ("head", *r["baselines"], "effects", "random"):
            label = {"effects": "true-effect order", "random": "random order"}.get(
                scorer, RAW_NAMES.get(scorer, scorer))
            pointing = r.get(scorer, {}).get("pointing_heat")
            lines.append(f"| {label} | {_interval(curves['deletion'][scorer])} | "
                         f"{_interval(curves['insertion'][scorer])} | "
                         f"{'' if pointing is None else _cell(pointing)} |")
    return lines


def _interval(m: dict) -> str:
    if m["mean"] is None:
        return "n/a"
    if m["interval95"] is None:
        return f"{m['mean']:.3f}"
    return f"{m['mean']:.3f} [{m['interval95'][0]:.3f}, {m['interval95'][1]:.3f}]"


def _latency(r: dict) -> list:
    ms, step = r["ms_per_token"], r["median_step_ms"]
    lines = [f"Per-token latency ({r['rounds']} rounds of {r['new_tokens']} tokens, "
             f"{r['threads']} threads; ms per token: the decode's time over its steps, span "
             f"ends included):", "",
             "| | ms per token | vs plain | median step (ms) | vs plain |",
             "| --- | --- | --- | --- | --- |",
             f"| plain `generate` | {ms['plain']:.3f} | 1 | {step['plain']:.3f} | 1 |"]
    for key, label in LATENCY_LABELS:
        mid, low, high = r[f"{key}_vs_plain"]
        lines.append(f"| `{label}` | {ms[key]:.3f} | {mid:.2f}x [{low:.2f}-{high:.2f}] | "
                     f"{step[key]:.3f} | {r[f'{key}_step_vs_plain'][0]:.2f}x |")
    return lines


def _faithfulness(r: dict) -> list:
    return [f"Faithfulness against time per token ({r['scenes']} scenes, seeds "
            f"{r['seeds'][0]}..{r['seeds'][1]}, {r['spans']} spans; figure "
            f"`{r['files']['png']}`):", "", faithfulness_table(r)]


def _hallucination(r: dict) -> list:
    objects = "{}-{}".format(*r["objects"])
    lines = [f"Hallucination detection ({r['fit_answers']} fitting and {r['test_answers']} "
             f"test answers, scenes of {objects} objects, seeds {r['seeds'][0]}.."
             f"{r['seeds'][1]}; "
             f"{100 * r['test_hallucinated']:.1f}% of the test answers hallucinated):", "",
             "| scores | AUROC | 95% interval | AUROC within object counts | 95% interval |",
             "| --- | --- | --- | --- | --- |"]

    def interval(pair):
        return "n/a" if pair is None else f"{pair[0]:.3f}-{pair[1]:.3f}"

    for key, label in (("vas_detector", "VASDetector (36 VAS features)"),
                       ("mean_logprob", "mean token log-probability (baseline)"),
                       ("vas_and_logprob", "VAS features and log-probability"),
                       ("vas_and_count", "VAS features and the object count")):
        lines.append(f"| {label} | {_cell(r['auroc_' + key])} | "
                     f"{interval(r['auroc_95_interval'][key])} | "
                     f"{_cell(r['auroc_within_object_count'][key])} | "
                     f"{interval(r['auroc_within_object_count_95_interval'][key])} |")
    lines.append(f"| the scene's object count alone | {_cell(r['auroc_object_count_alone'])} "
                 f"| | | |")
    return lines


SECTIONS = {"accuracy": ("Caption accuracy", _accuracy),
            "head_vs_attention": ("The head against raw attention (per feature block)",
                                  lambda r: [head_vs_attention_table(r)]),
            "head_vs_attention_ward": ("The head against raw attention on 8 Ward regions",
                                       lambda r: [head_vs_attention_table(r)]),
            "heat_check": ("The page's heat map: the named object hotter than the rest",
                           lambda r: [heat_check_table(r)]),
            "scorer_cost": ("What each scorer of headscope.explain costs",
                            lambda r: [scorer_cost_table(r)]),
            "head_eval": ("Attribution head", _head_eval),
            "head_eval_grid": ("Attribution head on the world's cells",
                               lambda r: _head_eval(r, "the world's 3x3 cells as regions")),
            "latency": ("Latency", _latency),
            "faithfulness": ("Faithfulness against time", _faithfulness),
            "hallucination": ("Hallucination detection", _hallucination),
            "hallucination_hard": ("Hallucination detection on hard scenes", _hallucination),
            "mixer": ("Mixer against softmax vision attention",
                      lambda r: ["Caption accuracy of the two models on the same held-out "
                                 "scenes (exact: Wilson 95% interval; difference in points: "
                                 "paired bootstrap 95% interval):", "",
                                 mixer_table(r["accuracy"], r["sweep"])]),
            "video_accuracy": ("The video model's descriptions of held-out clips",
                               _video_accuracy),
            "video_head_cells": ("The video head on the world's cells in each quarter",
                                 lambda r: [clip_table(r)]),
            "video_head_ward": ("The video head on 16 Ward regions over space and time",
                                lambda r: [clip_table(r)])}


def markdown(results: dict) -> str:
    lines = ["# headscope shapes: measurements", "",
             f"{'Quick (CI-sized) run' if results['quick'] else 'Full run'}, "
             f"{results['threads']} threads."]
    for name, (title, render) in SECTIONS.items():
        step = results["steps"].get(name)
        if step is None:
            continue
        lines += ["", f"## {title}", "", f"Settings {step['settings']}, model "
                  f"{step['model']}, {step['seconds']} s.", ""]
        lines += render(step["result"])
    return "\n".join(lines) + "\n"
