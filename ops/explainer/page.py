"""What an :class:`~headscope.explainer.Explanation` looks like: heat maps of a span's
region scores on the picture plane, the self-contained HTML page, one PNG per span and
report.json. Videos (their strips of frames and timelines) are ``video.py``'s.

Every token of every view (tiles, thumbnails, global images, crops) has a box on its
picture; a picture's region map paints each token's box with its region, coarse views
first, so the finest view present decides each pixel. A span's heat map colours each
pixel by its region's score per image token (the region's score over its tokens, so that
regions of unequal size compare: a region's score and its ablation effect both grow with
its size), scaled to the span's lowest and highest (the colour bar says which numbers
those are and names the unit)."""
from __future__ import annotations

import html
import io
import json
import math
import uuid
from pathlib import Path
import numpy as np

from ..io import atomic_path
from . import video as videos
from .heat_map import (COLORMAP, display_size, displayed, heat_rgba, png_data_uri,
                       region_centres, region_map, scale)
from .scorers import SCORE_HELP
from .video import video_report

HEAT_UNIT = "per image token"


def _shown_spans(explanation) -> list:
    return [s for s in explanation.spans if not s.special]


def heat_label(explanation) -> str:
    """The colour bar's name: the scores and their unit."""
    return f"{explanation.score_name} {HEAT_UNIT}"


def report(explanation) -> dict:
    """Every number of the explanation (report.json)."""
    e = explanation
    return {
        "model": e.model_name, "prompt": e.prompt, "answer": e.answer,
        "scores": e.score_name, "scorer": e.scorer, "regions": e.regions_name,
        "feature_set": e.feature_set,
        "num_regions": e.num_regions, "complete": e.done, "heat": HEAT_UNIT,
        "region_tokens": e.region_tokens.tolist(),
        "pictures": [{"width": p.image.size[0], "height": p.image.size[1],
                      "regions": list(p.regions), "views": p.views,
                      "token_boxes": p.boxes.tolist(), "token_regions": p.labels.tolist()}
                     for p in e.pictures],
        "spans": [{"index": s.index, "start": s.start, "end": s.end, "text": s.text,
                   "token_ids": s.token_ids, "special": s.special,
                   "png": None if s.special else png_name(s),
                   "scores": s.scores.tolist(),
                   "scores_per_token": [None if math.isnan(v) else v
                                        for v in s.per_token.tolist()],
                   "attention": None if s.attention is None else s.attention.tolist(),
                   "head_scores": None if s.head_scores is None else s.head_scores.tolist(),
                   "top_regions": [k for k, _ in s.top_regions(e.num_regions)],
                   "features": s.features.tolist()} for s in e.spans],
        "videos": [video_report(v, e) for v in e.videos],
        "vas_features": e.vas_features, "hallucination_probability": e.hallucination,
    }


def png_name(span) -> str:
    return f"span{span.index}.png"


