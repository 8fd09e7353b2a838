""":class:`Tracer`: VAS features and span-to-region attribution of a transformers VLM,
computed inside its attention calls while it runs, with no attention matrix stored.

Attaching sets the text decoder's attention implementation to ``"headscope"`` (see
``backend.py``), which runs the implementation the model was loaded with and hands each
layer's q (after rotary), key cache, mask and per-head outputs to this object; detaching
puts the original back. Only the text decoder is traced.

A tracer's one state is its :class:`Phase`. It holds its generation as a component
(:class:`~headscope.hf.generation.Generation`: ``generate``, the spans, what a generation
leaves), and a generation's query rows as a :class:`~headscope.hf.rows.SpanRows`, which
owns the decode protocol (``rows.py`` reads it top to bottom): the decoder's forward hook
calls its ``begin_step``, each layer's attention call its ``add``, a span's end its
``pool``.
"""
from __future__ import annotations

import contextlib
import enum
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from .. import vas as _vas
from ..head import AttributionHead
from ..features import FEATURE_SETS, feature_blocks
from . import backend
from .families import ImageTokens, family_of
from .families.generic import picture_slots
from .generation import Generation, check_head, head_device, sentence_end
from .masks import MaskCall
from .regions import Regions, grid_regions, region_ids as _region_ids
from .rows import KeyTable, SpanRows
from .stream import Span, SpanCutter
from .structure import output_projection, softmax_attention_layers
from .value_norm import value_norm_factors

_WRITES = ("heads", "residual")


class Phase(enum.Enum):
    """What a tracer does with its model's calls. The decoder's forward hook moves it
    between READY and VAS, or, while a generation runs, between GENERATING, PREFILL and
    DECODE; the generation pauses it at each span."""
    DETACHED = "detached"  # not bound: the model runs as it was loaded
    READY = "ready"  # bound; a forward without a key cache computes VAS and region ids
    VAS = "vas"  # in such a forward (vas=True): each layer's VAS statistics
    ANSWER = "answer"  # the forward over generate's final sequence: VAS, no region ids
    GENERATING = "generating"  # generate runs; its forwards compute nothing (no regions)
    PREFILL = "prefill"  # generate's first forward: each layer's last query row to the rows
    DECODE = "decode"  # a decode step: each layer's query row and keys to the rows
    PAUSED = "paused"  # generate waits at a span for its consumer: the model must not run


