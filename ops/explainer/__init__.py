"""``headscope.explain``: which parts of the pictures (and which moments and places of the
videos) each span of a VLM's answer rests on, as the answer is generated, on any supported
model.

    result = headscope.explain(model, processor, [picture], "Describe the image.")
    result.spans          # each span: its text, scores per region, features
    result.save("out")    # out/index.html (one self-contained page), report.json, PNGs
    result                # in a notebook: the same page, inline

    headscope.explain(model, processor, [], "What happens?", videos=["clip.mp4"])

Scores (``scores=``, ``scorers.py``): the attribution head's predicted effect of ablating
each region when a head is given, else the default scorer without a head (the gradient
norm, computed as each span ends), or raw attention, raw value-norm-weighted attention or
AttnLRP. The page paints each region's score per image token (of a picture or a video).
``iter_explain`` yields the explanation after each span, for pages and terminals that show
spans while the model generates (``python -m headscope explain``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..pictures import upright_rgb
from ..videos import Video, as_video
from .scorers import SCORERS
from .video import ExplainedVideo, explained_video, where as video_where

DEFAULT_GRID = (3, 3)


@dataclass
class ExplainedSpan:
    """One span of the answer. ``text``: its part of the decoded answer (special tokens
    left out, spacing as in the whole answer); ``special``: the tracer's ``span.special``,
    it holds only special tokens (such as end-of-text), so it names nothing of the pictures; ``features`` ``(K, F)``:
    the tracer's span features; ``attention`` ``(K,)``: their attention block averaged over
    layers and heads (raw attention; None when the tracer computed only value-norm-weighted
    attention, for such a head); ``scores`` ``(K,)``: each region's score by the
    explanation's scorer, a total over the region's image tokens; ``head_scores`` ``(K,)``:
    the head's predicted effects, or None without a head; ``region_tokens`` ``(K,)``: how many
    image tokens each region holds (every view of every picture, every frame group of every
    video); ``per_token``: the
    scores per image token, what the page paints, so that a large region does not win by
    its size."""
    index: int
    start: int
    end: int
    text: str
    token_ids: List[int]
    special: bool
    features: torch.Tensor
    attention: Optional[torch.Tensor]
    scores: torch.Tensor
    head_scores: Optional[torch.Tensor] = None
    region_tokens: Optional[torch.Tensor] = None

    @property
    def per_token(self) -> torch.Tensor:
        """``(K,)`` float64: each region's score divided by its image tokens (the scores
        themselves when the token counts are not known); NaN for a region without tokens."""
        scores = self.scores.double()
        if self.region_tokens is None:
            return scores
        return scores / self.region_tokens.double().masked_fill(self.region_tokens == 0,
                                                                 float("nan"))

    def top_regions(self, count: int = 3) -> List[Tuple[int, float]]:
        """The ``count`` hottest regions as the page paints them, ``(region, score per
        image token)``, hottest first (regions without tokens last)."""
        from ..metrics import heat_order
        heat = self.per_token
        return [(int(k), float(heat[k])) for k in heat_order(heat)[:count]]


@dataclass
class Picture:
    """One picture of the prompt and where its tokens lie on it: ``boxes`` ``(N, 4)``
    (each token's cell, normalised to the picture), ``labels`` ``(N,)`` (each token's
    region, numbered across the prompt's pictures), ``regions``: its regions
    ``[first, end)``, ``views``: each view's name, token grid and box."""
    image: object  # PIL RGB
    boxes: torch.Tensor
    labels: torch.Tensor
    regions: Tuple[int, int]
    views: List[dict]


@dataclass
class Explanation:
    """What :func:`explain` returns (and :func:`iter_explain` yields as spans come):
    the prompt, the answer, its spans, the pictures and videos (``videos``: each an
    ``ExplainedVideo``, ``video.py``) with their regions, the answer's VAS features and,
    with a detector, its hallucination probability. ``scorer``: what scores the regions (a
    key of ``headscope.explainer.scorers.SCORERS``), ``score_name`` its name. ``done``:
    generation has ended (VAS and the hallucination probability are then set)."""
    prompt: str
    pictures: List[Picture]
    score_name: str
    regions_name: str
    feature_set: str
    model_name: str
    spans: List[ExplainedSpan] = field(default_factory=list)
    scorer: str = "attention"
    answer: str = ""
    vas_features: Optional[dict] = None
    hallucination: Optional[float] = None
    done: bool = False
    videos: List[ExplainedVideo] = field(default_factory=list)

    @property
    def num_regions(self) -> int:
        return max((m.regions[1] for m in [*self.pictures, *self.videos]), default=0)

    def where(self, region: int) -> str:
        """Which picture or video region ``region`` lies in, as the region table says."""
        for i, picture in enumerate(self.pictures):
            if picture.regions[0] <= region < picture.regions[1]:
                return f"picture {i}"
        for i, video in enumerate(self.videos):
            if video.regions[0] <= region < video.regions[1]:
                return video_where(video, i, region)
        raise ValueError(f"headscope.explain: no picture or video holds region {region}")

    @property
    def region_tokens(self) -> torch.Tensor:
        """``(K,)`` int64: the image tokens of each region, over every view of every
        picture and every frame group of every video."""
        from ..hf.curves import region_tokens
        media = [*self.pictures, *self.videos]
        labels = torch.cat([m.labels for m in media]) if media else \
            torch.zeros(0, dtype=torch.int64)
        return region_tokens(labels, self.num_regions)

    def report(self) -> dict:
        """Every number of the explanation, as report.json holds them."""
        from .page import report
        return report(self)

    def html(self) -> str:
        """The page: one self-contained HTML file (pictures embedded, no network)."""
        from .page import page
        return page(self)

    def _repr_html_(self) -> str:
        from .page import page
        return page(self, inline=True)

    def save(self, folder: Union[str, Path]) -> Path:
        """Writes ``folder/index.html``, ``folder/report.json`` and ``folder/span{j}.png``
        (one per span), each atomically; creates the folder. Returns the page's path."""
        from .page import save
        return save(self, Path(folder))


def video_processor_of(processor):
    """``processor``'s video processor; a ValueError for a processor without one (checked
    before any video is read)."""
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        raise ValueError(f"headscope: the processor ({type(processor).__name__}) has no video "
                         f"processor, so the model takes no video")
    return video_processor


def prompt_inputs(processor, images: Sequence, prompt: str, videos: Sequence[Video] = ()
                  ) -> dict:
    """The processor's inputs for ``prompt`` about ``images`` (PIL) and ``videos``
    (``headscope.videos.Video``: frames sampled as the processor samples them, with their
    metadata), through its chat template: one user turn holding the pictures, then the
    videos, then the text."""
    if getattr(processor, "chat_template", None) is None:
        raise ValueError("headscope: the processor has no chat template to build the prompt "
                         "with; build the model inputs yourself (headscope.explain takes them "
                         "as inputs=)")
    if videos:
        video_processor_of(processor)
    content = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos] + \
        [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=list(images) or None, return_tensors="pt",
                          **Video.processor_kwargs(list(videos))))


