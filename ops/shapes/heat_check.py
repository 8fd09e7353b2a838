"""Does the page point where the model looks? On the scenes of a seed range, the shapes
model's page (``headscope.explain``, the page ``python -m headscope explain`` writes)
without a head (the default scorer) and with the model folder's head: over the sentences
that name an object of the picture, the share where the object is painted hotter than the
rest of the picture (``heat_eval``'s definition: the mean heat per image token over the
object's tokens, those whose cell centre lies in its box, above the mean over the other
image tokens), with its Wilson 95% interval."""
from __future__ import annotations

from typing import Union

from .accuracy import wilson_interval
from .head_eval import range_scenes
from .heat_eval import object_tokens
from .model import load, prompt
from .world import IMAGE_SIZE, PROMPT, match_object, parse_sentence, scene

WHO = "headscope.shapes.heat_check"


def page_hotter(explanation, objects) -> list:
    """Per span of ``explanation`` that names an object of ``objects``: whether the page
    paints the object hotter than the rest of the picture (None where the object covers no
    token centre or every one)."""
    from ..metrics import hotter_than_rest
    (picture,) = explanation.pictures
    out = []
    for span in explanation.spans:
        obj = match_object(parse_sentence(span.text.strip()), objects)
        if obj is None:
            continue
        heat = span.per_token[picture.labels]
        out.append(hotter_than_rest(heat, object_tokens(picture.boxes, obj.box, IMAGE_SIZE)))
    return out


def check_pages(which: str = "heat-done", scenes: int = 300,
                regions: Union[int, tuple] = 8, model_dir=None, max_new_tokens: int = 48,
                progress: bool = True) -> dict:
    """The share of object-naming sentences whose object the page paints hotter than the
    rest, without a head (``headscope.explain``'s default scorer) and with the model
    folder's head, on the first ``scenes`` scenes of the ``which`` seed range."""
    from tqdm import tqdm

    from ..explainer import explain
    from ..explainer.scorers import DEFAULT_SCORER, SCORERS
    model, processor, head = load(model_dir)
    runs = {"no head": None, "head": head} if head is not None else {"no head": None}
    found = {name: [] for name in runs}
    chosen = range_scenes(which, scenes)
    for seed, count in tqdm(chosen, desc=f"pages ({which} seeds)", disable=not progress):
        image, objects = scene(seed, count)
        inputs = prompt(processor, image)
        for name, fitted in runs.items():
            result = explain(model, processor, [image], PROMPT, fitted, regions=regions,
                             inputs=inputs, max_new_tokens=max_new_tokens)
            found[name] += page_hotter(result, objects)
    out = {"seed_range": which, "seeds": [chosen[0][0], chosen[-1][0]], "scenes": scenes,
           "regions": regions if isinstance(regions, int) else "{}x{} grid".format(*regions),
           "scorers": {"no head": SCORERS[DEFAULT_SCORER], "head": SCORERS["head"]}}
    for name, values in found.items():
        defined = [v for v in values if v is not None]
        hits = sum(defined)
        out[name] = {"sentences": len(values), "defined": len(defined), "hotter": hits,
                     "share": hits / len(defined) if defined else None,
                     "interval95": list(wilson_interval(hits, len(defined))) if defined
                     else None}
    return out


def table(result: dict) -> str:
    rows = []
    for name in ("no head", "head"):
        if name not in result:
            continue
        r = result[name]
        share = "n/a" if r["share"] is None else \
            f"{100 * r['share']:.1f}% [{100 * r['interval95'][0]:.1f}, " \
            f"{100 * r['interval95'][1]:.1f}]"
        rows.append(f"| {name} ({result['scorers'][name]}) | {r['hotter']} of {r['defined']} "
                    f"| {share} |")
    return "\n".join([
        f"{result['scenes']} scenes ({result['seed_range']} seeds {result['seeds'][0]}.."
        f"{result['seeds'][1]}), {result['regions']} regions: sentences naming an object of "
        f"the picture, painted hotter on it than on the rest (Wilson 95% interval).", "",
        "| page | object hotter than the rest | share |", "| --- | --- | --- |", *rows])
