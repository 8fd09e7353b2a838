"""Hallucination detection from VAS on the shapes model: an answer that names an object
the image does not hold (wrong shape, colour or place) is hallucinated, by construction.
:class:`~headscope.VASDetector` on the answer's 36 VAS features against the answer's mean
token log-probability, AUROC on held-out answers."""
from __future__ import annotations

from typing import Optional

import torch

from ..detector import VASDetector
from .accuracy import HELD_OUT_SEED
from .model import load, prompt
from .world import match_object, parse_description, scene

# Harder held-out scenes (3 to 6 objects, noisy background), seeds from here on.
HARD_OFFSET = 2_000_000
HARD_NOISE = 16.0


def answers(count: int, start: int = 0, model_dir=None, max_new_tokens: int = 64,
            progress: bool = True) -> dict:
    """For ``count`` hard held-out scenes (seeds ``HELD_OUT_SEED + HARD_OFFSET + start +
    k``, ``3 + k % 4`` objects): the answer's VAS features ``(N, 36)``, its mean token
    log-probability ``(N,)``, whether it is hallucinated ``(N,)`` and the texts."""
    from tqdm import tqdm

    from ..hf import Tracer

    model, processor, _ = load(model_dir, head=False)
    eos = processor.tokenizer.eos_token_id
    features, logprob, hallucinated, texts = [], [], [], []
    for k in tqdm(range(start, start + count), desc="answers", disable=not progress):
        image, objects = scene(HELD_OUT_SEED + HARD_OFFSET + k, 3 + k % 4, noise=HARD_NOISE)
        inputs = prompt(processor, image)
        P = inputs["input_ids"].shape[1]
        with torch.no_grad():
            with Tracer(model, regions=None, vas=True) as tr:
                sequences = tr.generate_with(lambda span: None, **inputs,
                                             max_new_tokens=max_new_tokens, do_sample=False)
                features.append(tr.vas_features()[0])  # the prompt and the whole answer
            types = torch.zeros_like(sequences, dtype=inputs["mm_token_type_ids"].dtype)
            types[:, :P] = inputs["mm_token_type_ids"]
            logits = model(input_ids=sequences, pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=types).logits[0, P - 1:-1]
        answer = sequences[0, P:]
        lp = torch.log_softmax(logits.float(), -1).gather(1, answer[:, None])[:, 0]
        keep = torch.cumsum((answer == eos).long(), 0) - (answer == eos).long() == 0
        logprob.append(float(lp[keep].mean()))
        text = processor.tokenizer.decode(answer, skip_special_tokens=True)
        texts.append(text)
        parsed = parse_description(text)
        hallucinated.append(not parsed or any(match_object(p, objects) is None
                                              for p in parsed))
    return {"features": torch.stack(features), "logprob": torch.tensor(logprob),
            "hallucinated": torch.tensor(hallucinated), "texts": texts}


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> Optional[float]:
    """Area under the ROC curve of ``scores`` for ``labels`` (None with one class)."""
    from sklearn.metrics import roc_auc_score
    if labels.all() or not labels.any():
        return None
    return float(roc_auc_score(labels.numpy(), scores.double().numpy()))


def measure_hallucination(fit_count: int = 200, test_count: int = 200, model_dir=None,
                          progress: bool = True) -> dict:
    """Fits :class:`VASDetector` on the answers of ``fit_count`` hard held-out scenes and
    measures, on the next ``test_count``, its AUROC and that of the baseline (minus the
    answer's mean token log-probability: less confident, more likely hallucinated)."""
    fit = answers(fit_count, 0, model_dir, progress=progress)
    test = answers(test_count, fit_count, model_dir, progress=progress)
    detector = VASDetector().fit(fit["features"], fit["hallucinated"])
    return {"fit_answers": fit_count, "test_answers": test_count,
            "fit_hallucinated": float(fit["hallucinated"].double().mean()),
            "test_hallucinated": float(test["hallucinated"].double().mean()),
            "auroc_vas_detector": auroc(detector.predict_proba(test["features"]),
                                        test["hallucinated"]),
            "auroc_mean_logprob": auroc(-test["logprob"], test["hallucinated"]),
            "seeds": [HELD_OUT_SEED + HARD_OFFSET, HELD_OUT_SEED + HARD_OFFSET + fit_count
                      + test_count - 1]}