def tracer_regions(regions: Union[int, Tuple[int, int], str], frames: Optional[int] = None,
                   videos: bool = False):
    """``(what Tracer(regions=) takes, its name)`` for K Ward regions, a ``(rows, cols)``
    grid, or its spelling ``"3x3"`` / ``"8"``; ``frames``: a grid's time windows of that
    many sampled frames on videos (default: each frame group); ``videos``: the prompt holds
    videos (the name says what the regions are on them)."""
    from ..hf import grid_regions
    from ..hf.regions import parse_grid
    if frames is not None and not videos:
        raise ValueError("headscope.explain: argument 'frames' (time windows on videos) has no "
                         "effect without videos")
    if isinstance(regions, str):
        regions = int(regions) if regions.strip().isdigit() else parse_grid(regions)
    if isinstance(regions, int) and not isinstance(regions, bool):
        if regions < 1:
            raise ValueError(f"headscope.explain: argument 'regions' must be >= 1, got {regions}")
        if frames is not None:
            raise ValueError("headscope.explain: argument 'frames' (time windows) needs grid "
                             "regions; Ward regions cluster over space and time by themselves")
        return regions, f"{regions} Ward regions per picture" + \
            (" and per video (over space and time)" if videos else "")
    rows, cols = regions
    window = "frame group" if frames is None else f"window of {frames} frames"
    return grid_regions(rows, cols, frames), f"a {rows}x{cols} grid per picture" + \
        (f" and per {window} of each video" if videos else "")


