"""The demo: the shapes model describes held-out scenes while headscope streams which
regions ground each sentence (``headscope.explainer.iter_explain``, what ``python -m
headscope explain`` runs); per span a PNG with the object's true box, per scene the page of
``python -m headscope explain``, per run a JSON report of the truth and pointing, an HTML
page and a summary on the terminal.

Scores are the attribution head's predicted effects when the model folder has a head,
else raw attention (each region's pooled attention mass averaged over layers and heads).
Regions are the world's 3 x 3 cells by default (``headscope.hf.grid_regions``: each place
of the world is a 2 x 2 block of image tokens), or K Ward regions of the image's token
embeddings, what the tracer would use on an image whose layout nobody knows.
"""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import torch

from ..io import write_text
from ..metrics import in_box
from .accuracy import HELD_OUT_SEED
from .figures import region_centroids, save_png, span_figure
from .model import load, prompt
from .world import IMAGE_SIZE, PROMPT, describe, match_object, parse_sentence, scene

# Demo scenes are held out: seeds HELD_OUT_SEED + DEMO_OFFSET + i, past the accuracy set.
DEMO_OFFSET = 900_000
DEFAULT_REGIONS = 8  # Ward regions of the measurements
WORLD_GRID = (3, 3)  # the demo's default regions: one per place of the world


