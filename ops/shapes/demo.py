"""The demo: the shapes model describes held-out scenes while headscope streams which
regions ground each sentence; per span a PNG, per run a JSON report, an HTML page and a
summary on the terminal.

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

from ..io import atomic_path
from ..metrics import in_box
from ..vas import VAS_COLUMNS
from .accuracy import HELD_OUT_SEED
from .figures import region_centroids, save_png, span_figure
from .model import load, prompt
from .world import IMAGE_SIZE, describe, match_object, parse_sentence, scene

# Demo scenes are held out: seeds HELD_OUT_SEED + DEMO_OFFSET + i, past the accuracy set.
DEMO_OFFSET = 900_000
DEFAULT_REGIONS = 8  # Ward regions of the measurements
WORLD_GRID = (3, 3)  # the demo's default regions: one per place of the world


def _write_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)


def run_demo(out: Path, num_images: int = 3, *, model_dir: Optional[Path] = None,
             regions: Union[int, Tuple[int, int]] = WORLD_GRID, max_new_tokens: int = 48,
             echo: Callable[[str], None] = print) -> dict:
    """Runs the demo on ``num_images`` held-out scenes (1, 2, 3, 4, 1, ... objects) and
    writes ``out/report.json``, ``out/index.html`` and ``out/image{i}_span{j}.png``.
    ``regions``: ``(rows, cols)`` for a grid of blocks, or K for Ward regions. Returns the
    report."""
    from ..hf import Tracer, grid_regions

    if num_images < 1:
        raise ValueError(f"headscope.shapes.demo: argument 'num_images' must be >= 1, got "
                         f"{num_images}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor, head = load(model_dir)
    score_name = "head's predicted effect" if head is not None else "raw attention"
    images = []
    if isinstance(regions, int):
        traced, regions_name = regions, f"{regions} Ward regions"
    else:
        traced, regions_name = grid_regions(*regions), "a {}x{} grid".format(*regions)
    features = head.feature_set if head is not None else "attention"
    with torch.no_grad(), Tracer(model, regions=traced, vas=True, head=head,
                                 tokenizer=processor.tokenizer, features=features) as tr:
        for i in range(num_images):
            seed = HELD_OUT_SEED + DEMO_OFFSET + i
            image, objects = scene(seed, 1 + i % 4)
            inputs = prompt(processor, image)
            echo(f"image {i} (seed {seed}, {len(objects)} objects)")
            spans = []
            for span in tr.generate(**inputs, max_new_tokens=max_new_tokens):
                if not spans:  # the prefill has set this prompt's regions and images
                    (picture,) = tr.images[0]
                    grid = (picture.rows, picture.cols)
                    labels = tr.region_ids[0, picture.grid.positions].cpu().numpy()
                    K = tr.num_regions[0]
                    centroids = region_centroids(labels, grid, IMAGE_SIZE, K)
                text = processor.tokenizer.decode(span.token_ids, skip_special_tokens=True)
                if not text.strip():  # the end-of-sequence token alone
                    continue
                s = _span_record(span, text.strip(), objects, centroids)
                spans.append(s)
                echo(f"  span {len(spans) - 1}: {s['text']!r:44} top region {s['top_region']}"
                     f" ({s['scores'][s['top_region']]:+.3f})"
                     + ("" if s["object"] is None else
                        f", {'on' if s['pointing_hit'] else 'off'} the object"))
            for j, s in enumerate(spans):
                s["png"] = f"image{i}_span{j}.png"
                name = "hallucinated" if s["object"] is None and s["parsed"] else "no object"
                title = f"\u201c{s['text']}\u201d" + ("" if s["object"] is not None
                                                       else f"  ({name})")
                span_figure(out / s["png"], image, labels, grid, centroids,
                            np.array(s["scores"]), title, score_name, s["box"], s["top_region"])
            image_file = f"image{i}.png"
            save_png(image, out / image_file)
            text = " ".join(s["text"] for s in spans)
            vas = tr.vas_features()[0].tolist()
            echo(f"  {'correct' if text == describe(objects) else 'truth: ' + describe(objects)}"
                 f"; VAS features: {len(vas)}, wrote {len(spans)} PNGs")
            images.append({
                "seed": seed, "image": image_file, "truth": describe(objects),
                "description": text, "correct": text == describe(objects),
                "objects": [dict(shape=o.shape, colour=o.colour, position=o.position,
                                 box=list(o.box)) for o in objects],
                "num_regions": K, "region_grid": labels.reshape(grid).tolist(),
                "vas_features": dict(zip(VAS_COLUMNS, vas)), "spans": spans})
    report = {"scores": score_name, "regions": regions_name, "images": images,
              "summary": _summary(images)}
    _write_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    _write_atomic(out / "index.html", _html(report))
    s = report["summary"]
    echo(f"{s['correct']}/{s['images']} descriptions correct; pointing ({score_name}): "
         f"{s['pointing_hits']}/{s['spans_on_objects']} spans; wrote {out / 'index.html'}")
    return report


def _span_record(span, text: str, objects, centroids: np.ndarray) -> dict:
    scores = span.scores if span.scores is not None else span.features.mean(-1)
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
