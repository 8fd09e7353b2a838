"""The video demo: the video model describes held-out clips, each written as a video file
and read back as ``python -m headscope explain --video`` reads one (through the model's
chat template and its video processor), while headscope streams which places and moments
ground each sentence; per clip the explain page, per run a JSON report of the truth and of
pointing in space and in time (``clip_eval``'s definitions), an HTML index and a summary on
the terminal.
"""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import torch

from ..io import atomic_path, write_text
from .accuracy import CLIP_OBJECTS, CLIP_SEED_RANGES
from .clip_eval import hottest_group, region_hits, token_centres
from .clips import CLIP_PROMPT, FPS, clip, describe_clip, match_clip_object, \
    parse_clip_sentence
from .model import VIDEO_DIR, load

WORLD_GRID = (3, 3)  # the world's cells in each frame group (a quarter of the clip)


def write_clip(path: Path, frames, fps: int = FPS) -> Path:
    """Writes ``frames`` (PIL RGB) as an MP4 file of lossless H.264 in RGB (``libx264rgb``,
    ``qp`` 0: the decoded frames are the drawn ones, bit for bit), atomically."""
    import av
    with atomic_path(Path(path)) as tmp:
        container = av.open(str(tmp), "w", format="mp4")
        stream = container.add_stream("libx264rgb", rate=fps, options={"qp": "0"})
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "rgb24"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame),
                                                                   format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        container.close()
    return Path(path)


def token_frames(video) -> torch.Tensor:
    """``(T, 2)``: the first and last sampled frame each token of an ``ExplainedVideo``
    covers."""
    ends = torch.tensor([[g[0], g[-1]] for g in video.groups], dtype=torch.int64)
    return ends[video.token_groups]


def span_record(span, objects, video) -> dict:
    """One span of the report: its text, the clip object it names (if any), its hottest
    region and frame group as painted (per image token), and whether they point at the
    object in space and at its event in time."""
    text = span.text.strip()
    parsed = parse_clip_sentence(text)
    obj = match_clip_object(parsed, objects)
    heat = span.per_token
    first, end = video.regions
    labels = video.labels - first
    top = span.top_regions(1)[0][0]
    group = hottest_group(heat[first:end], labels, video.token_groups, len(video.groups))
    record = {"text": text, "parsed": parsed is not None,
              "scores_per_token": [round(float(v), 6) for v in heat],
              "top_region": top, "hottest_frames": list(video.groups[group]),
              "object": None if obj is None else obj.record(),
              "space_hit": None, "time_hit": None}
    if obj is not None:
        hits = region_hits(labels, token_centres(video.boxes), token_frames(video),
                           end - first, obj)
        record["space_hit"] = bool(hits[top - first]) if first <= top < end else False
        if obj.quarter is not None:
            record["time_hit"] = set(video.groups[group]) <= set(obj.event_frames)
    return record


