"""Hallucination detection from VAS on the shapes model: an answer that names an object
the image does not hold (wrong shape, colour or place) is hallucinated, by construction.
:class:`~headscope.VASDetector` on the answer's 36 VAS features against the answer's mean
token log-probability, AUROC on held-out answers. Crowded scenes are both harder and
different in VAS, so each AUROC is also given within object counts (pairs of a
hallucinated and a faithful answer to scenes of the same count), beside the AUROC of the
object count alone."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..detector import VASDetector
from .accuracy import HELD_OUT_SEED
from .model import load, prompt
from .world import match_object, parse_description, scene

# Held-out scenes of their own, seeds from here on.
OFFSET = 2_000_000


def answers(count: int, start: int = 0, model_dir=None, max_new_tokens: int = 64,
            progress: bool = True, objects: Tuple[int, int] = (1, 4)) -> dict:
    """For ``count`` held-out scenes (seeds ``HELD_OUT_SEED + OFFSET + start + k``,
    ``lo + k % (hi - lo + 1)`` objects for ``objects = (lo, hi)``): the answer's VAS
    features ``(N, 36)``, its mean token log-probability ``(N,)``, whether it is
    hallucinated ``(N,)``, the scene's object count ``(N,)`` and the texts."""
    from tqdm import tqdm

    from ..hf import Tracer

    lo, hi = objects
    model, processor, _ = load(model_dir, head=False)
    eos = processor.tokenizer.eos_token_id
    features, logprob, hallucinated, counts, texts = [], [], [], [], []
    for k in tqdm(range(start, start + count), desc="answers", disable=not progress):
        counts.append(lo + k % (hi - lo + 1))
        image, truth = scene(HELD_OUT_SEED + OFFSET + k, counts[-1])
        inputs = prompt(processor, image)
        P = inputs["input_ids"].shape[1]
        with torch.no_grad():
            sequences = model.generate(**inputs, max_new_tokens=max_new_tokens,
                                       do_sample=False)
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
        parsed = parse_description(text)
        hallucinated.append(not parsed or any(match_object(p, truth) is None
                                              for p in parsed))
    return {"features": torch.stack(features), "logprob": torch.tensor(logprob),
            "hallucinated": torch.tensor(hallucinated), "objects": torch.tensor(counts),
            "texts": texts}


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> Optional[float]:
    """Area under the ROC curve of ``scores`` for ``labels`` (None with one class)."""
    from sklearn.metrics import roc_auc_score
    if labels.all() or not labels.any():
        return None
    return float(roc_auc_score(labels.numpy(), scores.double().numpy()))


def auroc_within(scores: torch.Tensor, labels: torch.Tensor,
                 strata: torch.Tensor) -> Optional[float]:
    """AUROC over the pairs of a positive and a negative of the same stratum only: the
    probability that a hallucinated answer scores above a faithful one to a scene of the
    same object count (ties count half). None without such a pair."""
    above = pairs = 0.0
    scores, labels = scores.double(), labels.bool()
    for value in strata.unique():
        same = strata == value
        pos, neg = scores[same & labels], scores[same & ~labels]
        if len(pos) and len(neg):
            diff = pos[:, None] - neg[None, :]
            above += float((diff > 0).sum()) + 0.5 * float((diff == 0).sum())
            pairs += len(pos) * len(neg)
    return above / pairs if pairs else None


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
    result["auroc_95_interval"] = {name: None if s is None else bootstrap_interval(s, labels)
                                   for name, s in scores.items()}
    counts = test["objects"]
    result["auroc_object_count_alone"] = auroc(counts.double(), labels)
    result["auroc_within_object_count"] = {
        name: None if s is None else auroc_within(s, labels, counts)
        for name, s in scores.items()}
    result["auroc_within_object_count_95_interval"] = {
        name: None if s is None else bootstrap_interval(s, labels, strata=counts)
        for name, s in scores.items()}
    result["seeds"] = [HELD_OUT_SEED + OFFSET, HELD_OUT_SEED + OFFSET + fit_count
                       + test_count - 1]
    return result


def bootstrap_interval(scores: torch.Tensor, labels: torch.Tensor, rounds: int = 1000,
                       seed: int = 0, strata: Optional[torch.Tensor] = None) -> Optional[list]:
    """The 2.5% and 97.5% quantiles of the AUROC (within ``strata`` when given:
    :func:`auroc_within`) over ``rounds`` resamples of the answers with replacement
    (resamples without a pair to compare are skipped); None without one in the answers."""
    def metric(pick):
        if strata is None:
            return auroc(scores[pick], labels[pick])
        return auroc_within(scores[pick], labels[pick], strata[pick])

    if metric(torch.arange(len(labels))) is None:
        return None
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(rounds):
        pick = torch.randint(len(labels), (len(labels),), generator=generator)
        value = metric(pick)
        if value is not None:
            values.append(value)
    low, high = torch.tensor(values, dtype=torch.float64).quantile(
        torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [low, high]


def _with(answers: dict, key: str) -> torch.Tensor:
    """The answers' VAS features with one more column, ``answers[key]``."""
    return torch.cat([answers["features"], answers[key][:, None].to(
        answers["features"].dtype)], 1)
