""":class:`Tracer`: VAS features and span-to-region attribution of a transformers VLM,
computed inside its attention calls while it runs, with no attention matrix stored.

Attaching sets the text decoder's attention implementation to ``"headscope"`` (see
``backend.py``), which runs the implementation the model was loaded with and hands each
layer's q (after rotary), key cache, mask and per-head outputs to this object; detaching
puts the original back. Only the text decoder is traced.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .. import attribution as _attr
from .. import features as _features
from .. import vas as _vas
from . import backend
from .families import ImageTokens, family_of
from .masks import MaskCall
from .regions import Regions, region_ids as _region_ids
from .rows import SpanRows
from .value_norm import value_norm_factors, value_norms
from .generation import Generation, sentence_end

_WRITES = ("heads", "residual")


class Tracer(Generation, backend.Binding):
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
    answer). ``features``: what a span's features hold (see docs/hf.md):
    ``"attention"`` (``(K, L*H)``, the attention mass on each region),
    ``"attention*value_norm"`` (``(K, L*H)``, each prompt key's attention weight times its
    value norm ``||v_j W_O^h||``) or ``"both"`` (``(K, 2*L*H)``: the attention columns,
    then the weighted ones); column ``l*H + h`` within a block.
    """

    who = "headscope.hf.Tracer"

    def __init__(self, model, regions: Optional[Regions] = None, vas: bool = True,
                 head: Optional[Callable] = None, tokenizer=None, *, writes: str = "heads",
                 splitter: Optional[Callable[[Sequence[int]], bool]] = None,
                 features: str = "attention"):
        if writes not in _WRITES:
            raise ValueError(f"headscope.hf.Tracer: argument 'writes' must be one of {_WRITES}, "
                             f"got {writes!r}")
        if not isinstance(features, str) or features not in _features.FEATURE_SETS:
            raise ValueError(f"headscope.hf.Tracer: argument 'features' must be one of "
                             f"{', '.join(map(repr, _features.FEATURE_SETS))}, got {features!r}")
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
        self.num_layers = int(self.config.num_hidden_layers)
        self.num_heads = int(self.config.num_attention_heads)
        self._layers = {id(m): m.layer_idx for m in self.decoder.modules()
                        if hasattr(m, "o_proj") and getattr(m, "layer_idx", None) is not None}
        if sorted(self._layers.values()) != list(range(self.num_layers)):
            raise ValueError(f"headscope.hf.Tracer: found attention layers "
                             f"{sorted(self._layers.values())} in {type(self.decoder).__name__}, "
                             f"expected 0..{self.num_layers - 1} (modules with o_proj and "
                             f"layer_idx)")
        L, H = self.num_layers, self.num_heads
        if isinstance(head, _attr.AttributionHead) and (head.num_layers, head.num_heads) != (L, H):
            raise ValueError(f"headscope.hf.Tracer: the head was fitted for L={head.num_layers}, "
                             f"H={head.num_heads}; this model has L={L}, H={H}")
        if isinstance(head, _attr.AttributionHead) and head.feature_set != features:
            raise ValueError(f"headscope.hf.Tracer: the head was fitted on feature set "
                             f"{head.feature_set!r} but this tracer computes "
                             f"features={features!r}; pass features={head.feature_set!r} "
                             f"or a head fitted on {features!r} features")
        self.features = features
        self.feature_width = _features.feature_blocks(features) * L * H
        self.regions, self.vas, self.head, self.tokenizer = regions, bool(vas), head, tokenizer
        self.writes = writes
        self.splitter = splitter if splitter is not None else (
            sentence_end(tokenizer) if tokenizer is not None else None)
        self._check_head(head)
        self.sequences: Optional[torch.Tensor] = None
        self.images: Optional[List[List[ImageTokens]]] = None
        self.region_ids: Optional[torch.Tensor] = None
        self.num_regions: Optional[List[int]] = None
        self.observing = False
        self._decoding = False  # a decode step of tr.generate with regions: keep q rows
        self._paused = False  # generation is paused at a span (its consumer runs)
        self._attached = False
        self._mode = "forward"
        self._generating: Optional[int] = None  # thread ident of a running tr.generate
        # each layer's transformers layer type (None: every layer takes the one mask built)
        types = getattr(self.config, "layer_types", None)
        self._layer_types: Optional[List[str]] = list(types) if types else None
        self._masks: Dict[str, MaskCall] = {}  # this forward's masks by layer type
        self._unsupported: List[str] = []  # why each mask the ops cannot express is so
        self._built: set = set()  # ids of the masks those calls returned
        self._inputs: Dict[str, Any] = {}  # input_ids and the family's input_keys
        self._stats: Optional[torch.Tensor] = None
        self._seen: set = set()
        self._rows: Optional[SpanRows] = None
        self._final: Optional[tuple] = None  # (final sequence's inputs, prompt length)
        self._factors: Dict[int, torch.Tensor] = {}  # layer -> value_norm_factors of o_proj
        self._R: Dict[int, torch.Tensor] = {}  # layer -> R^T per head (writes="residual")
        self._image_keys: Optional[torch.Tensor] = None  # prompt positions of image keys
        self._head_device = None
        self.attach()

    # ---- attaching ----------------------------------------------------------------------

    def attach(self) -> "Tracer":
        if self._attached:
            return self
        self.bind(self.config)
        self._model_hook = self._hook_model()
        self._decoder_hook = self.decoder.register_forward_pre_hook(self._on_decoder_forward,
                                                                    with_kwargs=True)
        self._attached = True
        return self

    def _hook_model(self):
        return self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True)

    def detach(self) -> None:
        """Puts the model back as it was: its attention implementation, no hooks."""
        if not self._attached:
            return
        self._model_hook.remove()
        self._decoder_hook.remove()
        self.unbind(self.config)
        self.observing = False
        self._decoding = False
        self._attached = False

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        base = self._base_attention or self.base_attention(module)
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        if self._decoding:  # inline: the only work of a decode step, once per layer
            layer = self._layers[id(module)]
            mask = self._masks.get(self._layer_types[layer] if self._layer_types else "")
            if mask is None or mask.pattern is None or key.shape[2] != mask.kv_length \
                    or query.shape[2] != 1:
                mask = self._check_decode_step(layer, module, query, key, kwargs)
            if mask.pattern.drops_keys:
                self._rows.step(layer, query, key, mask)
            else:
                self._rows.queries[layer].append(query)
                self._rows.keys[layer] = key
        elif self.observing:
            self.observe(module, query, key, value, out, weights, kwargs)
        return out, weights

    def mask(self, *args, **kwargs):
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

    # ---- what the model shows us ----------------------------------------------------------

    def _on_model_forward(self, module, args, kwargs):
        self._note_inputs(kwargs, args)
        if any(key in kwargs for key in self.family.layout_keys):
            return args, self.family.model_inputs(kwargs)
        return None

    def _note_inputs(self, kwargs, args=()) -> None:
        self._inputs = {key: kwargs.get(key) for key in self.family.input_keys}
        self._inputs["input_ids"] = kwargs.get("input_ids", args[0] if args else None)

    def _on_decoder_forward(self, module, args, kwargs):
        if self._generating is not None and (threading.get_ident() != self._generating
                                             or self._paused):
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
        generating = self._mode == "generate"
        pooling = generating and self.regions is not None
        if past == 0:
            embeds = kwargs.get("inputs_embeds")
            if embeds is None:
                ids = kwargs.get("input_ids", args[0] if args else None)
                embeds = module.get_input_embeddings()(ids)
            self._start_forward(embeds, pooling)
            self._vas_now = self.vas and not generating
        else:
            self._vas_now = False
        # _start_forward made the query rows exactly when there is something to pool
        self._pool_now = pooling and self._rows is not None
        self._decoding = self._pool_now and past > 0
        if self._decoding:
            self._rows.flush()  # the last step's rows of layers whose cache drops keys
            if self._rows.held_rows() >= self._rows.FOLD:
                self._rows.fold()  # between two steps: the last step's rows and keys are in
            self._rows.end += 1  # this step's rows come in its forward
        self.observing = self._vas_now or self._pool_now

    def _start_forward(self, embeds: torch.Tensor, pooling: bool) -> None:
        B, T = embeds.shape[:2]
        self._stats, self._seen = None, set()
        self._kmax = 0
        if self._mode != "vas" and self.regions is not None:
            ids = self._inputs.get("input_ids")
            if ids is None or tuple(ids.shape) != (B, T):
                raise ValueError("headscope.hf.Tracer: regions need the model's input_ids "
                                 f"(B, T) = ({B}, {T}) to find the image tokens")
            self.images = self.family.images(self.model.config, self._inputs)
            self.region_ids, self.num_regions = _region_ids(self.regions, self.images, embeds)
            self._kmax = max(self.num_regions)
        self._rows = None
        if pooling and self._kmax > 0:
            self._rows = SpanRows(self.num_layers, self.num_heads, B, self.region_ids,
                                  self._kmax, self.features)
            if any(self._rows.blocks):  # once per prompt: every layer's norms take them
                is_image = (self.region_ids >= 0).any(0)
                self._image_keys = torch.nonzero(is_image).flatten().to(embeds.device)

    def observe(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, weights: Optional[torch.Tensor],
                kwargs: Dict[str, Any]) -> None:
        layer = self._layers[id(module)]
        mask = self._checked_mask(layer, module, kwargs, k)
        scale = kwargs.get("scaling")
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        softcap = kwargs.get("softcap")
        if self._vas_now and mask.full:
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
        if self._pool_now:
            norms = self._prompt_value_norms(layer, module, v) if any(self._rows.blocks) \
                else None
            self._rows.start(layer, q, k, scale, mask, softcap, norms)

    def _prompt_value_norms(self, layer: int, module, v: torch.Tensor) -> torch.Tensor:
        """(B, H, P) value norms ``||v_j W_O^h||`` of the prompt's image keys from the
        prefill's value cache ``v`` (B, Hkv, P, Dh); 0 at the other keys, which the ops
        never read."""
        factors = self._factors_of(layer, module)
        norms = v.new_zeros(v.shape[0], self.num_heads, v.shape[2], dtype=factors.dtype)
        keys = self._image_keys.to(v.device)  # (a model split over devices)
        norms[:, :, keys] = value_norms(v[:, :, keys], factors)
        return norms

    def _factors_of(self, layer: int, module) -> torch.Tensor:
        """The layer's value_norm_factors (H, min(hidden, Dh), Dh), computed once from its
        o_proj."""
        if layer not in self._factors:
            self._factors[layer] = value_norm_factors(module.o_proj.weight.detach(),
                                                      self.num_heads)
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
        if self._final is not None:
            self._vas_pass()
        if self._stats is None or len(self._seen) != self.num_layers:
            raise RuntimeError("headscope.hf.Tracer: no complete forward over a whole sequence "
                               "has run under this tracer yet (VAS needs one without a "
                               "key cache from earlier calls)")
        return self._stats

    def vas_features(self) -> torch.Tensor:
        """(B, 36) float32 VAS features (columns ``headscope.VAS_COLUMNS``)."""
        return _vas.vas_aggregate(self.vas_head_stats())

    def _vas_pass(self) -> None:
        """One forward over the final sequence of :meth:`generate` (prompt and answer);
        an answer the model cannot take back as input is refused here, not during
        generation, so that its spans and ``tr.sequences`` are kept."""
        (final, P), self._final = self._final, None
        self.family.check_answer(self.model.config, final["input_ids"][:, P:])
        was_attached = self._attached
        self.attach()
        self._mode = "vas"
        try:
            with torch.no_grad():
                self.model(**final, use_cache=False, logits_to_keep=1)
        finally:
            self._mode = "forward"
            if not was_attached:
                self.detach()
