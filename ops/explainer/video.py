"""The videos of an :class:`~headscope.explainer.Explanation`: each video's sampled frames,
frame groups and regions (:class:`ExplainedVideo`), and how the page, the span PNGs and
report.json show a span's scores on them.

A video's tokens each cover a frame group (the frames the model merges into the same
tokens, Qwen-VL's 2) and a box on those frames. A span's heat on a frame paints each
token's box with its region's score per token (the region's score over its tokens, so
that regions of unequal size compare); every frame of a group shows that group's tokens.
The timeline gives each frame group's score: its tokens' shares of their regions' scores
(each region's score spread evenly over its tokens), so that the groups' scores add up to
the video's; with regions per frame group (the grid's default) a group's score is the sum
of its regions' scores."""
from __future__ import annotations

import html
import io
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

FRAME_SIDE = 448          # the longest side of a stored frame, in pixels
STRIP_WIDTH = 1060        # the page's strip of frames fits this width when it can
STRIP_FRAME = (112, 224)  # the longest side of a frame on the page: at least, at most
# the strip's pixels besides its frames: the score axis, and per frame group its gap,
# padding and border, per frame its gap
STRIP_AXIS, STRIP_GROUP, STRIP_GAP = 64, 20, 3
PNG_FRAMES = 16           # frames a span PNG shows at most (one per frame group beyond)
PNG_HEIGHT = 4.2          # inches of a span PNG for each video
JPEG_QUALITY = 88
HEAT_UNIT = "per token"


@dataclass
class ExplainedVideo:
    """One video of the prompt and where its tokens lie: ``frames``, the sampled frames
    (PIL RGB, longest side at most :data:`FRAME_SIDE`); ``width`` x ``height``, the source
    frames' size; ``fps``, the source frame rate; ``source_num_frames``, the source's
    frames (of which N were sampled); ``seconds`` ``(N,)``, each sampled
    frame's time and ``source_frames`` ``(N,)`` its index in the source (None where the
    inputs do not say); ``groups``, each frame group's sampled frames; per token (in the
    order of the tracer's ``VideoTokens.positions``) its box on the frame ``boxes``
    ``(T, 4)``, its region ``labels`` ``(T,)`` (numbered across the prompt's pictures and
    videos) and its frame group ``token_groups`` ``(T,)``; ``regions``: its regions
    ``[first, end)``."""
    name: str
    frames: List
    width: int
    height: int
    fps: Optional[float]
    source_num_frames: int
    seconds: Optional[torch.Tensor]
    source_frames: Optional[torch.Tensor]
    groups: List[Tuple[int, ...]]
    boxes: torch.Tensor
    labels: torch.Tensor
    token_groups: torch.Tensor
    regions: Tuple[int, int]

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    def group_tokens(self, g: int) -> SimpleNamespace:
        """Frame group ``g``'s tokens (``boxes``, ``labels``), as the page's region map
        takes a picture's."""
        mask = self.token_groups == g
        return SimpleNamespace(boxes=self.boxes[mask], labels=self.labels[mask])

    def time(self, frame: int) -> str:
        """A sampled frame's time on the page: seconds where known, else its number."""
        return f"{float(self.seconds[frame]):.2f} s" if self.seconds is not None \
            else f"frame {frame}"

    def span_of(self, frames: Sequence[int]) -> str:
        """Sampled frames ``frames`` (ascending) as the page names them."""
        first, last = frames[0], frames[-1]
        if self.seconds is None:
            return f"frame {first}" if first == last else f"frames {first}-{last}"
        a, b = float(self.seconds[first]), float(self.seconds[last])
        return f"{a:.2f} s" if first == last else f"{a:.2f}-{b:.2f} s"

    def region_frames(self, k: int) -> List[int]:
        """The sampled frames region ``k``'s tokens cover, ascending."""
        groups = self.token_groups[self.labels == k].unique().tolist()
        return sorted(f for g in groups for f in self.groups[g])


