"""headscope inside a running transformers VLM: :class:`Tracer` computes VAS features
and span-to-region attribution during ``forward`` and ``generate``;
:func:`region_effects` measures the ground truth the attribution head is fitted to
(:func:`gradient_scores`: an input x gradient baseline beside it;
:func:`attnlrp_scores`: AttnLRP, the post-hoc baseline);
:func:`use_mixer` puts the doubly-stochastic mixer in place of vision-tower attention.

Needs ``transformers`` (``pip install headscope[hf]``); ``import headscope`` alone never
imports it.
"""
from .attnlrp import attnlrp_scores
from .effects import region_effects
from .gradient import gradient_scores
from .mixer import MixerHandle, saved_mixer_rank, use_mixer
from .regions import grid_regions
from .stream import Span, sentence_end, special_only
from .tracer import Tracer
from .value_norm import value_norm_factors, value_norms

__all__ = ["MixerHandle", "Span", "Tracer", "attnlrp_scores", "gradient_scores", "grid_regions",
           "region_effects", "saved_mixer_rank", "sentence_end", "special_only", "use_mixer",
           "value_norm_factors", "value_norms"]
