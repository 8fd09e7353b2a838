""":class:`Tracer`: VAS features and span-to-region attribution of a transformers VLM,
computed inside its attention calls while it runs, with no attention matrix stored.

Attaching sets the text decoder's attention implementation to ``"headscope"`` (see
``backend.py``), which runs the implementation the model was loaded with and hands each
layer's q (after rotary), key cache, mask and per-head outputs to this object; detaching
puts the original back. Only the text decoder is traced.

The tracer binds to the model and routes each attention call by its :class:`Phase`: to
the VAS statistics of a forward (:class:`~headscope.hf.forward_vas.ForwardVAS`),
or, while a generation runs, to that :class:`~headscope.hf.generation.Generation`, which
holds everything of one ``generate`` (its query rows, its spans, what it leaves). Each
call's mask comes from the forward's :class:`~headscope.hf.mask_log.MaskLog`; the pictures'
layout from the model's family.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from .. import vas as _vas
from ..head import AttributionHead
from ..features import FEATURE_SETS, feature_blocks
from . import backend
from .capture import capturing
from .forward_vas import WRITES, ForwardVAS
from .families import ImageTokens, family_of
from .generation import Generation, check_generate_kwargs, check_head, head_device
from .mask_log import MaskLog
from .masks import MaskCall
from .phase import Phase
from .regions import Regions, grid_regions, region_ids as _region_ids
from .rows import SpanRows
from .stream import Span, iterate_spans, sentence_end
from .structure import softmax_attention_layers
from .value_norm import LayerFactors

# the attention call compares by identity (an enum's hash runs Python code)
_DECODE, _PREFILL, _VAS, _ANSWER = Phase.DECODE, Phase.PREFILL, Phase.VAS, Phase.ANSWER


class Tracer(backend.Binding):
    """VAS features and span attribution of a transformers VLM while it runs.

        with Tracer(model, regions=8, vas=True, head=head, tokenizer=tok) as tr:
            logits = model(**inputs).logits      # unchanged by the tracer
            tr.vas_features()                    # (B, 36), columns VAS_COLUMNS
            for span in tr.generate(**inputs, max_new_tokens=64):
                span.features, span.scores, span.text

    ``regions``: an int K (Ward regions of each image's own token embeddings, the vision
    tower's output after its merger/projector, on its token grid), an int64 tensor of M
    labels in ``[0, K)`` for an image's M tokens (row-major), or a callable
    ``(features (M, C), (rows, cols)) -> labels (M,)``; None: no attribution. ``head``:
    an :class:`~headscope.AttributionHead` (or any callable ``(K, L*H) -> (K,)``) giving
    ``span.scores``. ``writes``: ``"heads"`` (each head's attention output, the head
    writes of the VAS reference implementation, docs/vas.md) or ``"residual"`` (the
    head's write into the residual stream, through its block of ``o_proj``).
    ``splitter``: a callable that gets a row's generated ids so far and says whether the
    last one ends a span (default: sentence ends, given a tokenizer; else one span per
    answer). ``features``: what a span's features hold (see docs/hf.md; default: the
    head's own ``feature_set``, else ``"attention"``):
    ``"attention"`` (``(K, L*H)``, the attention mass on each region),
    ``"attention*value_norm"`` (``(K, L*H)``, each prompt key's attention weight times its
    value norm ``||v_j W_O^h||``) or ``"both"`` (``(K, 2*L*H)``: the attention columns,
    then the weighted ones); column ``l*H + h`` within a block.
    """

    who = "headscope.hf.Tracer"

    def __init__(self, model, regions: Optional[Regions] = None, vas: bool = True,
                 head: Optional[Callable] = None, tokenizer=None, *, writes: str = "heads",
                 splitter: Optional[Callable[[Sequence[int]], bool]] = None,
                 features: Optional[str] = None):
        if features is None:  # the head's own feature set, or plain attention without one
            features = head.feature_set if isinstance(head, AttributionHead) else "attention"
        if writes not in WRITES:
            raise ValueError(f"headscope.hf.Tracer: argument 'writes' must be one of "
                             f"{tuple(WRITES)}, got {writes!r}")
        if not isinstance(features, str) or features not in FEATURE_SETS:
            raise ValueError(f"headscope.hf.Tracer: argument 'features' must be one of "
                             f"{', '.join(map(repr, FEATURE_SETS))}, got {features!r}")
        if regions is not None and not (isinstance(regions, (int, torch.Tensor))
                                        or callable(regions)) or isinstance(regions, bool):
            raise TypeError(f"headscope.hf.Tracer: argument 'regions' must be an int, an int64 "
                            f"tensor of labels or a callable, got {type(regions).__name__}")
        if isinstance(regions, int) and regions < 1:
            raise ValueError(f"headscope.hf.Tracer: argument 'regions' must be a number of "
                             f"regions >= 1 per image, got {regions}")
        self.model = model
        self.family = family_of(model, self.who)
        self.decoder = self.family.decoder(model)
        self.config = self.decoder.config
        self.num_heads = int(self.config.num_attention_heads)
        attention = softmax_attention_layers(self.decoder)
        if not attention:
            raise ValueError(f"headscope.hf.Tracer: {type(self.decoder).__name__} has no softmax "
                             f"attention layer (no decoder module dispatches through "
                             f"transformers' attention interface); headscope reads attention "
                             f"weights, which its mixers do not form")
        # the decoder layer index of each traced layer: all of them, or a hybrid decoder's
        # softmax layers only (its other mixers form no attention weights)
        self.layers: List[int] = [m.layer_idx for m in attention]
        self.num_layers = len(attention)
        self._layers = {id(m): i for i, m in enumerate(attention)}  # module -> traced layer
        if isinstance(regions, grid_regions) and not self.family.has_layout:
            raise ValueError(f"headscope.hf.Tracer: grid_regions needs each image token's place "
                             f"on the picture, and no layout is known for model_type "
                             f"{self.model.config.model_type!r} (read by its structure: each "
                             f"run of image tokens is one picture in sequence order); use "
                             f"regions=K (Ward regions of each run) or labels")
        L, H = self.num_layers, self.num_heads
        if isinstance(head, AttributionHead) and (head.num_layers, head.num_heads) != (L, H):
            raise ValueError(f"headscope.hf.Tracer: the head was fitted for L={head.num_layers}, "
                             f"H={head.num_heads}; this model has L={L}, H={H}")
        if isinstance(head, AttributionHead) and head.feature_set != features:
            raise ValueError(f"headscope.hf.Tracer: the head was fitted on feature set "
                             f"{head.feature_set!r} but features={features!r} was passed; "
                             f"leave 'features' out (the head's own set) or pass a head "
                             f"fitted on {features!r} features")
        self.features = features
        self.feature_width = feature_blocks(features) * L * H
        self.regions, self.vas, self.head, self.tokenizer = regions, bool(vas), head, tokenizer
        self.writes = writes
        self.splitter = splitter if splitter is not None else (
            sentence_end(tokenizer) if tokenizer is not None else None)
        check_head(head, features, self.feature_width, head_device(head, model))
        self._bound = False
        self._phase = Phase.READY  # what a forward outside a generation computes
        self.generation: Optional[Generation] = None  # the last generate's
        self._running: Optional[Generation] = None  # the generation running now, if any
        self.images: Optional[List[List[ImageTokens]]] = None
        self.num_regions: Optional[List[int]] = None
        self._region_ids: Optional[torch.Tensor] = None  # the last prompt's (B, T)
        # each layer's transformers layer type (None: every layer takes the one mask built)
        types = getattr(self.config, "layer_types", None)
        self._masks = MaskLog([types[i] for i in self.layers] if types else None)
        self._noted: Dict[str, Any] = {}  # the last forward's (or generate's) arguments
        self._factors = LayerFactors(self.num_heads)
        self._vas = ForwardVAS(self.num_layers, writes, self._factors)
        self._model_hook = None
        self.attach()

    @property
    def phase(self) -> Phase:
        """What the model's calls compute now (the running generation's phase while one
        runs)."""
        if not self._bound:
            return Phase.DETACHED
        running = self._running
        return running.phase if running is not None else self._phase

    @property
    def attached(self) -> bool:
        return self._bound

    @property
    def region_ids(self) -> Optional[torch.Tensor]:
        """(B, T) int64 region ids of the last prompt's positions, -1 off the images."""
        return self._region_ids

    @property
    def rows(self) -> Optional[SpanRows]:
        """The running generation's query rows (None outside a generation)."""
        return self._running.rows if self._running is not None else None

    @property
    def sequences(self) -> Optional[torch.Tensor]:
        """The output of the last ``generate``, once it has finished."""
        return self.generation.sequences if self.generation is not None else None

    # ---- attaching ----------------------------------------------------------------------

    def attach(self) -> "Tracer":
        if self._bound:
            return self
        self.bind(self.config)
        if self._running is None:  # generate keeps the model hook off while it runs
            self._model_hook = self._hook_model()
        self._decoder_hook = self.decoder.register_forward_pre_hook(self._on_decoder_forward,
                                                                    with_kwargs=True)
        self._bound = True
        self._phase = Phase.READY
        return self

    def _hook_model(self):
        return self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True)

    def detach(self) -> None:
        """Puts the model back as it was: its attention implementation, no hooks."""
        if not self._bound:
            return
        if self._model_hook is not None:
            self._model_hook.remove()
            self._model_hook = None
        self._decoder_hook.remove()
        self.unbind(self.config)
        self._bound = False

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # ---- the model's calls --------------------------------------------------------------

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        base = self._base_attention or self.base_attention(module)
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        running = self._running
        if running is not None:
            phase = running.phase
            if phase is _DECODE:  # inline: the only work of a decode step, once per layer
                layer = self._layers[id(module)]
                mask = self._masks.of_layer(layer)
                if mask is None or mask.pattern is None or key.shape[2] != mask.kv_length \
                        or query.shape[2] != 1:
                    mask = self._check_decode_step(layer, query, key, kwargs)
                running.rows.add(layer, query, key, mask)
            elif phase is _PREFILL:
                self._prefill(running.rows, module, query, key, value, kwargs)
        elif self._phase is _VAS or self._phase is _ANSWER:
            self._observe(module, query, key, out, weights, kwargs)
        return out, weights

    def mask(self, *args, **kwargs):
        if capturing(self.model):  # the capture's forward stops before the decoder
            return self.base_mask(*args, **kwargs)
        self._masks.note(kwargs)
        built = self.base_mask(*args, **kwargs)
        self._masks.built(built)
        return built

    def _on_model_forward(self, module, args, kwargs):
        if capturing(self.model):
            return None
        self._note(kwargs, args)
        if any(key in kwargs for key in self.family.layout_keys):
            return args, self.family.model_inputs(kwargs)
        return None

    def _note(self, kwargs, args=()) -> None:
        """A forward's (or generate's) arguments: the family reads the pictures' layout
        from them when the decoder's forward starts."""
        if args and "input_ids" not in kwargs:
            kwargs = dict(kwargs, input_ids=args[0])
        self._noted = kwargs

    def _on_decoder_forward(self, module, args, kwargs):
        """Starts a forward: its masks, and what it computes (a forward without a cache:
        region ids, and VAS or, in generate, the rows)."""
        if capturing(self.model):
            return None
        running = self._running
        if running is not None and (running.phase is Phase.PAUSED
                                    or threading.get_ident() != running.thread):
            raise RuntimeError("headscope.hf.Tracer: the model was called while a generation "
                               "of this tracer is running on it (from another thread, or while "
                               "it is paused at a span); finish or close that generation first")
        self._masks.start_forward(kwargs.get("attention_mask"))
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        if past == 0:
            embeds = kwargs.get("inputs_embeds")
            if embeds is None:
                ids = kwargs.get("input_ids", args[0] if args else None)
                embeds = module.get_input_embeddings()(ids)
            answer = running is None and self._phase is Phase.ANSWER
            self._start_forward(embeds, with_regions=not answer)
            if running is not None:
                running.begin_prompt(self._region_ids if self.regions is not None else None,
                                     self.num_regions)
            elif not answer:
                self._phase = Phase.VAS if self.vas else Phase.READY
        elif running is not None:
            running.begin_step()
        elif self._phase is Phase.VAS:
            self._phase = Phase.READY  # a forward on a cache: nothing to compute

    def _start_forward(self, embeds: torch.Tensor, with_regions: bool) -> None:
        """A forward without a cache: the VAS statistics start over; the prompt's region
        ids (``with_regions``, given regions), from the pictures the family reads."""
        B, T = embeds.shape[:2]
        self._vas.start()
        if not with_regions or self.regions is None:
            return
        ids = self._noted.get("input_ids")
        if ids is None or tuple(ids.shape) != (B, T):
            raise ValueError("headscope.hf.Tracer: regions need the model's input_ids "
                             f"(B, T) = ({B}, {T}) to find the image tokens")
        self.images = self.family.images(self.model.config,
                                         self.family.layout_inputs(self.model, self._noted))
        self._region_ids, self.num_regions = _region_ids(self.regions, self.images, embeds)

    def _prefill(self, rows: SpanRows, module, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, kwargs) -> None:
        """A layer's call in generate's first forward: its last query row to the rows."""
        layer = self._layers[id(module)]
        mask = self._masks.checked(layer, kwargs, k)
        factors = self._factors.of(layer, module) if rows.weighted else None
        rows.start(layer, q, k, v, _scale(kwargs, q), mask, kwargs.get("softcap"), factors)

    def _observe(self, module, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor,
                 weights: Optional[torch.Tensor], kwargs) -> None:
        """A layer's call in a forward that computes VAS."""
        layer = self._layers[id(module)]
        mask = self._masks.checked(layer, kwargs, k)
        if not mask.full:
            return
        if q.shape[2] != k.shape[2]:
            raise NotImplementedError(
                f"headscope.hf.Tracer: decoder layer {self.layers[layer]} ran "
                f"{q.shape[2]} of the sequence's {k.shape[2]} query rows (a model that "
                f"skips rows with an int logits_to_keep, as Gemma 4's KV-shared layers "
                f"do); VAS needs every row: call the model without logits_to_keep")
        self._vas.add(layer, module, q, k, out, weights, mask, _scale(kwargs, q),
                      kwargs.get("softcap"))

    def _check_decode_step(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                           kwargs) -> MaskCall:
        """The layer's mask of a decode step; raises for one that does not fit (the
        prefill checked the rest)."""
        mask = self._masks.checked(layer, kwargs, k)
        if q.shape[2] != 1:
            raise NotImplementedError(f"headscope.hf.Tracer: a decode step ran {q.shape[2]} "
                                      f"query rows; one token per step is supported")
        return mask

    # ---- results ------------------------------------------------------------------------

    def vas_head_stats(self) -> torch.Tensor:
        """(B, L, H, 3) per-head (d, c, r) of the last forward (after :meth:`generate`: of
        the whole final sequence)."""
        if not self.vas:
            raise RuntimeError("headscope.hf.Tracer: VAS is off (Tracer(..., vas=True))")
        answer = self.generation.answer if self.generation is not None else None
        if answer is not None and answer.pending:
            self._answer_pass()
        if not self._vas.complete:
            raise RuntimeError("headscope.hf.Tracer: no complete forward over a whole sequence "
                               "has run under this tracer yet (VAS needs one without a "
                               "key cache from earlier calls)")
        return self._vas.head_stats

    def vas_features(self) -> torch.Tensor:
        """(B, 36) float32 VAS features (columns ``headscope.VAS_COLUMNS``)."""
        return _vas.vas_aggregate(self.vas_head_stats())

    def answer_vas(self) -> torch.Tensor:
        """(B, 36) VAS features of the last :meth:`generate`'s prompt and whole answer:
        runs the forward over its final sequence at each call (:meth:`vas_features` after
        ``generate`` runs it once and keeps it)."""
        self._answer_pass()
        return self.vas_features()

    def forward_answer(self, inputs: Dict[str, torch.Tensor], answer_length: int
                       ) -> torch.Tensor:
        """One forward over a prompt and its answer under this tracer (attached for it):
        ``inputs`` the model inputs of both (``headscope.hf.answer.continue_inputs``), the
        answer their last ``answer_length`` positions. Every query row runs, so
        :meth:`vas_features` then gives the VAS of the whole sequence (no region ids are
        made). Returns the logits ``(B, answer_length, V)`` that predict the answer's
        tokens."""
        if not self.vas:
            raise RuntimeError("headscope.hf.Tracer: VAS is off (Tracer(..., vas=True))")
        was_attached = self.attached
        self.attach()
        self._phase = Phase.ANSWER
        try:
            with torch.no_grad():
                # the logits of the last prompt position and of each answer position, kept
                # by index: an int would let a model skip the other query rows of its
                # KV-shared layers (Gemma 4), which VAS needs
                T = inputs["input_ids"].shape[1]
                keep = torch.arange(T - answer_length - 1, T,
                                    device=inputs["input_ids"].device)
                logits = self.model(**inputs, use_cache=False, logits_to_keep=keep).logits
        finally:
            self._phase = Phase.READY
            if not was_attached:
                self.detach()
        return logits[:, :-1]

    def _answer_pass(self) -> None:
        """The forward over the final sequence of :meth:`generate` (prompt and answer);
        an answer the model cannot take back as input is refused here, not during
        generation, so that its spans and ``tr.sequences`` are kept."""
        if not self.vas:
            raise RuntimeError("headscope.hf.Tracer: VAS is off (Tracer(..., vas=True))")
        answer = self.generation.answer if self.generation is not None else None
        if answer is None:
            raise RuntimeError("headscope.hf.Tracer.answer_vas: no generate has finished "
                               "under this tracer")
        answer.pending = False
        self.family.check_answer(self.model.config,
                                 answer.inputs["input_ids"][:, answer.prompt_length:])
        self.forward_answer(answer.inputs, 0)

    # ---- generation ---------------------------------------------------------------------

    def generate(self, **kwargs) -> Iterator[Span]:
        """Runs ``model.generate(**kwargs)`` and yields each row's spans as they end, in
        order. The model runs on the caller's thread and pauses at each span while the loop
        body runs (no second thread). ``tr.sequences`` holds generate's output once the
        iterator is exhausted; leaving the loop early stops generation."""
        return self._spans(self._new_generation(kwargs))

    def _spans(self, generation: Generation) -> Iterator[Span]:
        with self._generating(generation):
            yield from iterate_spans(generation.run)

    def generate_with(self, on_span: Callable[[Span], None], **kwargs) -> torch.Tensor:
        """Runs ``model.generate(**kwargs)`` and calls ``on_span`` with each span, in order,
        as it ends (between two decode steps: generation waits for it); returns generate's
        output (also ``tr.sequences``). An exception in ``on_span`` stops generation and
        propagates."""
        generation = self._new_generation(kwargs)
        with self._generating(generation):
            return generation.run(on_span)

    def _new_generation(self, kwargs) -> Generation:
        check_generate_kwargs(self.model, kwargs)
        if not self.attached:
            raise RuntimeError("headscope.hf.Tracer.generate: the tracer is detached")
        if self.model.device.type == "mps":  # generate streams tokens a step late there
            raise NotImplementedError("headscope.hf.Tracer.generate: not supported on MPS")
        if self._running is not None:
            raise RuntimeError("headscope.hf.Tracer.generate: a generation is already running")
        return Generation(self.model, self.family, kwargs, splitter=self.splitter,
                          head=self.head, tokenizer=self.tokenizer, features=self.features,
                          num_layers=self.num_layers, num_heads=self.num_heads,
                          keep_answer=self.vas)

    @contextlib.contextmanager
    def _generating(self, generation: Generation):
        """``generation`` runs: each forward's work goes to it. What the model hook would
        note comes from generate's arguments (its forwards may not get them all: Qwen's get
        the vision output, not the grid); the hook is off meanwhile, so it costs nothing
        per step."""
        self._note(generation.kwargs)
        self._model_hook.remove()
        self._model_hook = None
        self.generation = self._running = generation
        try:
            yield
        finally:
            self._running = None
            if self._bound:  # (a span's consumer may have detached the tracer)
                self._phase = Phase.READY
                self._model_hook = self._hook_model()


def _scale(kwargs, q: torch.Tensor) -> float:
    """The attention call's softmax scale (default ``Dh ** -0.5``)."""
    scale = kwargs.get("scaling")
    return q.shape[-1] ** -0.5 if scale is None else float(scale)