def explained_video(tokens, video, labels: torch.Tensor, regions: Tuple[int, int]
                    ) -> ExplainedVideo:
    """The :class:`ExplainedVideo` of the tracer's ``tokens`` (a ``VideoTokens``) for
    ``video`` (a ``headscope.videos.Video``), its tokens' region ``labels``."""
    from .heat_map import display_size
    from PIL import Image
    frames = []
    for picture in video.pictures():
        size = display_size(picture, FRAME_SIDE)
        frames.append(picture if size[0] >= picture.size[0] else
                      picture.resize(size, Image.LANCZOS))
    if len(frames) != tokens.num_frames:
        raise ValueError(f"headscope.explain: video {video.name} has {len(frames)} sampled "
                         f"frames, but the prompt's video tokens cover {tokens.num_frames}")
    return ExplainedVideo(
        name=video.name, frames=frames, width=int(video.frames.shape[-1]),
        height=int(video.frames.shape[-2]), fps=float(video.metadata.fps),
        source_num_frames=int(video.metadata.total_num_frames),
        seconds=tokens.seconds, source_frames=tokens.source_frames,
        groups=[g.frames for g in tokens.groups], boxes=tokens.boxes.float(),
        labels=labels, token_groups=tokens.token_groups, regions=regions)


# ---- a span's numbers on a video -------------------------------------------------------------

def group_scores(video: ExplainedVideo, heat: np.ndarray) -> np.ndarray:
    """``(G,)`` float64: each frame group's score, its tokens' heat summed (module
    docstring)."""
    labels = video.labels.numpy()
    share = np.where(labels >= 0, np.nan_to_num(heat[np.clip(labels, 0, None)]), 0.0)
    return np.bincount(video.token_groups.numpy(), weights=share, minlength=len(video.groups))


def regions_of(video: ExplainedVideo) -> List[dict]:
    """Each of the video's regions: its tokens, the sampled frames they cover and the box
    on the frame that holds them (None for a region without tokens)."""
    out = []
    for k in range(*video.regions):
        mask = video.labels == k
        boxes = video.boxes[mask]
        box = None if not len(boxes) else [float(boxes[:, 0].min()), float(boxes[:, 1].min()),
                                            float(boxes[:, 2].max()), float(boxes[:, 3].max())]
        out.append({"region": k, "tokens": int(mask.sum()), "frames": video.region_frames(k),
                    "box": box})
    return out


def video_report(video: ExplainedVideo, explanation) -> dict:
    """report.json's entry of ``video``: its frames, groups, regions and tokens, and per
    listed span its regions' scores (totals and per token) and its frame groups' scores."""
    first, end = video.regions
    spans = []
    for s in explanation.spans:
        heat = s.per_token.numpy()
        spans.append({"index": s.index,
                      "region_scores": s.scores[first:end].tolist(),
                      "region_scores_per_token": [None if np.isnan(v) else float(v)
                                                  for v in heat[first:end]],
                      "group_scores": group_scores(video, heat).tolist()})
    seconds = None if video.seconds is None else video.seconds.tolist()
    return {
        "name": video.name, "width": video.width, "height": video.height, "fps": video.fps,
        "source_num_frames": video.source_num_frames,
        "num_frames": video.num_frames,
        "source_frames": None if video.source_frames is None else video.source_frames.tolist(),
        "seconds": seconds,
        "groups": [{"frames": list(g), "seconds": None if seconds is None
                    else [seconds[g[0]], seconds[g[-1]]],
                    "tokens": int((video.token_groups == i).sum())}
                   for i, g in enumerate(video.groups)],
        "regions": list(video.regions), "region_list": regions_of(video),
        "token_boxes": video.boxes.tolist(), "token_regions": video.labels.tolist(),
        "token_groups": video.token_groups.tolist(), "spans": spans}


def where(video: ExplainedVideo, index: int, k: int) -> str:
    """Region ``k`` of ``video`` (the prompt's video ``index``) as the region table names
    it: the video and the frames it covers."""
    frames = video.region_frames(k)
    return f"video {index}" + (f", {video.span_of(frames)}" if frames else "")


# ---- the page --------------------------------------------------------------------------------

def frame_size(video: ExplainedVideo) -> Tuple[int, int]:
    """(width, height) of each frame of ``video``'s strip on the page: the strip fits
    :data:`STRIP_WIDTH` where frames of at least :data:`STRIP_FRAME`'s low side allow
    (longer strips scroll)."""
    from .heat_map import display_size
    low, high = STRIP_FRAME
    free = STRIP_WIDTH - STRIP_AXIS - STRIP_GROUP * len(video.groups) - \
        STRIP_GAP * video.num_frames
    width, height = video.frames[0].size
    # the frames' width fills the strip; a tall frame's longest side is its height
    side = free / video.num_frames * max(width, height) / width
    return display_size(video.frames[0], int(np.clip(side, low, high)))