def iter_explain(model, processor, images: Sequence, prompt: str, head=None, *,
                 videos: Sequence = (),
                 scores: Optional[str] = None,
                 regions: Union[int, Tuple[int, int], str] = DEFAULT_GRID,
                 frames: Optional[int] = None,
                 detector=None, inputs: Optional[dict] = None, max_new_tokens: int = 64,
                 model_name: Optional[str] = None, **generate_kwargs
                 ) -> Iterator[Explanation]:
    """:func:`explain`, yielding the explanation after each span as the model generates
    it, and once more when generation has ended (``done`` True, VAS set)."""
    from ..hf import Tracer
    from .scorers import POSTHOC, block_mean, posthoc_scores, runnable_scorer, traced_features
    scorer = runnable_scorer(scores, head, model)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("headscope.explain: argument 'prompt' must be a non-empty string")
    if not images and not videos:
        raise ValueError("headscope.explain: arguments 'images' and 'videos' hold no picture "
                         "and no video; give at least one")
    images = [upright_rgb(image, f"headscope.explain: images[{i}]") for i, image in enumerate(images)]
    if videos:
        video_processor = video_processor_of(processor)
        videos = [as_video(video, video_processor, f"headscope.explain: videos[{i}]")
                  for i, video in enumerate(videos)]
    traced, regions_name = tracer_regions(regions, frames, bool(videos))
    if inputs is None:
        inputs = prompt_inputs(processor, images, prompt, videos)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    for key in ("pixel_values", "pixel_values_videos"):
        if key in inputs and inputs[key].is_floating_point():
            inputs[key] = inputs[key].to(model.dtype)
    tokenizer = getattr(processor, "tokenizer", processor)
    result = Explanation(prompt=prompt, pictures=[], feature_set="",
                         score_name=SCORERS[scorer], scorer=scorer,
                         regions_name=regions_name,
                         model_name=model_name or getattr(model.config, "_name_or_path", "")
                         or type(model).__name__)
    answer_ids: List[int] = []
    with torch.no_grad(), Tracer(model, regions=traced, vas=True, head=head,
                                 tokenizer=tokenizer,
                                 features=traced_features(scorer, head)) as tr:
        result.feature_set = features = tr.features
        for span in tr.generate(**inputs, max_new_tokens=max_new_tokens, **generate_kwargs):
            if not result.spans:  # the prefill has laid out the pictures, videos and regions
                result.pictures, result.videos = _media(tr, images, videos)
                tokens = result.region_tokens
            before = tokenizer.decode(answer_ids, skip_special_tokens=True)
            answer_ids += span.token_ids.tolist()
            result.answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
            attention = None if features == "attention*value_norm" else \
                block_mean(span.features, features, "attention")
            if scorer == "head":
                chosen = span.scores
            elif scorer in POSTHOC:
                chosen = posthoc_scores(scorer, tr, model, inputs, answer_ids, span)
            else:
                chosen = block_mean(span.features, features, scorer)
            result.spans.append(ExplainedSpan(
                index=len(result.spans), start=span.start, end=span.end,
                text=result.answer[len(before):] if result.answer.startswith(before)
                else tokenizer.decode(span.token_ids, skip_special_tokens=True),
                token_ids=span.token_ids.tolist(),
                special=span.special,
                features=span.features, attention=attention, scores=chosen,
                head_scores=span.scores, region_tokens=tokens))
            yield result
        vas = tr.vas_features()[0].float().cpu()
    from ..vas import VAS_COLUMNS
    result.vas_features = dict(zip(VAS_COLUMNS, vas.tolist()))
    if detector is not None:
        result.hallucination = float(detector.predict_proba(vas[None])[0])
    result.done = True
    yield result


