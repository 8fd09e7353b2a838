"""What scores a span's regions on the explain page: the tracer's own features as they
stream (raw attention, raw value-norm-weighted attention, an attribution head's predicted
effects), or a post-hoc method computed as each span ends (AttnLRP, the gradient norm: one
forward and one backward over the sequence so far, while generation waits), so that the
page still shows each span as it comes."""
from __future__ import annotations

from typing import Optional

import torch

# scorer -> its name on the page, the terminal and report.json
SCORERS = {"attention": "raw attention",
           "attention*value_norm": "raw value-norm-weighted attention",
           "attnlrp": "AttnLRP (log p)",
           "gradient": "gradient norm",
           "head": "head's predicted effect"}
SCORE_HELP = {
    "attention": "each region's attention mass from the span, mean over the decoder's layers "
                 "and heads",
    "attention*value_norm": "each region's attention mass from the span with each key "
                            "weighted by its value norm, mean over the decoder's layers and "
                            "heads",
    "attnlrp": "AttnLRP relevance of the span's log-probability at the region's image tokens, "
               "computed as the span ends",
    "gradient": "the norm of the gradient of the span's log-probability at each of the "
                "region's image tokens, summed, computed as the span ends",
    "head": "the attribution head's predicted effect of ablating the region on the span",
}
# the scorer without a fitted head that measured best on deletion and insertion AUC on the
# shapes world's dev range, over the world's cells and 8 Ward regions (docs/explain.md,
# "Scores": level with AttnLRP there, ahead of raw attention)
DEFAULT_SCORER = "gradient"
POSTHOC = ("attnlrp", "gradient")
WHO = "headscope.explain"


def posthoc_unsupported(scorer: str, model) -> Optional[str]:
    """Why ``scorer`` cannot run on ``model``, or None: a post-hoc scorer on a model whose
    quantized layers pass no gradient to their inputs
    (:func:`headscope.hf.quantized.check_input_gradients`), AttnLRP on a decoder with
    parameters it has no rule for (such as mixture-of-experts layers)."""
    if scorer not in POSTHOC:
        return None
    from ..hf.quantized import check_input_gradients
    try:
        check_input_gradients(model, WHO)
    except NotImplementedError as e:
        return str(e)
    if scorer != "attnlrp":
        return None
    from ..hf.attnlrp import AttnLRP
    binding = AttnLRP(model)
    try:
        binding._check(list(binding.decoder.modules()) + [model.get_output_embeddings()])
    except NotImplementedError as e:
        return str(e)
    return None


def runnable_scorer(scores: Optional[str], head, model) -> str:
    """:func:`choose_scorer`, checked against ``model`` before anything is generated: a
    scorer asked for that cannot run on it is refused (ValueError, naming why); the
    default without a head falls back to raw attention, with a warning that names why,
    where the gradient norm cannot run (quantized layers without a true gradient)."""
    scorer = choose_scorer(scores, head)
    why = posthoc_unsupported(scorer, model)
    if why is None:
        return scorer
    if scores is None:
        import warnings
        warnings.warn(f"{WHO}: the default scorer ({SCORERS[scorer]}) cannot run on this "
                      f"model, so the page shows raw attention: {why}", stacklevel=3)
        return "attention"
    raise ValueError(f"{WHO}: scores={scores!r} cannot run on this model: {why}")


def choose_scorer(scores: Optional[str], head) -> str:
    """The scorer of ``scores=`` (None: the head's when one is given, else
    :data:`DEFAULT_SCORER`); a head needs ``"head"`` and ``"head"`` a head."""
    if scores is None:
        return "head" if head is not None else DEFAULT_SCORER
    if scores not in SCORERS:
        raise ValueError(f"{WHO}: argument 'scores' must be one of "
                         f"{', '.join(map(repr, SCORERS))}, got {scores!r}")
    if scores == "head" and head is None:
        raise ValueError(f"{WHO}: scores='head' needs a head (an AttributionHead fitted for "
                         f"this model)")
    if scores != "head" and head is not None:
        raise ValueError(f"{WHO}: a head is given but scores={scores!r} does not use it; "
                         f"leave scores out or pass 'head'")
    return scores


def traced_features(scorer: str, head) -> str:
    """The feature set the tracer computes for ``scorer`` (a head's own; both blocks for
    value-norm-weighted attention, so that the page also shows raw attention)."""
    if scorer == "head":
        return head.feature_set if hasattr(head, "feature_set") else "attention"
    return "both" if scorer == "attention*value_norm" else "attention"


def block_mean(features: torch.Tensor, feature_set: str, block: str) -> torch.Tensor:
    """``(K,)``: a block's columns of a span's features averaged over layers and heads (the
    raw baseline of that block)."""
    from ..features import feature_columns
    return feature_columns(features, feature_set, block).mean(-1)


def posthoc_scores(scorer: str, tracer, model, inputs: dict, answer_ids, span
                   ) -> torch.Tensor:
    """``(K,)``: AttnLRP's or the gradient norm's scores of ``span``'s regions, over the
    prompt and the answer so far (``answer_ids``, ending with the span). The tracer stands
    aside meanwhile (its generation waits at the span)."""
    from ..hf import attnlrp_scores, gradient_norm_scores
    device = inputs["input_ids"].device
    sequences = torch.cat([inputs["input_ids"],
                           torch.tensor([list(answer_ids)], dtype=inputs["input_ids"].dtype,
                                        device=device)], 1)
    region_ids = tracer.region_ids[:1]
    tracer.detach()
    try:
        if scorer == "attnlrp":
            scores = attnlrp_scores(model, inputs, sequences, [(span.start, span.end)],
                                    region_ids)
        else:
            scores = gradient_norm_scores(model, inputs, sequences, [(span.start, span.end)],
                                          region_ids)
    finally:
        tracer.attach()
    return scores[0].cpu()
