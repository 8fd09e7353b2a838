"""``headscope.explain``: which parts of the pictures each span of a VLM's answer rests on,
as the answer is generated, on any supported model.

    result = headscope.explain(model, processor, [picture], "Describe the image.")
    result.spans          # each span: its text, scores per region, features
    result.save("out")    # out/index.html (one self-contained page), report.json, PNGs
    result                # in a notebook: the same page, inline

Scores are the attribution head's predicted effect of ablating each region when a head
is given, else raw attention (each region's attention mass averaged over the decoder's
layers and heads). ``iter_explain`` yields the explanation after each span, for pages and
terminals that show spans while the model generates (``python -m headscope explain``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..pictures import upright_rgb

RAW_ATTENTION = "raw attention"
HEAD_EFFECT = "head's predicted effect"
DEFAULT_GRID = (3, 3)


@dataclass
class ExplainedSpan:
    """One span of the answer. ``text``: its part of the decoded answer (special tokens
    left out, spacing as in the whole answer); ``special``: the tracer's ``span.special``,
    it holds only special tokens (such as end-of-text), so it names nothing of the pictures; ``features`` ``(K, F)``:
    the tracer's span features; ``attention`` ``(K,)``: their attention block averaged over
    layers and heads (raw attention); ``head_scores`` ``(K,)``: the head's predicted
    effects, or None without a head; ``scores``: what the page shows (the head's, else raw
    attention)."""
    index: int
    start: int
    end: int
    text: str
    token_ids: List[int]
    special: bool
    features: torch.Tensor
    attention: torch.Tensor
    head_scores: Optional[torch.Tensor] = None

    @property
    def scores(self) -> torch.Tensor:
        return self.attention if self.head_scores is None else self.head_scores

    def top_regions(self, count: int = 3) -> List[Tuple[int, float]]:
        """The ``count`` best-scored regions, ``(region, score)``, best first."""
        order = torch.argsort(self.scores, descending=True)[:count]
        return [(int(k), float(self.scores[k])) for k in order]


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
    the prompt, the answer, its spans, the pictures with their regions, the answer's VAS
    features and, with a detector, its hallucination probability. ``done``: generation
    has ended (VAS and the hallucination probability are then set)."""
    prompt: str
    pictures: List[Picture]
    score_name: str
    regions_name: str
    feature_set: str
    model_name: str
    spans: List[ExplainedSpan] = field(default_factory=list)
    answer: str = ""
    vas_features: Optional[dict] = None
    hallucination: Optional[float] = None
    done: bool = False

    @property
    def num_regions(self) -> int:
        return self.pictures[-1].regions[1] if self.pictures else 0

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


def prompt_inputs(processor, images: Sequence, prompt: str) -> dict:
    """The processor's inputs for ``prompt`` about ``images`` (PIL), through its chat
    template: one user turn holding the pictures, then the text."""
    if getattr(processor, "chat_template", None) is None:
        raise ValueError("headscope: the processor has no chat template to build the prompt "
                         "with; build the model inputs yourself (headscope.explain takes them "
                         "as inputs=)")
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=list(images), return_tensors="pt"))


def tracer_regions(regions: Union[int, Tuple[int, int], str]):
    """``(what Tracer(regions=) takes, its name)`` for K Ward regions, a ``(rows, cols)``
    grid, or its spelling ``"3x3"`` / ``"8"``."""
    from ..hf import grid_regions
    from ..hf.regions import parse_grid
    if isinstance(regions, str):
        regions = int(regions) if regions.strip().isdigit() else parse_grid(regions)
    if isinstance(regions, int) and not isinstance(regions, bool):
        if regions < 1:
            raise ValueError(f"headscope.explain: argument 'regions' must be >= 1, got {regions}")
        return regions, f"{regions} Ward regions per picture"
    rows, cols = regions
    return grid_regions(rows, cols), f"a {rows}x{cols} grid per picture"


