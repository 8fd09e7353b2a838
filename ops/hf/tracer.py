""":class:`Tracer`: VAS features and span-to-region attribution of a transformers VLM,
computed inside its attention calls while it runs, with no attention matrix stored.

Attaching sets the text decoder's attention implementation to ``"headscope"`` (see
``backend.py``), which runs the implementation the model was loaded with and hands each
layer's q (after rotary), key cache, mask and per-head outputs to this object; detaching
puts the original back. Only the text decoder is traced.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from transformers.masking_utils import causal_mask_function

from .. import attribution as _attr
from .. import vas as _vas
from . import backend
from .families import ImageTokens, family_of
from .regions import Regions, region_ids as _region_ids
from .stream import Span, SpanCutter, iterate_spans

_WRITES = ("heads", "residual")
_UNSUPPORTED_GENERATE = {"num_beams": 1, "num_return_sequences": 1, "assistant_model": None,
                         "prompt_lookup_num_tokens": None}


def sentence_end(tokenizer) -> Callable[[Sequence[int]], bool]:
    """The default splitter: a span ends after a token whose text ends with '.', '!' or
    '?', or holds a newline."""
    ends_text: Dict[int, bool] = {}  # per token id: decoding costs more than a step here

    def ends(ids: Sequence[int]) -> bool:
        last = ids[-1]
        if last not in ends_text:
            text = tokenizer.decode([last])
            ends_text[last] = "\n" in text or text.rstrip(" ").endswith((".", "!", "?"))
        return ends_text[last]
    return ends


class _Mask:
    """What the model's mask function was asked for in the current forward."""

    def __init__(self, kwargs: Dict[str, Any]):
        self.plain = kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        self.q_length = int(kwargs["q_length"])
        self.kv_length = int(kwargs["kv_length"])
        self.q_offset = int(kwargs.get("q_offset", 0))
        self.kv_offset = int(kwargs.get("kv_offset", 0))
        self._attention_mask = kwargs.get("attention_mask")
        self._padding: Optional[torch.Tensor] = None
        self.lengths = self.offsets = None
        self.full = self.q_offset == 0 and self.kv_offset == 0 and \
            self.q_length == self.kv_length

    @property
    def padding(self) -> Optional[torch.Tensor]:
        """(B, kv_length) True = padding key, None: no mask (made when first asked for: a
        decode step does not need it)."""
        mask = self._attention_mask
        if self._padding is None and mask is not None:
            keep = mask.to(torch.bool)
            end = self.kv_offset + self.kv_length
            if keep.shape[-1] < end:
                keep = torch.nn.functional.pad(keep, (0, end - keep.shape[-1]))
            self._padding = ~keep[:, self.kv_offset:end]
        return self._padding

    def window(self, batch: int, device) -> tuple:
        """VAS window per row of a full forward: (lengths, offsets); the kept tokens of
        each row must be one contiguous run."""
        if self.lengths is None:
            padding = self.padding
            if padding is None:
                self.lengths = torch.full((batch,), self.q_length, dtype=torch.int64)
                self.offsets = torch.zeros(batch, dtype=torch.int64)
            else:
                keep = ~padding.cpu()
                lengths = keep.sum(-1)
                first = torch.where(lengths > 0, keep.to(torch.int8).argmax(-1), 0)
                last = self.q_length - 1 - keep.flip(-1).to(torch.int8).argmax(-1)
                if bool(((last - first + 1 != lengths) & (lengths > 0)).any()):
                    raise ValueError("headscope.hf.Tracer: VAS needs each row's attention mask "
                                     "to keep one contiguous run of tokens (left or right "
                                     "padding), got holes")
                self.lengths, self.offsets = lengths.to(torch.int64), first.to(torch.int64)
            self.lengths = self.lengths.to(device)
            self.offsets = self.offsets.to(device)
        return self.lengths, self.offsets