def run_demo(out: Path, num_images: int = 3, *, model_dir: Optional[Path] = None,
             regions: Union[int, Tuple[int, int]] = WORLD_GRID, max_new_tokens: int = 48,
             echo: Callable[[str], None] = print) -> dict:
    """Runs the demo on ``num_images`` held-out scenes (1, 2, 3, 4, 1, ... objects) and
    writes ``out/report.json``, ``out/index.html``, ``out/image{i}_span{j}.png`` and each
    scene's explain page ``out/image{i}/``.
    ``regions``: ``(rows, cols)`` for a grid of blocks, or K for Ward regions. Returns the
    report."""
    from ..explainer import iter_explain

    if num_images < 1:
        raise ValueError(f"headscope.shapes.demo: argument 'num_images' must be >= 1, got "
                         f"{num_images}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor, head = load(model_dir)
    score_name = "head's predicted effect" if head is not None else "raw attention"
    regions_name = f"{regions} Ward regions" if isinstance(regions, int) else \
        "a {}x{} grid".format(*regions)
    images = []
    with torch.no_grad():
        for i in range(num_images):
            seed = HELD_OUT_SEED + DEMO_OFFSET + i
            image, objects = scene(seed, 1 + i % 4)
            echo(f"image {i} (seed {seed}, {len(objects)} objects)")
            spans, result = [], None
            for result in iter_explain(model, processor, [image], PROMPT, head,
                                       regions=regions, inputs=prompt(processor, image),
                                       max_new_tokens=max_new_tokens,
                                       model_name="headscope.shapes"):
                if not spans and result.spans:  # the prefill has set the regions
                    (picture,) = result.pictures
                    (view,) = picture.views
                    grid = (view["rows"], view["cols"])
                    labels = picture.labels.numpy()
                    K = result.num_regions
                    centroids = region_centroids(labels, grid, IMAGE_SIZE, K)
                for span in result.spans[len(spans):]:
                    s = None if span.special else _span_record(span, objects, centroids)
                    spans.append(s)
                    if s is not None:
                        echo(f"  span {span.index}: {s['text']!r:44} top region "
                             f"{s['top_region']} ({s['scores'][s['top_region']]:+.3f})"
                             + ("" if s["object"] is None else
                                f", {'on' if s['pointing_hit'] else 'off'} the object"))
            spans = [s for s in spans if s is not None]
            for j, s in enumerate(spans):
                s["png"] = f"image{i}_span{j}.png"
                name = "hallucinated" if s["object"] is None and s["parsed"] else "no object"
                title = f"\u201c{s['text']}\u201d" + ("" if s["object"] is not None
                                                       else f"  ({name})")
                span_figure(out / s["png"], image, labels, grid, centroids,
                            np.array(s["scores"]), title, score_name, s["box"], s["top_region"])
            image_file = f"image{i}.png"
            save_png(image, out / image_file)
            page = result.save(out / f"image{i}")  # the page python -m headscope explain writes
            text = " ".join(s["text"] for s in spans)
            vas = list(result.vas_features.values())
            echo(f"  {'correct' if text == describe(objects) else 'truth: ' + describe(objects)}"
                 f"; VAS features: {len(vas)}, wrote {len(spans)} PNGs")
            images.append({
                "seed": seed, "image": image_file, "page": str(page.relative_to(out)),
                "truth": describe(objects),
                "description": text, "correct": text == describe(objects),
                "objects": [dict(shape=o.shape, colour=o.colour, position=o.position,
                                 box=list(o.box)) for o in objects],
                "num_regions": K, "region_grid": labels.reshape(grid).tolist(),
                "vas_features": result.vas_features, "spans": spans})
    report = {"scores": score_name, "regions": regions_name, "images": images,
              "summary": _summary(images)}
    write_text(out / "report.json", json.dumps(report, indent=1) + "\n")
    write_text(out / "index.html", _html(report))
    s = report["summary"]
    echo(f"{s['correct']}/{s['images']} descriptions correct; pointing ({score_name}): "
         f"{s['pointing_hits']}/{s['spans_on_objects']} spans; wrote {out / 'index.html'}")
    return report


def explain_page(folder: Path) -> Path:
    """The explain page of the shapes model describing a held-out two-object scene (the
    page of the docs' picture, ``python -m headscope.shapes screenshot``)."""
    from ..explainer import explain
    model, processor, head = load()
    image, _ = scene(HELD_OUT_SEED + DEMO_OFFSET + 1, 2)
    return explain(model, processor, [image], "Describe the image.", head,
                   inputs=prompt(processor, image), max_new_tokens=24,
                   model_name="headscope.shapes (the embedded model)").save(folder)


def _span_record(span, objects, centroids: np.ndarray) -> dict:
    """One span of the report: an ``ExplainedSpan`` matched to the scene's objects."""
    text, scores = span.text.strip(), span.scores
    parsed = parse_sentence(text)
    obj = match_object(parsed, objects)
    top = int(torch.argmax(scores))
    return {"text": text, "start": span.start, "end": span.end,
            "scores": [round(float(v), 6) for v in scores],
            "top_region": top, "parsed": parsed is not None,
            "object": None if obj is None else f"{obj.colour} {obj.shape} ({obj.position})",
            "box": None if obj is None else list(obj.box),
            "pointing_hit": None if obj is None else bool(in_box(*centroids[top], obj.box))}


def _summary(images: List[dict]) -> dict:
    on_objects = [s for im in images for s in im["spans"] if s["box"] is not None]
    return {"images": len(images), "correct": sum(im["correct"] for im in images),
            "spans": sum(len(im["spans"]) for im in images),
            "spans_on_objects": len(on_objects),
            "pointing_hits": sum(bool(s["pointing_hit"]) for s in on_objects)}


def _html(report: dict) -> str:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>headscope shapes demo"
             "</title><style>body{font-family:sans-serif;margin:2em}td{vertical-align:top;"
             "padding:4px 12px}img.scene{width:192px;image-rendering:pixelated}"
             "img.span{width:640px}.bad{color:#b00}</style></head><body>",
             f"<h1>headscope: which regions ground each sentence</h1><p>Scores: "
             f"{e(report['scores'])}; {report['regions']} regions per image.</p>"]
    for im in report["images"]:
        verdict = "correct" if im["correct"] else "<span class='bad'>differs from truth</span>"
        vas = ", ".join(f"{k} {v:.3f}" for k, v in list(im["vas_features"].items())[:6])
        parts.append(f"<h2>seed {im['seed']}</h2><table><tr><td><img class='scene' "
                     f"src='{e(im['image'])}'></td><td><p><b>model:</b> "
                     f"{e(im['description'])}<br><b>truth:</b> {e(im['truth'])} ({verdict})"
                     f"<br><a href='{e(im['page'])}'>choose a sentence, see its heat map</a>"
                     f"</p><p><small>VAS (first of 36): {e(vas)} ...</small></p></td></tr>")
        for s in im["spans"]:
            where = s["object"] or "names no object of the image"
            hit = {True: "top region on the object", False: "top region off the object",
                   None: ""}[s["pointing_hit"]]
            parts.append(f"<tr><td><b>{e(s['text'])}</b><br>{e(where)}<br>{hit}</td>"
                         f"<td><img class='span' src='{e(s['png'])}'></td></tr>")
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