def iter_explain(model, processor, images: Sequence, prompt: str, head=None, *,
                 regions: Union[int, Tuple[int, int], str] = DEFAULT_GRID,
                 detector=None, inputs: Optional[dict] = None, max_new_tokens: int = 64,
                 model_name: Optional[str] = None, **generate_kwargs
                 ) -> Iterator[Explanation]:
    """:func:`explain`, yielding the explanation after each span as the model generates
    it, and once more when generation has ended (``done`` True, VAS set)."""
    from ..hf import Tracer
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("headscope.explain: argument 'prompt' must be a non-empty string")
    if not images:
        raise ValueError("headscope.explain: argument 'images' must hold at least one picture")
    images = [upright_rgb(image, f"headscope.explain: images[{i}]") for i, image in enumerate(images)]
    traced, regions_name = tracer_regions(regions)
    if inputs is None:
        inputs = prompt_inputs(processor, images, prompt)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    tokenizer = getattr(processor, "tokenizer", processor)
    result = Explanation(prompt=prompt, pictures=[], feature_set="",
                         score_name=RAW_ATTENTION if head is None else HEAD_EFFECT,
                         regions_name=regions_name,
                         model_name=model_name or getattr(model.config, "_name_or_path", "")
                         or type(model).__name__)
    answer_ids: List[int] = []
    with torch.no_grad(), Tracer(model, regions=traced, vas=True, head=head,
                                 tokenizer=tokenizer) as tr:
        result.feature_set = tr.features
        L, H = tr.num_layers, tr.num_heads
        for span in tr.generate(**inputs, max_new_tokens=max_new_tokens, **generate_kwargs):
            if not result.pictures:  # the prefill has laid out the pictures and regions
                result.pictures = _pictures(tr, images, traced)
            before = tokenizer.decode(answer_ids, skip_special_tokens=True)
            answer_ids += span.token_ids.tolist()
            result.answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
            result.spans.append(ExplainedSpan(
                index=len(result.spans), start=span.start, end=span.end,
                text=result.answer[len(before):] if result.answer.startswith(before)
                else tokenizer.decode(span.token_ids, skip_special_tokens=True),
                token_ids=span.token_ids.tolist(),
                special=span.special,
                features=span.features, attention=span.features[:, :L * H].mean(-1),
                head_scores=span.scores))
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
    and flattens transparency on white) under :class:`headscope.hf.Tracer` and returns an :class:`Explanation`: the answer's spans
    (sentence ends), each with its score per region of the pictures, the answer's VAS
    features, and the pages that show them (``.save(dir)``, ``_repr_html_``).

    ``head``: an ``AttributionHead`` fitted for this model (scores: its predicted effects;
    the tracer computes the head's feature set), else None (raw attention).
    Keyword arguments: ``regions`` (K Ward regions per picture, or ``(rows, cols)`` /
    ``"3x3"``: a grid of blocks on each picture; default 3x3), ``detector`` (a
    ``headscope.VASDetector``: the answer's hallucination probability), ``inputs`` (the
    model inputs, for a processor without a chat template), ``max_new_tokens`` (64),
    ``model_name`` (shown on the page), and ``generate``'s own (``do_sample``, ...)."""
    result = None
    for result in iter_explain(model, processor, images, prompt, head, **kwargs):
        pass
    return result


def _pictures(tr, images: Sequence, regions) -> List[Picture]:
    """The prompt's pictures with each token's box and region (batch row 0)."""
    from ..hf import grid_regions
    row = tr.images[0]
    if len(row) != len(images):
        raise ValueError(f"headscope.explain: the prompt holds {len(row)} pictures, "
                         f"got {len(images)} images")
    ids = tr.region_ids[0].cpu()
    pictures, first = [], 0
    for i, (tokens, image) in enumerate(zip(row, images)):
        labels = ids[tokens.positions]
        end = first + regions.rows * regions.cols if isinstance(regions, grid_regions) \
            else int(labels.max()) + 1
        pictures.append(Picture(image=image, boxes=tokens.boxes.float(), labels=labels,
                                regions=(first, end),
                                views=[{"name": v.name, "rows": v.rows, "cols": v.cols,
                                        "box": [float(c) for c in v.box]}
                                       for v in tokens.views]))
        first = end
    return pictures