def _jpeg_uri(picture) -> str:
    import base64
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def span_data(explanation, span) -> dict:
    """What the page's script needs of ``span`` on the videos: the colour bar's ends (heat
    per token), per video each frame group's heat overlay and score."""
    from .heat_map import heat_rgba, png_data_uri, region_map, scale
    heat = span.per_token.numpy()
    low, high = scale(heat)
    videos = []
    for v in explanation.videos:
        size = frame_size(v)
        overlays = [png_data_uri(heat_rgba(region_map(v.group_tokens(g), size), heat, low, high))
                    for g in range(len(v.groups))]
        videos.append({"overlays": overlays, "groups": group_scores(v, heat).tolist()})
    return {"low": low, "high": high, "videos": videos}


STYLE = """
.hs .videos{margin-top:1.2em}.hs .video{margin-bottom:1.4em}
.hs .vmeta{margin:.3em 0}.hs .vscroll{overflow-x:auto;padding-bottom:6px}
.hs .vstrip{display:flex;gap:10px;align-items:flex-start;width:max-content}
.hs .vgroup{display:flex;flex-direction:column;gap:3px;padding:4px;border:1px solid #ddd;
 border-radius:6px;background:#fafafa}
.hs .pic img.vheat{position:absolute;left:0;top:0}
.hs .pic .vrid{font-size:9px;padding:0 2px;background:rgba(255,255,255,.6)}
.hs .vframes{display:flex;gap:3px}.hs .vframe{display:flex;flex-direction:column;align-items:center}
.hs .vtime{font-size:11px;color:#444;margin-top:2px;white-space:nowrap}
.hs .vbar{position:relative;height:64px;border-top:1px dotted #ccc;border-bottom:1px dotted #ccc}
.hs .vbar .fill{position:absolute;left:12%;width:76%;background:#f0a020;border-radius:2px}
.hs .vbar .zero{position:absolute;left:0;right:0;border-top:1px solid #888}
.hs .vbar .val{position:absolute;left:0;right:0;text-align:center;font-size:11px;color:#222}
.hs .vaxis{display:flex;flex-direction:column;justify-content:space-between;font-size:11px;
 color:#444;text-align:right;white-space:nowrap}
.hs .vcaption{font-size:11px;color:#444;text-align:center}
.hs .vtimeline{display:flex;gap:1px;height:40px;max-width:1000px;margin:.2em 0 0 0;
 border-bottom:1px solid #888}
.hs .vtimeline .tbar{position:relative;flex:1;cursor:pointer}
.hs .vtimeline .tbar:hover{background:#f3f3f3}
.hs .vtimeline .fill{position:absolute;left:0;right:0;background:#f0a020}
.hs .vtl-axis{display:flex;justify-content:space-between;max-width:1000px;font-size:11px;
 color:#444;margin-bottom:.4em}
"""

SCRIPT = """
(function(root, fmt){
  root.hsVideos = function(s){
    root.querySelector('.vchosen').textContent = '\\u201c' + s.text.trim() + '\\u201d';
    root.querySelectorAll('.vlow').forEach(function(el){ el.textContent = fmt(s.video.low); });
    root.querySelectorAll('.vmid').forEach(function(el){
      el.textContent = fmt((s.video.low + s.video.high) / 2); });
    root.querySelectorAll('.vhigh').forEach(function(el){ el.textContent = fmt(s.video.high); });
    root.querySelectorAll('.video').forEach(function(box, v){
      var d = s.video.videos[v];
      box.querySelectorAll('img.vheat').forEach(function(img){
        img.src = d.overlays[+img.dataset.g]; img.alt = 'heat of span ' + s.index; });
      var lo = Math.min(0, Math.min.apply(null, d.groups)),
          hi = Math.max(0, Math.max.apply(null, d.groups)), range = (hi - lo) || 1;
      var best = d.groups.indexOf(Math.max.apply(null, d.groups));
      box.querySelectorAll('.vbar, .tbar').forEach(function(bar){
        var g = +bar.dataset.g, value = d.groups[g];
        var zero = hi / range * 100, top = (hi - Math.max(value, 0)) / range * 100;
        var fill = bar.querySelector('.fill');
        fill.style.top = top + '%';
        fill.style.height = Math.abs(value) / range * 100 + '%';
        fill.style.background = g === best ? '#d9480f' : '#f0a020';
        bar.title = 'frame group ' + g + ': ' + fmt(value);
        if (!bar.classList.contains('vbar')) return;  // the whole video's timeline: no labels
        bar.querySelector('.zero').style.top = zero + '%';
        var label = bar.querySelector('.val');
        label.textContent = fmt(value);
        label.style.top = (value >= 0 ? Math.max(top - 16, 0) : Math.min(top + Math.abs(value) / range * 100, 84)) + '%';
      });
      box.querySelector('.vmax').textContent = fmt(hi);
      box.querySelector('.vmin').textContent = fmt(lo);
    });
  };
  root.querySelectorAll('.video').forEach(function(box){  // a timeline bar shows its group
    var groups = box.querySelectorAll('.vgroup');
    box.querySelectorAll('.tbar').forEach(function(bar){
      bar.addEventListener('click', function(){
        groups[+bar.dataset.g].scrollIntoView({block: 'nearest', inline: 'center'}); });
    });
  });
})(document.getElementById('ROOT'), function(v){  // 4 significant digits: heat per token is small
  return v === 0 ? '0' : Math.abs(v) >= 1000 || Math.abs(v) < 0.001 ? v.toExponential(3) : v.toPrecision(4); });
"""