def explain(model, processor, images: Sequence, prompt: str, head=None, **kwargs
            ) -> Explanation:
    """Generates ``model``'s answer to ``prompt`` about ``images`` (PIL pictures, taken as
    they are seen: ``headscope.pictures.upright_rgb`` turns them by their EXIF orientation
    and flattens transparency on white) and ``videos`` under
    :class:`headscope.hf.Tracer` and returns an :class:`Explanation`: the answer's spans
    (sentence ends), each with its score per region of the pictures and videos, the
    answer's VAS features, and the pages that show them (``.save(dir)``,
    ``_repr_html_``).

    ``head``: an ``AttributionHead`` fitted for this model (scores: its predicted effects;
    the tracer computes the head's feature set), else None.
    Keyword arguments: ``videos`` (paths, read by ``headscope.videos.read_video`` with the
    processor's video processor, or ``headscope.videos.Video``; the prompt shows them
    after the pictures), ``scores`` (``"attention"``, ``"attention*value_norm"``,
    ``"attnlrp"``, ``"gradient"`` or ``"head"``, which needs ``head``; default: ``"head"``
    with a head, else ``scorers.DEFAULT_SCORER``, the gradient norm, or raw attention with
    a warning where quantized layers pass no gradient; a scorer that cannot run on the
    model is refused before generating), ``regions`` (K Ward regions per picture and per
    video, or ``(rows, cols)`` / ``"3x3"``: a grid of blocks on each picture and each video
    frame group; default 3x3), ``frames`` (a grid's time windows on videos: that many
    sampled frames, a multiple of the frames the model merges into one token; default each
    frame group), ``detector`` (a
    ``headscope.VASDetector``: the answer's hallucination probability), ``inputs`` (the
    model inputs, for a processor without a chat template), ``max_new_tokens`` (64),
    ``model_name`` (shown on the page), and ``generate``'s own (``do_sample``, ...)."""
    result = None
    for result in iter_explain(model, processor, images, prompt, head, **kwargs):
        pass
    return result


def media_mismatch(pictures: int, videos: int, images: int, given_videos: int) -> str:
    """Why a prompt laid out with ``pictures`` pictures and ``videos`` videos does not match
    ``images`` pictures and ``given_videos`` videos asked about, or "" when it does."""
    if pictures == images and videos == given_videos:
        return ""
    why = f"the prompt holds {pictures} pictures and {videos} videos, got {images} images " \
          f"and {given_videos} videos"
    if videos < given_videos and pictures > images:
        why += ("; this model's processor writes a video's frames as pictures of their own "
                "(InternVL, SmolVLM), which explain does not show as a video")
    return why


def _media(tr, images: Sequence, videos: Sequence[Video]
           ) -> Tuple[List[Picture], List[ExplainedVideo]]:
    """The prompt's pictures and videos with each token's box and region (batch row 0;
    the tracer's ``media_regions``: each picture's and video's regions)."""
    from ..hf.families import VideoTokens
    row = tr.media_regions[0]
    found = {kind: [m for m in row if isinstance(m.media, VideoTokens) == (kind == "videos")]
             for kind in ("pictures", "videos")}
    mismatch = media_mismatch(len(found["pictures"]), len(found["videos"]), len(images),
                              len(videos))
    if mismatch:
        raise ValueError(f"headscope.explain: {mismatch}")
    ids = tr.region_ids[0].cpu()
    pictures = [Picture(image=image, boxes=m.media.boxes.float(), labels=ids[m.media.positions],
                        regions=(m.first, m.end),
                        views=[{"name": v.name, "rows": v.rows, "cols": v.cols,
                                "box": [float(c) for c in v.box]} for v in m.media.views])
                for m, image in zip(found["pictures"], images)]
    explained = [explained_video(m.media, video, ids[m.media.positions], (m.first, m.end))
                 for m, video in zip(found["videos"], videos)]
    return pictures, explained
