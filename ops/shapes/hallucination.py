"""Hallucination detection from VAS on the shapes model: an answer that names an object
the image does not hold (wrong shape, colour or place) is hallucinated, by construction.
:class:`~headscope.VASDetector` on the answer's 36 VAS features against the answer's mean
token log-probability, AUROC on held-out answers. Crowded scenes are both harder and
different in VAS, so each AUROC is also given within object counts (pairs of a
hallucinated and a faithful answer to scenes of the same count), beside the AUROC of the
object count alone."""
from __future__ import annotations

from typing import Iterator, Tuple

import torch

from ..detector import VASDetector
from ..metrics import auroc, auroc_interval, auroc_within
from .accuracy import HELD_OUT_SEED
from .model import load, prompt
from .world import hallucinated as names_what_is_not_there, scene

# Held-out scenes of their own, seeds from here on.
OFFSET = 2_000_000


def described_scenes(model, processor, count: int, start: int = 0,
                     objects: Tuple[int, int] = (1, 4), max_new_tokens: int = 64,
                     progress: bool = True) -> Iterator[tuple]:
    """For ``count`` held-out scenes (seeds ``HELD_OUT_SEED + OFFSET + start + k``,
    ``lo + k % (hi - lo + 1)`` objects for ``objects = (lo, hi)``), in order: ``(seed,
    object count, image, its objects, prompt inputs, the greedy answer's sequence)``."""
    from tqdm import tqdm

    lo, hi = objects
    for k in tqdm(range(start, start + count), desc="answers", disable=not progress):
        seed, num_objects = HELD_OUT_SEED + OFFSET + k, lo + k % (hi - lo + 1)
        image, truth = scene(seed, num_objects)
        inputs = prompt(processor, image)
        with torch.no_grad():
            sequences = model.generate(**inputs, max_new_tokens=max_new_tokens,
                                       do_sample=False)
        yield seed, num_objects, image, truth, inputs, sequences


def answers(count: int, start: int = 0, model_dir=None, max_new_tokens: int = 64,
            progress: bool = True, objects: Tuple[int, int] = (1, 4)) -> dict:
    """For ``count`` held-out scenes (:func:`described_scenes`): the answer's VAS
    features ``(N, 36)``, its mean token log-probability ``(N,)``, whether it is
    hallucinated ``(N,)``, the scene's object count ``(N,)`` and the texts."""
    from ..hf import Tracer

    model, processor, _ = load(model_dir, head=False)
    eos = processor.tokenizer.eos_token_id
    features, logprob, hallucinated, counts, texts = [], [], [], [], []
    for _, num_objects, _, truth, inputs, sequences in described_scenes(
            model, processor, count, start, objects, max_new_tokens, progress):
        counts.append(num_objects)
        P = inputs["input_ids"].shape[1]
        with torch.no_grad():
            # one forward over the prompt and the answer gives both its VAS and its logits
            types = torch.zeros_like(sequences, dtype=inputs["mm_token_type_ids"].dtype)
            types[:, :P] = inputs["mm_token_type_ids"]
            with Tracer(model, regions=None, vas=True) as tr:
                logits = model(input_ids=sequences, attention_mask=torch.ones_like(sequences),
                               pixel_values=inputs["pixel_values"],
                               image_grid_thw=inputs["image_grid_thw"],
                               mm_token_type_ids=types, use_cache=False).logits[0, P - 1:-1]
                features.append(tr.vas_features()[0])
        answer = sequences[0, P:]
        lp = torch.log_softmax(logits.float(), -1).gather(1, answer[:, None])[:, 0]
        keep = torch.cumsum((answer == eos).long(), 0) - (answer == eos).long() == 0
        logprob.append(float(lp[keep].mean()))
        text = processor.tokenizer.decode(answer, skip_special_tokens=True)
        texts.append(text)
        hallucinated.append(names_what_is_not_there(text, truth))
    return {"features": torch.stack(features), "logprob": torch.tensor(logprob),
            "hallucinated": torch.tensor(hallucinated), "objects": torch.tensor(counts),
            "texts": texts}


def measure_hallucination(fit_count: int = 1000, test_count: int = 1000, model_dir=None,
                          progress: bool = True, objects: Tuple[int, int] = (1, 4)) -> dict:
    """Fits :class:`VASDetector` on the answers of ``fit_count`` held-out scenes and
    measures, on the next ``test_count``, its AUROC and that of the baseline (minus the
    answer's mean token log-probability: less confident, more likely hallucinated), of
    the same regression on the VAS features and the log-probability together and on the
    VAS features and the scene's object count, each with a bootstrap 95% interval,
    overall and within object counts. ``objects``: objects per scene, ``(lo, hi)``."""
    fit = answers(fit_count, 0, model_dir, progress=progress, objects=objects)
    test = answers(test_count, fit_count, model_dir, progress=progress, objects=objects)
    labels = test["hallucinated"]
    scores = {"vas_detector": None, "mean_logprob": -test["logprob"], "vas_and_logprob": None,
              "vas_and_count": None}
    # the regressions need both classes among the fitting answers (a model that rarely errs
    # may give none of one in a small sample): without them only the baseline is measured
    if fit["hallucinated"].any() and not fit["hallucinated"].all():
        detector = VASDetector().fit(fit["features"], fit["hallucinated"])
        # does VAS add to the baseline? the same regression on the features and the log-prob
        both = VASDetector(fit["features"].shape[1] + 1).fit(_with(fit, "logprob"),
                                                             fit["hallucinated"])
        # does VAS tell answers to scenes of one count apart once it is told the count?
        counted = VASDetector(fit["features"].shape[1] + 1).fit(_with(fit, "objects"),
                                                                fit["hallucinated"])
        scores["vas_detector"] = detector.predict_proba(test["features"])
        scores["vas_and_logprob"] = both.predict_proba(_with(test, "logprob"))
        scores["vas_and_count"] = counted.predict_proba(_with(test, "objects"))
    result = {"fit_answers": fit_count, "test_answers": test_count, "objects": list(objects),
              "fit_hallucinated": float(fit["hallucinated"].double().mean()),
              "test_hallucinated": float(labels.double().mean())}
    result.update({f"auroc_{name}": None if s is None else auroc(s, labels)
                   for name, s in scores.items()})
    result["auroc_95_interval"] = {name: None if s is None else auroc_interval(s, labels)
                                   for name, s in scores.items()}
    counts = test["objects"]
    result["auroc_object_count_alone"] = auroc(counts.double(), labels)
    result["auroc_within_object_count"] = {
        name: None if s is None else auroc_within(s, labels, counts)
        for name, s in scores.items()}
    result["auroc_within_object_count_95_interval"] = {
        name: None if s is None else auroc_interval(s, labels, strata=counts)
        for name, s in scores.items()}
    result["seeds"] = [HELD_OUT_SEED + OFFSET, HELD_OUT_SEED + OFFSET + fit_count
                       + test_count - 1]
    return result


def _with(answers: dict, key: str) -> torch.Tensor:
    """The answers' VAS features with one more column, ``answers[key]``."""
    return torch.cat([answers["features"], answers[key][:, None].to(
        answers["features"].dtype)], 1)
