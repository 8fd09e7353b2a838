"""What a :class:`~headscope.hf.Tracer` does with its model's calls (:class:`Phase`)."""
from __future__ import annotations

import enum


class Phase(enum.Enum):
    """What the attention calls of the forward running now compute. Outside a generation
    the tracer's decoder hook moves it between READY and VAS; while a generation runs the
    generation holds it (GENERATING, PREFILL, DECODE) and pauses it at each span."""
    DETACHED = "detached"  # not bound: the model runs as it was loaded
    READY = "ready"  # bound; a forward without a key cache computes VAS and region ids
    VAS = "vas"  # in such a forward (vas=True): each layer's VAS statistics
    ANSWER = "answer"  # a forward over a prompt and its answer: VAS, no region ids
    GENERATING = "generating"  # generate runs; its forwards compute nothing (no regions)
    PREFILL = "prefill"  # generate's first forward: each layer's last query row to the rows
    DECODE = "decode"  # a decode step: each layer's query row and keys to the rows
    PAUSED = "paused"  # generate waits at a span for its consumer: the model must not run