def span_png(explanation, span) -> bytes:
    """A PNG of one span's picture(s) under its heat map (scores per image token), with
    region numbers and a colour bar that names the unit, and of its videos (``video.draw``:
    frames under the heat, the timeline of frame groups)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize

    scores = span.per_token.numpy()
    low, high = scale(scores)
    pictures = explanation.pictures
    heights = [4.6] * bool(pictures) + [videos.PNG_HEIGHT] * len(explanation.videos)
    width = max(4.4 * len(pictures) + 1.4, 11.0 * bool(explanation.videos))
    fig = plt.figure(figsize=(width, sum(heights) + 0.3), dpi=100, layout="constrained")
    parts = list(fig.subfigures(len(heights), 1, squeeze=False, height_ratios=heights)[:, 0])
    picture_part = parts.pop(0) if pictures else None
    axes = picture_part.subplots(1, len(pictures), squeeze=False) if pictures else [[]]
    for ax, picture in zip(axes[0], pictures):
        size = display_size(picture.image)
        labels = region_map(picture, size)
        ax.imshow(np.asarray(displayed(picture.image)))
        ax.imshow(heat_rgba(labels, scores, low, high))
        for k, (x, y) in region_centres(labels, picture.regions).items():
            ax.text(x * size[0], y * size[1], str(k), ha="center", va="center", fontsize=8,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.7))
        ax.set_xticks([])
        ax.set_yticks([])
    if pictures:
        bar = plt.cm.ScalarMappable(Normalize(low, high if high > low else low + 1e-12),
                                    cmap=COLORMAP)
        picture_part.colorbar(bar, ax=list(axes[0]), shrink=0.85).set_label(
            heat_label(explanation))
    for i, (part, video) in enumerate(zip(parts, explanation.videos)):
        videos.draw(part, explanation, video, i, scores, low, high)
    text = span.text.strip()
    fig.suptitle(f"\u201c{text[:77] + '...' if len(text) > 80 else text}\u201d", fontsize=11)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _colour_stops() -> str:
    import matplotlib
    cmap = matplotlib.colormaps[COLORMAP]
    stops = []
    for t in np.linspace(0, 1, 11):
        r, g, b, _ = (np.array(cmap(t)) * 255).round().astype(int)
        stops.append(f"rgb({r},{g},{b}) {t * 100:.0f}%")
    return ", ".join(stops)


def _page_data(explanation) -> dict:
    """What the page's script needs: per picture its base image and region centres, per
    listed span its overlays (one per picture), colour bar ends and region table."""
    e = explanation
    pictures, maps = [], []
    for p in e.pictures:
        size = display_size(p.image)
        labels = region_map(p, size)
        maps.append(labels)
        pictures.append({"src": png_data_uri(displayed(p.image)), "width": size[0],
                         "height": size[1],
                         "centres": {str(k): [round(x, 4), round(y, 4)]
                                     for k, (x, y) in region_centres(labels, p.regions).items()}})
    tokens = e.region_tokens
    spans = []
    for s in _shown_spans(e):
        heat = s.per_token.numpy()
        low, high = scale(heat)
        spans.append({
            "index": s.index, "text": s.text, "low": low, "high": high,
            "overlays": [png_data_uri(heat_rgba(m, heat, low, high)) for m in maps],
            # region, where, tokens, score, score per token, raw attention
            "table": [[k, e.where(k), int(tokens[k]), float(s.scores[k]), float(heat[k]),
                       None if s.attention is None else float(s.attention[k])]
                      for k, _ in s.top_regions(e.num_regions)]})
        if e.videos:
            spans[-1]["video"] = videos.span_data(e, s)
    # raw attention beside another scorer's scores, when the tracer computed it
    beside = e.scorer != "attention" and all(s.attention is not None for s in e.spans)
    return {"pictures": pictures, "spans": spans, "raw": beside}


STYLE = """
.hs{font-family:system-ui,sans-serif;color:#222;max-width:1100px}
.hs h1{font-size:1.3em;margin:.2em 0}.hs .meta{color:#666;font-size:.9em}
.hs .prompt{background:#f3f3f3;padding:.5em .8em;border-radius:6px}
.hs .answer{line-height:1.9;font-size:1.05em}
.hs .span{cursor:pointer;border-bottom:3px solid #f0a020;padding:1px 2px;border-radius:3px}
.hs .span:hover{background:#fff3d6}.hs .span.chosen{background:#f0a020;color:#000}
.hs .span sup{color:#888;font-size:.7em;margin-left:1px}
.hs .view{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start;margin-top:1em}
.hs .pic{position:relative;display:inline-block;line-height:0}
.hs .pic img{display:block}.hs .pic img.heat{position:absolute;left:0;top:0}
.hs .pic .rid{position:absolute;transform:translate(-50%,-50%);font-size:11px;line-height:1;
 background:rgba(255,255,255,.75);padding:1px 3px;border-radius:3px;pointer-events:none}
.hs .side{max-width:560px}
.hs .bar{width:260px;height:14px;border:1px solid #999}
.hs .ticks{display:flex;justify-content:space-between;width:262px;font-size:.8em}
.hs table{border-collapse:collapse;font-size:.9em}
.hs td,.hs th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:right}
.hs td{white-space:nowrap}
.hs tr.top td{font-weight:bold}.hs .note{color:#666;font-size:.85em}
"""

SCRIPT = """
(function(root, data){
  var fmt = function(v){ return Math.abs(v) >= 1000 || (Math.abs(v) < 0.001 && v !== 0)
      ? v.toExponential(2) : v.toFixed(4); };
  var heats = root.querySelectorAll('img.heat');
  function choose(i){
    var s = data.spans[i];
    root.querySelectorAll('.span').forEach(function(el){
      el.classList.toggle('chosen', +el.dataset.i === i); });
    heats.forEach(function(img, p){ img.src = s.overlays[p]; img.alt = 'heat map of span ' + s.index; });
    root.querySelector('.chosen-text').textContent = '\\u201c' + s.text.trim() + '\\u201d';
    root.querySelector('.low').textContent = fmt(s.low);
    root.querySelector('.mid').textContent = fmt((s.low + s.high) / 2);
    root.querySelector('.high').textContent = fmt(s.high);
    var rows = s.table.map(function(r, j){
      return '<tr' + (j === 0 ? ' class="top"' : '') + '><td>' + r[0] + '</td><td>' + r[1] +
        '</td><td>' + r[2] + '</td><td>' + fmt(r[3]) + '</td><td>' + fmt(r[4]) + '</td>' +
        (data.raw ? '<td>' + fmt(r[5]) + '</td>' : '') + '</tr>'; });
    root.querySelector('tbody.scores').innerHTML = rows.join('');
    if (root.hsVideos) root.hsVideos(s);
  }
  root.querySelectorAll('.span').forEach(function(el){
    el.addEventListener('click', function(){ choose(+el.dataset.i); });
    el.addEventListener('keydown', function(ev){
      if (ev.key === 'Enter' || ev.key === ' ') { ev.preventDefault(); choose(+el.dataset.i); } });
  });
  if (data.spans.length) choose(0);
})(document.getElementById('ROOT'), DATA);
"""


def _body(explanation, root: str) -> str:
    e = explanation
    x = html.escape
    data = _page_data(e)
    shown = {s.index: i for i, s in enumerate(_shown_spans(e))}
    answer = []
    for s in e.spans:
        if s.index in shown:
            answer.append(f"<span class='span' role='button' tabindex='0' "
                          f"data-i='{shown[s.index]}'>{x(s.text)}<sup>{s.index}</sup></span>")
        else:
            answer.append(x(s.text))
    hidden = len(e.spans) - len(shown)
    notes = []
    if hidden:
        notes.append(f"{hidden} span{'s' if hidden > 1 else ''} of special tokens only "
                     f"(such as end-of-text) not listed; report.json holds "
                     f"{'them' if hidden > 1 else 'it'}.")
    if not e.done:
        notes.append("Generating...")
    pictures = "".join(
        f"<div class='pic'><img class='base' src='{p['src']}' width='{p['width']}' "
        f"height='{p['height']}' alt='picture {i}'><img class='heat' width='{p['width']}' "
        f"height='{p['height']}' alt=''>"
        + "".join(f"<span class='rid' style='left:{c[0] * 100:.2f}%;top:{c[1] * 100:.2f}%'>"
                  f"{k}</span>" for k, c in p["centres"].items())
        + "</div>" for i, p in enumerate(data["pictures"]))
    extra = []
    if e.hallucination is not None:
        extra.append(f"<p><b>Hallucination probability</b> (VAS detector): "
                     f"{e.hallucination:.3f}</p>")
    if e.vas_features is not None:
        cells = "".join(f"<tr><td style='text-align:left'>{x(k)}</td><td>{v:.5g}</td></tr>"
                        for k, v in e.vas_features.items())
        extra.append(f"<details><summary>VAS features of the prompt and answer "
                     f"({len(e.vas_features)})</summary><table>{cells}</table></details>")
    raw_column = "<th>raw attention</th>" if data["raw"] else ""
    script = SCRIPT.replace("ROOT", root).replace(
        "DATA", json.dumps(data).replace("</", "<\\/"))
    return (
        f"<div class='hs' id='{root}'><style>{STYLE}</style>"
        f"<h1>headscope explain</h1><p class='meta'>{x(e.model_name)} &middot; scores: "
        f"{x(e.score_name)} ({x(SCORE_HELP.get(e.scorer, ''))}) &middot; regions: "
        f"{x(e.regions_name)}, {e.num_regions} in all</p>"
        f"<p class='prompt'><b>Prompt:</b> {x(e.prompt)}</p>"
        f"<p class='answer'><b>Answer</b> <span class='note'>(choose a span)</span>: "
        f"{''.join(answer)}</p><p class='note'>{' '.join(notes)}</p>"
        f"{videos.section(e, _colour_stops())}<div class='view'><div>{pictures}</div>"
        f"<div class='side'><p class='chosen-text'></p><div{'' if e.pictures else ' hidden'}>"
        f"<div class='bar' style='background:linear-gradient(to right, {_colour_stops()})'>"
        f"</div><div class='ticks'><span class='low'></span><span class='mid'></span>"
        f"<span class='high'></span></div><p class='note unit'>{x(heat_label(e))} "
        f"(colour bar: the span's lowest to highest; each region's score divided by its "
        f"image tokens, so that regions of unequal size compare)</p></div>"
        f"<table><thead><tr><th>region</th><th>where</th><th>tokens</th>"
        f"<th>total</th><th>{x(HEAT_UNIT)}</th>"
        f"{raw_column}</tr></thead><tbody class='scores'></tbody></table></div></div>"
        f"{''.join(extra)}"
        f"{videos.script(e, root)}<script>{script}</script></div>")


def page(explanation, inline: bool = False) -> str:
    """The page of ``explanation``: a whole HTML document, or (``inline``) a fragment for
    a notebook, its element ids unique."""
    root = "hs-" + uuid.uuid4().hex[:8] if inline else "hs-page"
    body = _body(explanation, root)
    if inline:
        return body
    return ("<!doctype html><html><head><meta charset='utf-8'><title>headscope explain: "
            f"{html.escape(explanation.prompt[:60])}</title></head><body>{body}</body></html>\n")


def save(explanation, folder: Path) -> Path:
    """index.html, report.json and a PNG per listed span into ``folder``, atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in _shown_spans(explanation):
        _write(folder / png_name(s), span_png(explanation, s))
    _write(folder / "report.json", (json.dumps(report(explanation), indent=1) + "\n").encode())
    _write(folder / "index.html", page(explanation).encode())
    return folder / "index.html"


def _write(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)