class _LayerRows:
    """One layer's query rows, one per step, in a ``(B, H, capacity, D)`` buffer that
    doubles when full; the last few steps' rows wait as references and are copied in
    together, so a decode step only appends to a list. No small tensor outlives a few
    steps: long-lived small blocks between the key cache's ever larger reallocations
    fragment the allocator's heap, and the process then grows with the square of a long
    span."""

    _BATCH = 32  # rows copied in at once

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.count = 0  # rows in the buffer
        self.recent: List[torch.Tensor] = []

    def __len__(self) -> int:
        return self.count + len(self.recent)

    def append(self, row: torch.Tensor) -> None:
        self.recent.append(row)
        if len(self.recent) == self._BATCH:
            self._copy_in()

    def last(self, steps: int) -> torch.Tensor:
        """The last ``steps`` rows, ``(B, H, steps, D)`` (a view of the buffer)."""
        self._copy_in()
        return self.buffer[:, :, self.count - steps:self.count]

    def drop_first(self, rows: int) -> None:
        self._copy_in()
        if rows >= self.count:
            self.count = 0
        elif rows > 0:
            kept = self.buffer[:, :, rows:self.count].clone()
            self.count = kept.shape[2]
            self.buffer[:, :, :self.count] = kept

    def _copy_in(self) -> None:
        if not self.recent:
            return
        new = torch.cat(self.recent, dim=2) if len(self.recent) > 1 else self.recent[0]
        self.recent.clear()
        end = self.count + new.shape[2]
        if self.buffer is None or end > self.buffer.shape[2]:
            B, H, _, D = new.shape
            capacity = max(end, 2 * (0 if self.buffer is None else self.buffer.shape[2]), 64)
            grown = new.new_empty(B, H, capacity, D)
            if self.count:
                grown[:, :, :self.count] = self.buffer[:, :, :self.count]
            self.buffer = grown
        self.buffer[:, :, self.count:end] = new
        self.count = end