def run_video_demo(out: Path, num_clips: int = 3, *, model_dir: Optional[Path] = None,
                   regions: Union[int, Tuple[int, int]] = WORLD_GRID,
                   max_new_tokens: int = 72, echo: Callable[[str], None] = print) -> dict:
    """Runs the demo on ``num_clips`` held-out clips of the demo range (1, 2, 3, 1, ...
    objects) and writes ``out/clip{i}.mp4``, each clip's explain page ``out/clip{i}/``,
    ``out/report.json`` and ``out/index.html``. ``regions``: ``(rows, cols)`` for a grid in
    each frame group, or K Ward regions over space and time. Returns the report."""
    from ..explainer import iter_explain
    from ..explainer.scorers import SCORERS, choose_scorer

    if num_clips < 1:
        raise ValueError(f"headscope.shapes.video_demo: argument 'num_clips' must be >= 1, "
                         f"got {num_clips}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor, head = load(VIDEO_DIR if model_dir is None else model_dir)
    score_name = SCORERS[choose_scorer(None, head)]
    lo, hi = CLIP_OBJECTS
    clips = []
    with torch.no_grad():
        for i in range(num_clips):
            seed = CLIP_SEED_RANGES["demo"] + i
            frames, objects = clip(seed, lo + i % (hi - lo + 1))
            path = write_clip(out / f"clip{i}.mp4", frames)
            echo(f"clip {i} (seed {seed}, {len(objects)} objects): {path.name}")
            shown, result = 0, None
            for result in iter_explain(model, processor, [], CLIP_PROMPT, head,
                                       videos=[str(path)], regions=regions,
                                       max_new_tokens=max_new_tokens,
                                       model_name="headscope.shapes (the video model)"):
                for span in result.spans[shown:]:
                    if not span.special:
                        s = span_record(span, objects, result.videos[0])
                        echo(f"  {s['text']!r:62} hottest frames {s['hottest_frames']}"
                             + _verdict(s))
                shown = len(result.spans)
            spans = [span_record(s, objects, result.videos[0]) for s in result.spans
                     if not s.special]
            page = result.save(out / f"clip{i}")
            text = " ".join(s["text"] for s in spans)
            truth = describe_clip(objects)
            echo(f"  {'correct' if text == truth else 'truth: ' + truth}")
            clips.append({"seed": seed, "video": path.name,
                          "page": str(page.relative_to(out)), "truth": truth,
                          "description": text, "correct": text == truth,
                          "objects": [o.record() for o in objects],
                          "num_regions": result.num_regions, "spans": spans})
    report = {"scores": score_name, "regions": result.regions_name, "clips": clips,
              "summary": _summary(clips)}
    write_text(out / "report.json", json.dumps(report, indent=1) + "\n")
    write_text(out / "index.html", _html(report))
    s = report["summary"]
    echo(f"{s['correct']}/{s['clips']} descriptions correct; pointing ({score_name}) in "
         f"space {s['space_hits']}/{s['spans_on_objects']}, in time {s['time_hits']}/"
         f"{s['event_spans']}; wrote {out / 'index.html'}")
    return report


def video_page(folder: Path, regions=WORLD_GRID, scores: Optional[str] = None) -> Path:
    """The explain page of the video model describing a held-out three-object clip of the
    demo range, written as ``folder/clip.mp4`` and explained as ``python -m headscope
    explain --video`` explains a file (the page of the docs' picture, ``python -m
    headscope.shapes screenshot --video``), with the shipped video head (or the scorer
    ``scores``) on ``regions`` (``(rows, cols)`` in each quarter, or K Ward regions)."""
    from ..explainer import explain
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, processor, head = load(VIDEO_DIR, head=scores in (None, "head"))
    frames, _ = clip(CLIP_SEED_RANGES["demo"] + 2, 3)
    path = write_clip(folder / "clip.mp4", frames)
    return explain(model, processor, [], CLIP_PROMPT, head, videos=[str(path)],
                   scores=scores, regions=regions, max_new_tokens=72,
                   model_name="headscope.shapes (the video model)").save(folder / "page")


def _verdict(s: dict) -> str:
    if s["object"] is None:
        return ", names no object of the clip"
    where = f", {'on' if s['space_hit'] else 'off'} the object"
    return where + ("" if s["time_hit"] is None else
                    f", {'at' if s['time_hit'] else 'not at'} its event")


def _summary(clips: List[dict]) -> dict:
    named = [s for c in clips for s in c["spans"] if s["object"] is not None]
    events = [s for s in named if s["time_hit"] is not None]
    return {"clips": len(clips), "correct": sum(c["correct"] for c in clips),
            "spans": sum(len(c["spans"]) for c in clips), "spans_on_objects": len(named),
            "space_hits": sum(bool(s["space_hit"]) for s in named),
            "event_spans": len(events), "time_hits": sum(bool(s["time_hit"]) for s in events)}


def _html(report: dict) -> str:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>headscope shapes video "
             "demo</title><style>body{font-family:sans-serif;margin:2em}td{vertical-align:top;"
             "padding:4px 12px}.bad{color:#b00}</style></head><body>",
             f"<h1>headscope: which places and moments ground each sentence</h1><p>Scores: "
             f"{e(report['scores'])}; regions: {e(report['regions'])}.</p>"]
    for c in report["clips"]:
        verdict = "correct" if c["correct"] else "<span class='bad'>differs from truth</span>"
        parts.append(f"<h2>seed {c['seed']}</h2><p><b>model:</b> {e(c['description'])}<br>"
                     f"<b>truth:</b> {e(c['truth'])} ({verdict})<br><a href='{e(c['page'])}'>"
                     f"choose a sentence, see its heat on every frame and its timeline</a> "
                     f"&middot; <a href='{e(c['video'])}'>the video</a></p><table>")
        for s in c["spans"]:
            parts.append(f"<tr><td><b>{e(s['text'])}</b></td><td>hottest frames "
                         f"{s['hottest_frames']}{e(_verdict(s))}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