_IN_GENERATION = frozenset({Phase.GENERATING, Phase.PREFILL, Phase.DECODE, Phase.PAUSED})
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
        if writes not in _WRITES:
            raise ValueError(f"headscope.hf.Tracer: argument 'writes' must be one of {_WRITES}, "
                             f"got {writes!r}")
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
        self._layers = {id(m): i for i, m in enumerate(attention)}
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
        self.phase = Phase.DETACHED
        self.generation = Generation(self, run_model=self._run_generate, paused=self._paused)
        self.images: Optional[List[List[ImageTokens]]] = None
        self.num_regions: Optional[List[int]] = None
        self.rows: Optional[SpanRows] = None  # the running generation's query rows
        self._region_ids: Optional[KeyTable] = None  # the last prompt's (shared with rows)
        # each layer's transformers layer type (None: every layer takes the one mask built)
        types = getattr(self.config, "layer_types", None)
        self._layer_types: Optional[List[str]] = [types[i] for i in self.layers] if types \
            else None
        self._masks: Dict[str, MaskCall] = {}  # this forward's masks by layer type
        self._unsupported: List[str] = []  # why each mask the ops cannot express is so
        self._built: set = set()  # ids of the masks those calls returned
        self._inputs: Dict[str, Any] = {}  # input_ids and the family's input_keys
        self._model_kwargs: Dict[str, Any] = {}  # all of them (a family with no layout)
        self._probing = False  # the model runs for picture_slots: the hooks stand aside
        self._stats: Optional[torch.Tensor] = None
        self._seen: set = set()
        self._factors: Dict[int, torch.Tensor] = {}  # layer -> value_norm_factors of o_proj
        self._R: Dict[int, torch.Tensor] = {}  # layer -> R^T per head (writes="residual")
        self._model_hook = None
        self.attach()

    @property
    def attached(self) -> bool:
        return self.phase is not Phase.DETACHED

    @property
    def region_ids(self) -> Optional[torch.Tensor]:
        """(B, T) int64 region ids of the last prompt's positions, -1 off the images."""
        return None if self._region_ids is None else self._region_ids.prompt

    @property
    def sequences(self) -> Optional[torch.Tensor]:
        """The output of the last ``generate``, once it has finished."""
        return self.generation.sequences

    # ---- attaching ----------------------------------------------------------------------

    def attach(self) -> "Tracer":
        if self.attached:
            return self
        self.bind(self.config)
        generating = self.generation.thread is not None  # (a span's consumer attaches)
        if not generating:  # generate keeps the model hook off while it runs
            self._model_hook = self._hook_model()
        self._decoder_hook = self.decoder.register_forward_pre_hook(self._on_decoder_forward,
                                                                    with_kwargs=True)
        self.phase = Phase.PAUSED if generating else Phase.READY
        return self

    def _hook_model(self):
        return self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True)

    def detach(self) -> None:
        """Puts the model back as it was: its attention implementation, no hooks."""
        if not self.attached:
            return
        if self._model_hook is not None:
            self._model_hook.remove()
            self._model_hook = None
        self._decoder_hook.remove()
        self.unbind(self.config)
        self.phase = Phase.DETACHED

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # ---- the model's calls --------------------------------------------------------------

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        base = self._base_attention or self.base_attention(module)
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        phase = self.phase
        if phase is _DECODE:  # inline: the only work of a decode step, once per layer
            layer = self._layers[id(module)]
            mask = self._masks.get(self._layer_types[layer] if self._layer_types else "")
            if mask is None or mask.pattern is None or key.shape[2] != mask.kv_length \
                    or query.shape[2] != 1:
                mask = self._check_decode_step(layer, module, query, key, kwargs)
            self.rows.add(layer, query, key, mask)
        elif phase is _VAS or phase is _PREFILL or phase is _ANSWER:
            self.observe(module, query, key, value, out, weights, kwargs)
        return out, weights

    def mask(self, *args, **kwargs):
        if self._probing:  # the probe's forward stops before the decoder: nothing to note
            return self.base_mask(*args, **kwargs)
        if not self._built:  # the first mask of a forward
            self._masks, self._unsupported = {}, []
        mask = MaskCall(kwargs)
        if mask.pattern is None:
            self._unsupported.append(mask.why)
        else:
            self._masks[mask.pattern.kind] = mask
            if not self._layer_types:
                self._masks[""] = mask
        built = self.base_mask(*args, **kwargs)
        self._built.add(id(built))
        return built

    def _on_model_forward(self, module, args, kwargs):
        if self._probing:
            return None
        self._note_inputs(kwargs, args)
        if any(key in kwargs for key in self.family.layout_keys):
            return args, self.family.model_inputs(kwargs)
        return None

    def _note_inputs(self, kwargs, args=()) -> None:
        self._inputs = {key: kwargs.get(key) for key in self.family.input_keys}
        self._inputs["input_ids"] = kwargs.get("input_ids", args[0] if args else None)
        if not self.family.has_layout:  # for the probe of picture_slots
            self._model_kwargs = {k: v for k, v in kwargs.items()
                                  if k not in ("cache", "past_key_values", "use_cache")}

    def _on_decoder_forward(self, module, args, kwargs):
        """Starts a forward: its masks, and the phase that says what it computes (a
        forward without a cache: region ids, and VAS or, in generate, the rows)."""
        if self._probing:
            return None
        phase = self.phase
        generating = phase in _IN_GENERATION
        if generating and (phase is Phase.PAUSED
                           or threading.get_ident() != self.generation.thread):
            raise RuntimeError("headscope.hf.Tracer: the model was called while a generation "
                               "of this tracer is running on it (from another thread, or while "
                               "it is paused at a span); finish or close that generation first")
        built = kwargs.get("attention_mask")
        # a VLM may build the decoder's masks before calling it (one, or a dict by layer type)
        built = built.values() if isinstance(built, dict) else [built]
        if not all(id(m) in self._built for m in built):
            self._masks, self._unsupported = {}, []
        self._built = set()
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        if past == 0:
            embeds = kwargs.get("inputs_embeds")
            if embeds is None:
                ids = kwargs.get("input_ids", args[0] if args else None)
                embeds = module.get_input_embeddings()(ids)
            self._start_forward(embeds, generating, with_regions=phase is not Phase.ANSWER)
            if generating:
                self.phase = Phase.PREFILL if self.rows is not None else Phase.GENERATING
            elif phase is not Phase.ANSWER:
                self.phase = Phase.VAS if self.vas else Phase.READY
        elif self.rows is not None and generating:
            self.rows.begin_step()
            self.phase = Phase.DECODE
        elif phase is Phase.VAS:
            self.phase = Phase.READY  # a forward on a cache: nothing to compute

    def _start_forward(self, embeds: torch.Tensor, generating: bool,
                       with_regions: bool) -> None:
        """A forward without a cache: the VAS statistics start over; the prompt's region
        ids (``with_regions``, given regions) and, in generate, the query rows."""
        B, T = embeds.shape[:2]
        self._stats, self._seen = None, set()
        self.rows = None
        if not with_regions or self.regions is None:
            return
        ids = self._inputs.get("input_ids")
        if ids is None or tuple(ids.shape) != (B, T):
            raise ValueError("headscope.hf.Tracer: regions need the model's input_ids "
                             f"(B, T) = ({B}, {T}) to find the image tokens")
        if not self.family.has_layout:
            self._inputs["picture_slots"] = self._picture_slots()
        self.images = self.family.images(self.model.config, self._inputs)
        region_ids, self.num_regions = _region_ids(self.regions, self.images, embeds)
        self._region_ids = KeyTable(region_ids, -1)
        kmax = max(self.num_regions)
        if generating and kmax > 0:
            self.rows = SpanRows(self.num_layers, self.num_heads, self._region_ids, kmax,
                                 self.features)

    def _picture_slots(self) -> torch.Tensor:
        """Which image placeholders hold a piece of the picture (generic reading)."""
        self._probing = True
        try:
            with torch.no_grad():
                return picture_slots(self.model, self._model_kwargs,
                                     self.family.image_token_ids(self.model.config))
        finally:
            self._probing = False

    def observe(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, weights: Optional[torch.Tensor],
                kwargs: Dict[str, Any]) -> None:
        """A layer's call in a forward that computes: the prefill's rows, or VAS."""
        layer = self._layers[id(module)]
        mask = self._checked_mask(layer, module, kwargs, k)
        scale = kwargs.get("scaling")
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        softcap = kwargs.get("softcap")
        if self.phase is _PREFILL:
            factors = self._factors_of(layer, module) if self.rows.weighted else None
            self.rows.start(layer, q, k, v, scale, mask, softcap, factors)
        elif mask.full:
            if q.shape[2] != k.shape[2]:
                raise NotImplementedError(
                    f"headscope.hf.Tracer: decoder layer {self.layers[layer]} ran "
                    f"{q.shape[2]} of the sequence's {k.shape[2]} query rows (a model that "
                    f"skips rows with an int logits_to_keep, as Gemma 4's KV-shared layers "
                    f"do); VAS needs every row: call the model without logits_to_keep")
            writes = out.transpose(1, 2)  # (B, H, T, Dh): the o_proj input, per head
            if self.writes == "residual":
                writes = torch.matmul(writes.float(), self._residual_factor(layer, module))
            lengths, offsets = mask.window(q.shape[0], q.device)
            if weights is not None:
                stats = _vas.vas_head_stats(weights, writes, lengths, offsets)
            else:
                stats = _vas.vas_head_stats_qk(q, k, writes, lengths, scale, True, offsets,
                                               mask.padding, **mask.op_pattern(softcap))
            if self._stats is None:
                self._stats = stats.new_zeros(q.shape[0], self.num_layers, stats.shape[1], 3)
            self._stats[:, layer] = stats
            self._seen.add(layer)

    def _factors_of(self, layer: int, module) -> torch.Tensor:
        """The layer's value_norm_factors (H, min(hidden, Dh), Dh), computed once from its
        o_proj."""
        if layer not in self._factors:
            self._factors[layer] = value_norm_factors(
                output_projection(module).weight.detach(), self.num_heads)
        return self._factors[layer]

    def _check_decode_step(self, layer: int, module, q: torch.Tensor, k: torch.Tensor,
                           kwargs) -> MaskCall:
        """The layer's mask of a decode step; raises for one that does not fit (the
        prefill checked the rest)."""
        mask = self._checked_mask(layer, module, kwargs, k)
        if q.shape[2] != 1:
            raise NotImplementedError(f"headscope.hf.Tracer: a decode step ran {q.shape[2]} "
                                      f"query rows; one token per step is supported")
        return mask

    def _checked_mask(self, layer: int, module, kwargs, k: torch.Tensor) -> MaskCall:
        """The mask of the layer's type in this forward, checked against the call."""
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError("headscope.hf.Tracer: attention with sinks ('s_aux') is "
                                      "not supported")
        layer_type = self._layer_types[layer] if self._layer_types else ""
        mask = self._masks.get(layer_type)
        if mask is None or (not self._layer_types and len(self._masks) > 2):
            if self._unsupported:
                why = "its attention pattern has " + "; ".join(self._unsupported)
            elif self._masks:
                why = (f"layer {layer} is a {layer_type or 'layer'} but this forward built "
                       f"masks for {sorted(k for k in self._masks if k)}")
            else:
                why = ("the model did not build its mask through transformers' mask interface "
                       "(was a prepared 4-D attention mask passed in?)")
            raise NotImplementedError(f"headscope.hf.Tracer: cannot trace this forward: {why}")
        window = kwargs.get("sliding_window")
        if window and window != mask.pattern.window:
            raise NotImplementedError(f"headscope.hf.Tracer: layer {layer} passes "
                                      f"sliding_window={window} to its attention but its mask "
                                      f"has window {mask.pattern.window}")
        if k.shape[2] != mask.kv_length:
            raise NotImplementedError(f"headscope.hf.Tracer: the key cache holds {k.shape[2]} "
                                      f"positions but the mask covers {mask.kv_length}")
        return mask

    def _residual_factor(self, layer: int, module) -> torch.Tensor:
        """R^T per head, where W_O^h = Q R: (O_h R^T)(O_h R^T)^T = O_h W_O^h^T W_O^h O_h^T."""
        if layer not in self._R:
            R = self._factors_of(layer, module).float()  # (H, Dh, Dh)
            self._R[layer] = R.transpose(-1, -2).unsqueeze(0)
        return self._R[layer]

    # ---- results ------------------------------------------------------------------------

    def vas_head_stats(self) -> torch.Tensor:
        """(B, L, H, 3) per-head (d, c, r) of the last forward (after :meth:`generate`: of
        the whole final sequence)."""
        if not self.vas:
            raise RuntimeError("headscope.hf.Tracer: VAS is off (Tracer(..., vas=True))")
        answer = self.generation.answer
        if answer is not None and answer.pending:
            self._answer_pass()
        if self._stats is None or len(self._seen) != self.num_layers:
            raise RuntimeError("headscope.hf.Tracer: no complete forward over a whole sequence "
                               "has run under this tracer yet (VAS needs one without a "
                               "key cache from earlier calls)")
        return self._stats

    def vas_features(self) -> torch.Tensor:
        """(B, 36) float32 VAS features (columns ``headscope.VAS_COLUMNS``)."""
        return _vas.vas_aggregate(self.vas_head_stats())

    def answer_vas(self) -> torch.Tensor:
        """(B, 36) VAS features of the last :meth:`generate`'s prompt and whole answer:
        runs the forward over its final sequence at each call (:meth:`vas_features` after
        ``generate`` runs it once and keeps it)."""
        self._answer_pass()
        return self.vas_features()

    def _answer_pass(self) -> None:
        """One forward over the final sequence of :meth:`generate` (prompt and answer);
        an answer the model cannot take back as input is refused here, not during
        generation, so that its spans and ``tr.sequences`` are kept."""
        if not self.vas:
            raise RuntimeError("headscope.hf.Tracer: VAS is off (Tracer(..., vas=True))")
        answer = self.generation.answer
        if answer is None:
            raise RuntimeError("headscope.hf.Tracer.answer_vas: no generate has finished "
                               "under this tracer")
        answer.pending = False
        self.family.check_answer(self.model.config,
                                 answer.inputs["input_ids"][:, answer.prompt_length:])
        was_attached = self.attached
        self.attach()
        self.phase = Phase.ANSWER
        try:
            with torch.no_grad():
                # the last position's logits only, as an index: an int would let a model
                # skip the other query rows of its KV-shared layers (Gemma 4)
                last = torch.tensor([answer.inputs["input_ids"].shape[1] - 1])
                self.model(**answer.inputs, use_cache=False, logits_to_keep=last)
        finally:
            self.phase = Phase.READY
            if not was_attached:
                self.detach()

    # ---- generation ---------------------------------------------------------------------

    def generate(self, **kwargs) -> Iterator[Span]:
        """Runs ``model.generate(**kwargs)`` and yields each row's spans as they end, in
        order. The model runs on the caller's thread and pauses at each span while the loop
        body runs (no second thread). ``tr.sequences`` holds generate's output once the
        iterator is exhausted; leaving the loop early stops generation."""
        return self.generation.spans(kwargs)

    def generate_with(self, on_span: Callable[[Span], None], **kwargs) -> torch.Tensor:
        """Runs ``model.generate(**kwargs)`` and calls ``on_span`` with each span, in order,
        as it ends (between two decode steps: generation waits for it); returns generate's
        output (also ``tr.sequences``). An exception in ``on_span`` stops generation and
        propagates."""
        return self.generation.run_with(on_span, kwargs)

    def _run_generate(self, kwargs, streamer: SpanCutter) -> torch.Tensor:
        """``model.generate`` in the generation phases (for :attr:`generation`). What the
        model hook would note comes from generate's inputs (its forwards may not get them
        all: Qwen's get the vision output, not the grid); the hook is off meanwhile, so it
        costs nothing per step."""
        self._note_inputs(kwargs)
        self._model_hook.remove()
        self._model_hook = None
        self.phase = Phase.GENERATING
        try:
            return self.model.generate(**self.family.model_inputs(kwargs), streamer=streamer)
        finally:
            self.rows = None
            if self.attached:  # (a span's consumer may have detached the tracer)
                self.phase = Phase.READY
                self._model_hook = self._hook_model()

    @contextlib.contextmanager
    def _paused(self):
        """The phase while a span's consumer runs (for :attr:`generation`)."""
        phase = self.phase
        if phase is not Phase.DETACHED:
            self.phase = Phase.PAUSED
        try:
            yield
        finally:
            if self.phase is Phase.PAUSED:  # (the consumer may have detached the tracer)
                self.phase = phase