class _QueryRows:
    """Per layer, the query rows (after rotary) of each generation step since the oldest
    open span began, and the layer's keys of the last step. A span's features are pooled
    when it ends, by one ``region_pool_qk_layers`` call over its rows: with one key added
    per step, the bottom-right aligned causal mask lets each row see exactly the keys it
    saw when it ran. That is one call per span instead of one per layer and step, and
    nothing but references on the step itself. At most :attr:`FOLD` rows per layer are
    held: past that, :meth:`fold` pools them into each open span's running sum, so a span
    that never ends (code, a list, a model that never ends a sentence) costs constant
    memory besides the key cache."""

    FOLD = 256  # rows held per layer before they are pooled into running sums

    def __init__(self, num_layers: int, batch: int, region_ids: torch.Tensor, kmax: int):
        self.queries: List[_LayerRows] = [_LayerRows() for _ in range(num_layers)]
        self.keys: List[Optional[torch.Tensor]] = [None] * num_layers
        self.scales: List[float] = [1.0] * num_layers
        self.first = 0  # step of the oldest row held
        self.open_from: List[Optional[int]] = [0] * batch  # None: the row has finished
        self.region_ids = region_ids
        self.kmax = kmax
        # The prompt's padding keys (B, P), None: none. generate extends the 2-D mask with
        # ones, so no generated key is ever padding.
        self.padding: Optional[torch.Tensor] = None
        self._ones: Dict[int, torch.Tensor] = {}  # steps -> query weights (1, steps)
        self.folded: Dict[int, torch.Tensor] = {}  # row -> sum over its folded rows

    def start(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float,
              padding: Optional[torch.Tensor]) -> None:
        """The prefill's call of one layer: its last query row (copied, so that the whole
        q is not kept alive), keys, scale and the prompt's padding. Each decode step then
        appends its row to ``queries[layer]`` and sets ``keys[layer]``
        (``Tracer.attention``)."""
        self.queries[layer].append(q[:, :, -1:].clone())
        self.keys[layer] = k
        self.scales[layer] = scale
        self.padding = padding if padding is not None and bool(padding.any()) else None

    def pool(self, b: int, steps: int, finished: bool) -> torch.Tensor:
        """(kmax, L*H) float32 (column l*H + h): row b's last ``steps`` query rows' pooled
        attention, averaged: the rows still held and the sum :meth:`fold` kept of the
        older ones."""
        end = self.first + len(self.queries[0])
        if end - self.open_from[b] != steps:
            raise RuntimeError(f"headscope.hf.Tracer: row {b}'s span has {steps} tokens but "
                               f"{end - self.open_from[b]} forward steps ran since it began "
                               f"(one forward per generated token is required)")
        rows = end - max(self.open_from[b], self.first)
        pooled = self._mean_last(b, rows)
        folded = self.folded.pop(b, None)
        if folded is not None:
            pooled = (pooled * rows + folded) / steps
        self.open_from[b] = None if finished else end
        self._drop_before(min((s for s in self.open_from if s is not None), default=end))
        return pooled

    def fold(self) -> None:
        """Pools the rows held into each open span's running sum and drops them, so that a
        span that never ends holds at most :attr:`FOLD` rows per layer. Called between two
        steps: the rows are then the last ones before the keys of the last step, and the
        bottom-right aligned causal mask still gives each its own keys."""
        end = self.first + len(self.queries[0])
        for b, start in enumerate(self.open_from):
            if start is not None and end > max(start, self.first):
                rows = end - max(start, self.first)
                total = self._mean_last(b, rows) * rows
                self.folded[b] = total if b not in self.folded else self.folded[b] + total
        self._drop_before(end)

    def _mean_last(self, b: int, rows: int) -> torch.Tensor:
        """(kmax, L*H): the mean over row b's last ``rows`` query rows of their pooled
        attention (region_pool_qk normalises the query weights; ``rows`` >= 1: a fold leaves no open span without the row of its last
        step, which the next step's forward adds before the span can end)."""
        length = self.keys[0].shape[2]  # every layer's cache holds the same positions
        region_ids = self._region_ids(b, length)
        one_row = len(self.open_from) == 1  # else row b is cut out of the batch
        padding = self.padding
        if padding is not None:
            padding = torch.nn.functional.pad(padding[b:b + 1], (0, length - padding.shape[1]),
                                              value=False)
        weights = self._ones.get(rows)
        if weights is None:
            weights = self._ones[rows] = torch.ones(1, rows, device=region_ids.device)
        q = [held.last(rows) for held in self.queries]
        k = self.keys
        if not one_row:
            q, k = [x[b:b + 1] for x in q], [x[b:b + 1] for x in k]
        pooled = torch.ops.headscope.region_pool_qk_layers(q, k, weights, region_ids, self.kmax,
                                                           self.scales, True, padding)
        return pooled[0]

    def _region_ids(self, b: int, length: int) -> torch.Tensor:
        rid = self.region_ids
        if rid.shape[1] < length:  # generated tokens belong to no region
            rid = torch.nn.functional.pad(rid, (0, max(length - rid.shape[1], 64)), value=-1)
            self.region_ids = rid
        return rid[b:b + 1, :length]

    def _drop_before(self, step: int) -> None:
        if step > self.first:
            for rows in self.queries:
                rows.drop_first(step - self.first)
            self.first = step


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
    answer).
    """

    who = "headscope.hf.Tracer"

    def __init__(self, model, regions: Optional[Regions] = None, vas: bool = True,
                 head: Optional[Callable] = None, tokenizer=None, *, writes: str = "heads",
                 splitter: Optional[Callable[[Sequence[int]], bool]] = None):
        if writes not in _WRITES:
            raise ValueError(f"headscope.hf.Tracer: argument 'writes' must be one of {_WRITES}, "
                             f"got {writes!r}")
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
        self._mask: Optional[_Mask] = None
        self._mask_other: Optional[str] = None
        self._inputs: Dict[str, Any] = {}  # input_ids and the family's input_keys
        self._stats: Optional[torch.Tensor] = None
        self._seen: set = set()
        self._rows: Optional[_QueryRows] = None
        self._final: Optional[Dict[str, torch.Tensor]] = None
        self._R: Dict[int, torch.Tensor] = {}  # layer -> R^T per head (writes="residual")
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
            mask = self._mask
            if mask is None or key.shape[2] != mask.kv_length or query.shape[2] != 1:
                self._check_decode_step(module, query, key, kwargs)
            layer = self._layers[id(module)]
            self._rows.queries[layer].append(query)
            self._rows.keys[layer] = key
        elif self.observing:
            self.observe(module, query, key, out, weights, kwargs)
        return out, weights

    def mask(self, *args, **kwargs):
        mask = _Mask(kwargs)
        if mask.plain:
            self._mask = mask
        else:
            self._mask_other = getattr(kwargs.get("mask_function"), "__name__", "custom")
        return self.base_mask(*args, **kwargs)

    # ---- what the model shows us ----------------------------------------------------------

    def _on_model_forward(self, module, args, kwargs):
        self._note_inputs(kwargs, args)

    def _note_inputs(self, kwargs, args=()) -> None:
        self._inputs = {key: kwargs.get(key) for key in self.family.input_keys}
        self._inputs["input_ids"] = kwargs.get("input_ids", args[0] if args else None)

    def _on_decoder_forward(self, module, args, kwargs):
        if self._generating is not None and (threading.get_ident() != self._generating
                                             or self._paused):
            raise RuntimeError("headscope.hf.Tracer: the model was called while a generation "
                               "of this tracer is running on it (from another thread, or while "
                               "it is paused at a span); finish or close that generation first")
        self._mask, self._mask_other = None, None
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
        if self._decoding and len(self._rows.queries[0]) >= self._rows.FOLD:
            self._rows.fold()  # between two steps: the last step's rows and keys are in
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
            self._rows = _QueryRows(self.num_layers, B, self.region_ids, self._kmax)

    def observe(self, module, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor,
                weights: Optional[torch.Tensor], kwargs: Dict[str, Any]) -> None:
        layer = self._layers[id(module)]
        mask = self._checked_mask(module, kwargs, k)
        scale = kwargs.get("scaling")
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        if self._vas_now and mask.full:
            writes = out.transpose(1, 2)  # (B, H, T, Dh): the o_proj input, per head
            if self.writes == "residual":
                writes = torch.matmul(writes.float(), self._residual_factor(layer, module))
            lengths, offsets = mask.window(q.shape[0], q.device)
            if weights is not None:
                stats = _vas.vas_head_stats(weights, writes, lengths, offsets)
            else:
                stats = _vas.vas_head_stats_qk(q, k, writes, lengths, scale, True, offsets,
                                               mask.padding)
            if self._stats is None:
                self._stats = stats.new_zeros(q.shape[0], self.num_layers, stats.shape[1], 3)
            self._stats[:, layer] = stats
            self._seen.add(layer)
        if self._pool_now:
            self._rows.start(layer, q, k, scale, mask.padding)

    def _check_decode_step(self, module, q: torch.Tensor, k: torch.Tensor, kwargs) -> None:
        """Raises for a decode step that does not fit (the prefill checked the rest)."""
        self._checked_mask(module, kwargs, k)
        if q.shape[2] != 1:
            raise NotImplementedError(f"headscope.hf.Tracer: a decode step ran {q.shape[2]} "
                                      f"query rows; one token per step is supported")

    def _checked_mask(self, module, kwargs, k: torch.Tensor) -> _Mask:
        if getattr(module, "sliding_window", None) or kwargs.get("sliding_window"):
            raise NotImplementedError("headscope.hf.Tracer: sliding-window attention layers "
                                      "are not supported")
        for name in ("softcap", "s_aux"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"headscope.hf.Tracer: attention with {name!r} is "
                                          f"not supported")
        mask = self._mask
        if mask is None:
            why = (f"its mask pattern ({self._mask_other}) is not plain causal"
                   if self._mask_other else
                   "the model did not build its mask through transformers' mask interface "
                   "(was a prepared 4-D attention mask passed in?)")
            raise NotImplementedError(f"headscope.hf.Tracer: cannot trace this forward: {why}")
        if k.shape[2] != mask.kv_length:
            raise NotImplementedError(f"headscope.hf.Tracer: the key cache holds {k.shape[2]} "
                                      f"positions but the mask covers {mask.kv_length}")
        return mask

    def _residual_factor(self, layer: int, module) -> torch.Tensor:
        """R^T per head, where W_O^h = Q R: (O_h R^T)(O_h R^T)^T = O_h W_O^h^T W_O^h O_h^T."""
        if layer not in self._R:
            W = module.o_proj.weight.detach().float()  # (hidden, H * Dh)
            Dh = W.shape[1] // self.num_heads
            per_head = W.reshape(W.shape[0], self.num_heads, Dh).permute(1, 0, 2)
            R = torch.linalg.qr(per_head, mode="r").R  # (H, Dh, Dh)
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
        """One forward over the final sequence of :meth:`generate` (prompt and answer)."""
        final, self._final = self._final, None
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

    # ---- generation ---------------------------------------------------------------------

    def generate(self, **kwargs) -> Iterator[Span]:
        """Runs ``model.generate(**kwargs)`` and yields each row's spans as they end, in
        order. The model runs on the caller's thread and pauses at each span while the loop
        body runs (no second thread). ``tr.sequences`` holds generate's output once the
        iterator is exhausted; leaving the loop early stops generation."""
        self._check_generate(kwargs)
        return self._generate(kwargs)

    def generate_with(self, on_span: Callable[[Span], None], **kwargs) -> torch.Tensor:
        """Runs ``model.generate(**kwargs)`` and calls ``on_span`` with each span, in order,
        as it ends (between two decode steps: generation waits for it); returns generate's
        output (also ``tr.sequences``). An exception in ``on_span`` stops generation and
        propagates."""
        self._check_generate(kwargs)
        cutter, P, eos = self._start_generation(kwargs, on_span)
        sequences = self._run_generate(kwargs, cutter)
        self._end_generation(kwargs, sequences, P, eos)
        return sequences

    def _check_generate(self, kwargs) -> None:
        for name, allowed in _UNSUPPORTED_GENERATE.items():
            value = kwargs.get(name, getattr(self.model.generation_config, name, allowed))
            if value not in (allowed, None):
                raise NotImplementedError(f"headscope.hf.Tracer.generate: {name}={value!r} is "
                                          f"not supported (one sequence per prompt)")
        if not self._attached:
            raise RuntimeError("headscope.hf.Tracer.generate: the tracer is detached")
        if self.model.device.type == "mps":  # generate streams tokens a step late there
            raise NotImplementedError("headscope.hf.Tracer.generate: not supported on MPS")
        if self._generating is not None:
            raise RuntimeError("headscope.hf.Tracer.generate: a generation is already running")

    def _eos_ids(self, kwargs) -> List[int]:
        config = kwargs.get("generation_config") or self.model.generation_config
        # as generate: an eos_token_id argument, None included, overrides the config's
        eos = kwargs["eos_token_id"] if "eos_token_id" in kwargs else config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else
                                 eos if isinstance(eos, (list, tuple)) else [eos])]

    def _start_generation(self, kwargs, emit: Callable[[Span], None]) -> tuple:
        """The streamer that cuts spans and hands them to ``emit``, during which the model
        must not be called."""
        ids = kwargs.get("input_ids")
        if ids is None:
            raise ValueError("headscope.hf.Tracer.generate: pass the prompt's input_ids")
        B, P = ids.shape
        eos = self._eos_ids(kwargs)

        def paused_emit(span: Span) -> None:
            self._paused = True
            try:
                emit(span)
            finally:
                self._paused = False

        cutter = SpanCutter(self._make_span, paused_emit, B, self.splitter, eos,
                            inner=kwargs.pop("streamer", None))
        self.sequences, self._final = None, None
        self._head_device = self._find_head_device()
        return cutter, P, eos

    def _run_generate(self, kwargs, cutter) -> torch.Tensor:
        self._generating = threading.get_ident()
        self._mode = "generate"
        # What the model hook would note, from generate's inputs (its forwards may not get
        # them all: Qwen's get the vision output, not the grid); off for the generation, it
        # costs nothing per step.
        self._note_inputs(kwargs)
        self._model_hook.remove()
        try:
            with cutter.interrupts:
                return self.model.generate(**kwargs, streamer=cutter)
        finally:
            self._mode = "forward"
            self._rows = None
            self._decoding = False
            self._generating = None
            if self._attached:  # (a callback may have detached the tracer)
                self._model_hook = self._hook_model()

    def _end_generation(self, kwargs, sequences: torch.Tensor, P: int, eos: List[int]) -> None:
        self.sequences = sequences
        if self.vas:
            self._final = self._final_inputs(kwargs, sequences, P, eos)

    def _generate(self, kwargs) -> Iterator[Span]:
        def run(emit: Callable[[Span], None]) -> tuple:
            cutter, P, eos = self._start_generation(kwargs, emit)
            return self._run_generate(kwargs, cutter), P, eos

        sequences, P, eos = yield from iterate_spans(run)
        self._end_generation(kwargs, sequences, P, eos)

    def _make_span(self, b: int, start: int, token_ids: List[int], finished: bool) -> Span:
        """Row b's open span, on the generating thread: its pooled features (K_b, L*H), the
        head's scores and its text."""
        if self._rows is None:
            features = torch.zeros(0, self.num_layers * self.num_heads)
        else:
            features = self._rows.pool(b, len(token_ids), finished)
            features = features[:self.num_regions[b]]
        scores = None
        if self.head is not None and features.shape[0] > 0:
            scores = self.head(features.to(self._head_device)).float().cpu()
        text = self.tokenizer.decode(token_ids) if self.tokenizer is not None else None
        return Span(b, start, start + len(token_ids), torch.tensor(token_ids, dtype=torch.int64),
                    features.float().cpu(), scores, text)

    def _check_head(self, head) -> None:
        """A head must map a span's (K, L*H) features to (K,) scores: tried once here on
        zeros, so that a head that does not fit fails now, not inside generation."""
        if head is None:
            return
        if not callable(head):
            raise TypeError(f"headscope.hf.Tracer: argument 'head' must be an AttributionHead "
                            f"or a callable (K, L*H) -> (K,), got {type(head).__name__}")
        LH = self.num_layers * self.num_heads
        probe = torch.zeros(2, LH, device=self._find_head_device(head))
        try:
            with torch.no_grad():
                scores = head(probe)
        except Exception as e:
            raise ValueError(f"headscope.hf.Tracer: argument 'head' must map features (K, L*H = "
                             f"{LH}) to scores (K,); on (2, {LH}) zeros it raised "
                             f"{type(e).__name__}: {e}") from e
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (2,):
            raise ValueError(f"headscope.hf.Tracer: argument 'head' must map features (K, L*H = "
                             f"{LH}) to scores (K,); on (2, {LH}) zeros it returned "
                             + (f"shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor)
                                else type(scores).__name__))

    def _find_head_device(self, head=None):
        for t in getattr(head if head is not None else self.head, "parameters",
                         lambda: iter(()))():
            return t.device
        return self.model.device

    def _final_inputs(self, kwargs, sequences: torch.Tensor, P: int, eos: List[int]
                      ) -> Dict[str, torch.Tensor]:
        """The model inputs of the whole final sequence: the prompt's, with the answer's
        tokens up to each row's end-of-sequence token kept in the mask."""
        answer = sequences[:, P:]
        keep = torch.ones_like(answer, dtype=torch.bool)
        if eos and answer.shape[1] > 0:
            is_eos = torch.isin(answer, torch.tensor(eos, device=answer.device))
            after = (is_eos.to(torch.int64).cumsum(1) - is_eos.to(torch.int64)) > 0
            keep = ~after
        mask = kwargs.get("attention_mask")
        mask = torch.ones(sequences.shape[0], P, dtype=torch.int64, device=sequences.device) \
            if mask is None else mask
        final = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        final["input_ids"] = sequences
        final["attention_mask"] = torch.cat([mask, keep.to(mask.dtype)], 1)
        types = kwargs.get("mm_token_type_ids")
        if types is not None:
            final["mm_token_type_ids"] = torch.nn.functional.pad(types, (0, answer.shape[1]))
        return final