def _strip(video: ExplainedVideo, index: int) -> str:
    """One video's strip: per frame group its frames (each under its heat, the region
    numbers on the group's first frame, its time below) and its score's bar."""
    from .heat_map import region_centres, region_map
    x = html.escape
    width, height = frame_size(video)
    groups = []
    for g, frames in enumerate(video.groups):
        centres = region_centres(region_map(video.group_tokens(g), (width, height)),
                                 video.regions)
        cells = []
        for j, f in enumerate(frames):
            numbers = "".join(
                f"<span class='rid vrid' style='left:{cx * 100:.2f}%;top:{cy * 100:.2f}%'>{k}</span>"
                for k, (cx, cy) in centres.items()) if j == 0 else ""
            cells.append(
                f"<div class='vframe'><div class='pic'><img class='base' width='{width}' "
                f"height='{height}' alt='video {index}, frame {f}' "
                f"src='{_jpeg_uri(video.frames[f].resize((width, height)))}'>"
                f"<img class='vheat' data-g='{g}' width='{width}' height='{height}' "
                f"alt=''>{numbers}</div><span class='vtime'>{x(video.time(f))}</span></div>")
        groups.append(f"<div class='vgroup'><div class='vframes'>{''.join(cells)}</div>"
                      f"<div class='vbar' data-g='{g}'><div class='zero'></div>"
                      f"<div class='fill'></div><span class='val'></span></div>"
                      f"<div class='vcaption'>group {g}: {x(video.span_of(frames))}</div></div>")
    axis = (f"<div class='vaxis' style='width:{STRIP_AXIS - 10}px;height:64px;"
            f"margin-top:{height + 27}px'><span class='vmax'></span><span>score</span>"
            f"<span class='vmin'></span></div>")
    return f"<div class='vstrip'>{axis}{''.join(groups)}</div>"


def _timeline(video: ExplainedVideo) -> str:
    """The whole video's timeline: one bar per frame group, its width its share of the
    sampled frames (the strip below may scroll; clicking a bar brings its group into
    view)."""
    x = html.escape
    bars = "".join(f"<div class='tbar' data-g='{g}' style='flex:{len(frames)}'>"
                   f"<div class='fill'></div></div>" for g, frames in enumerate(video.groups))
    first, last = video.groups[0], video.groups[-1]
    return (f"<div class='vtimeline'>{bars}</div><div class='vtl-axis'>"
            f"<span>{x(video.time(first[0]))}</span><span>each frame group's score over "
            f"time (click a bar to see its frames)</span><span>{x(video.time(last[-1]))}</span>"
            f"</div>")


def _meta(video: ExplainedVideo, index: int) -> str:
    per = max(len(g) for g in video.groups)
    sampled = (f"{video.num_frames} of its {video.source_num_frames} frames sampled "
               f"({video.width}x{video.height}, {video.fps:g} fps)")
    merged = (f"{len(video.groups)} frame groups of {per} frames (the model merges each "
              f"group's frames into the same tokens)" if per > 1
              else f"{len(video.groups)} frame groups of one frame")
    return (f"<p class='vmeta'><b>Video {index}</b>: {html.escape(video.name)} &middot; "
            f"{sampled} &middot; {merged} &middot; regions {video.regions[0]} to "
            f"{video.regions[1] - 1}</p>")


def script(explanation, root: str) -> str:
    """The script that shows a chosen span on the videos (the page's script calls
    ``root.hsVideos(span)``); "" without videos."""
    return f"<script>{SCRIPT.replace('ROOT', root)}</script>" if explanation.videos else ""


def section(explanation, colour_stops: str) -> str:
    """The page's videos: each one's timeline and strip of frames, and the colour bar of
    the heat on their frames; "" without videos."""
    if not explanation.videos:
        return ""
    x = html.escape
    score_name = explanation.score_name
    videos = "".join(f"<div class='video'>{_meta(v, i)}{_timeline(v)}"
                     f"<div class='vscroll'>{_strip(v, i)}"
                     f"</div></div>" for i, v in enumerate(explanation.videos))
    return (f"<div class='videos'><style>{STYLE}</style><p class='vchosen'></p>"
            f"<div class='bar' style='background:linear-gradient(to right, {colour_stops})'>"
            f"</div><div class='ticks'><span class='vlow'></span><span class='vmid'></span>"
            f"<span class='vhigh'></span></div><p class='note'>Heat on the frames: "
            f"{x(score_name)} {HEAT_UNIT} of each region (its score over its tokens; colour "
            f"bar: the span's lowest to highest). Bars, on each video's timeline and under each "
            f"frame group: the group's score (its tokens' shares of their regions' scores), "
            f"the span's highest in red.</p>"
            f"{videos}</div>")


# ---- the span PNG ----------------------------------------------------------------------------

def png_frames(video: ExplainedVideo) -> List[int]:
    """The sampled frames a span PNG shows: all, or beyond :data:`PNG_FRAMES` the first
    frame of frame groups spread evenly over the video."""
    if video.num_frames <= PNG_FRAMES:
        return list(range(video.num_frames))
    chosen = np.unique(np.linspace(0, len(video.groups) - 1, PNG_FRAMES).round().astype(int))
    return [video.groups[g][0] for g in chosen]


def draw(figure, explanation, video: ExplainedVideo, index: int, heat: np.ndarray,
         low: float, high: float) -> None:
    """``video`` under a span's ``heat`` into the matplotlib (sub)figure ``figure``: its
    frames with their times, a colour bar, and the timeline of its frame groups'
    scores."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize

    from .heat_map import COLORMAP, heat_rgba, region_map
    frames = png_frames(video)
    top, bottom = figure.subfigures(2, 1, height_ratios=(1.25, 1))
    axes = top.subplots(1, len(frames), squeeze=False)[0]
    group_of = {f: g for g, fs in enumerate(video.groups) for f in fs}
    for ax, f in zip(axes, frames):
        picture = video.frames[f]
        ax.imshow(np.asarray(picture))
        ax.imshow(heat_rgba(region_map(video.group_tokens(group_of[f]), picture.size), heat,
                            low, high))
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel(video.time(f), fontsize=8)
    bar = plt.cm.ScalarMappable(Normalize(low, high if high > low else low + 1e-12),
                                cmap=COLORMAP)
    top.colorbar(bar, ax=list(axes), shrink=0.9).set_label(
        f"{explanation.score_name}\n{HEAT_UNIT}", fontsize=8)
    shown = "" if len(frames) == video.num_frames else \
        f", {len(frames)} of {video.num_frames} frames shown"
    top.suptitle(f"video {index}: {video.name}{shown}", fontsize=9)
    scores = group_scores(video, heat)
    ax = bottom.subplots()
    if video.seconds is not None:
        seconds = video.seconds.numpy()
        starts = np.array([seconds[g[0]] for g in video.groups])
        step = np.median(np.diff(seconds)) if len(seconds) > 1 else 1.0
        widths = np.array([seconds[g[-1]] - seconds[g[0]] + step for g in video.groups])
        ax.set_xlabel("seconds", fontsize=8)
    else:
        starts = np.array([g[0] for g in video.groups], dtype=float)
        widths = np.array([len(g) for g in video.groups], dtype=float)
        ax.set_xlabel("sampled frame", fontsize=8)
    colours = ["#d9480f" if s == scores.max() else "#f0a020" for s in scores]
    ax.bar(starts, scores, width=widths * 0.9, align="edge", color=colours)
    ax.axhline(0, color="#888", linewidth=0.8)
    ax.set_ylabel("frame group's\nscore", fontsize=8)
    ax.tick_params(labelsize=8)
