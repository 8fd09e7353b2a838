"""The query rows of a generation, kept until each span ends and then pooled into the
span's region features (``Tracer.generate`` with regions). :class:`SpanRows` owns the
decode protocol; its generation (:class:`~headscope.hf.generation.Generation`) holds it,
and the tracer's hooks and the generation call it, in this order:

1. the prefill (generate's first forward), per layer: :meth:`SpanRows.start` with the
   layer's last query row, keys, mask and value cache;
2. each decode step: :meth:`SpanRows.begin_step` before the step's forward (the
   generation's, from the text decoder's forward hook), then :meth:`SpanRows.add` per layer with the step's query row
   and keys (from the attention call: the only work of a decode step);
3. a span ends (in the generation, generate's streamer, between two steps):
   :meth:`SpanRows.pool`.

Layers whose key cache keeps every key (full attention, bidirectional blocks) keep their
query rows and pool a span's rows in one ``region_pool_qk_layers`` call when it ends: with
one key added per step, the bottom-right aligned causal mask gives each row exactly the
keys it saw. Sliding-window and chunked layers' caches drop keys, so their rows are pooled
at each step against the keys that step saw (one call per step for all of them) into each
row's running sum.

Value-norm-weighted features (``Tracer(features=...)``) pool the same rows with each
prompt key's attention weight times its value norm ``||v_j W_O^h||`` (``key_weights``);
"both" pools every layer twice in the same call, once per block of columns.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..features import FEATURE_BLOCKS
from .masks import MaskCall
from .value_norm import value_norms


class KeyTable:
    """Per-key values ``(..., P)`` of a prompt's keys (region ids, padding, value norms),
    read over the first ``length`` keys of a key cache that grows during generation:
    generated keys get ``fill``. The tensor grows by at least 64 keys at a time, so a decode
    step rarely copies it."""

    def __init__(self, values: torch.Tensor, fill):
        self.values = values
        self.fill = fill
        self.prompt_length = values.shape[-1]

    @property
    def prompt(self) -> torch.Tensor:
        return self.values[..., :self.prompt_length]

    def upto(self, length: int) -> torch.Tensor:
        """The values of keys [0, length) (a view)."""
        if self.values.shape[-1] < length:
            grow = max(length - self.values.shape[-1], 64)
            self.values = torch.nn.functional.pad(self.values, (0, grow), value=self.fill)
        return self.values[..., :length]


class SpanRows:
    """Per layer, what the spans of a generation still need: the query rows (after
    rotary) of each step since the oldest open span began and the layer's keys of the last
    step (layers that keep every key), or each row's running sum of pooled attention since
    its span began (sliding-window and chunked layers). A span's features are pooled when
    it ends. At most :attr:`FOLD` rows per layer are held: past that, :meth:`begin_step`
    pools them into each open span's running sum, so a span that never ends (code, a list,
    a model that never ends a sentence) costs constant memory besides the key cache.

    ``region_ids``: the prompt's region ids (a :class:`KeyTable` of the generation's own,
    over the tracer's prompt ids, which it never writes to: growing makes a new tensor).
    The prompt's padding keys and each layer's value norms of its image keys are kept
    here, as key tables too."""

    FOLD = 256  # rows held per layer before they are pooled into running sums

    def __init__(self, num_layers: int, num_heads: int, region_ids: KeyTable, kmax: int,
                 feature_set: str = "attention"):
        self.num_heads = num_heads
        # per block of L*H columns: whether its keys are weighted by their value norms
        self.blocks: Tuple[bool, ...] = tuple(name == "attention*value_norm"
                                              for name in FEATURE_BLOCKS[feature_set])
        self.weighted = any(self.blocks)  # start needs the layer's value_norm_factors
        self.block_width = num_layers * num_heads
        self.width = len(self.blocks) * self.block_width
        self.region_ids = region_ids
        self.kmax = kmax
        # the layers that keep every key: their rows, last keys, scales, prefill mask
        self.queries: Dict[int, LayerRows] = {}
        self.keys: Dict[int, torch.Tensor] = {}
        self.scales: Dict[int, float] = {}
        self.held_mask: Optional[MaskCall] = None
        self.held_softcap: Optional[float] = None
        # The prompt's padding keys (B, P), None: none. generate extends the 2-D mask with
        # ones, so no generated key is ever padding.
        self.padding: Optional[KeyTable] = None
        self.stepped: Dict[str, _StepLayers] = {}  # mask kind -> its layers that drop keys
        # layer -> (B, H, P) value norms of the prompt's image keys, 0 elsewhere (the ops
        # read only image keys; generated keys are never image keys)
        self.norms: Dict[int, KeyTable] = {}
        self._image_keys = torch.nonzero((region_ids.prompt >= 0).any(0)).flatten() \
            if self.weighted else None
        self._unit: Optional[KeyTable] = None  # (B, 1, ·) ones: an unweighted block's
        self.running: Optional[torch.Tensor] = None  # (B, kmax, width) stepped layers' sums
        self.end = 1  # steps run (the prefill's last row is the first)
        self.first = 0  # step of the oldest row held
        self.open_from: List[Optional[int]] = [0] * region_ids.values.shape[0]  # None: done
        self.folded: Dict[int, torch.Tensor] = {}  # row -> sum over its folded rows
        self._ones: Dict[tuple, torch.Tensor] = {}  # (rows, steps) -> query weights

    # ---- the decode protocol, in call order ------------------------------------------------

    def start(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float, mask: MaskCall, softcap: Optional[float],
              factors: Optional[torch.Tensor] = None) -> None:
        """The prefill's call of one layer: its last query row (copied, so that the whole
        q is not kept alive), keys, scale, mask and soft cap; with :attr:`weighted`, the
        layer's ``value_norm_factors`` give the value norms of the prompt's image keys
        from the value cache ``v`` (B, Hkv, P, Dh)."""
        if self.weighted:
            norms = v.new_zeros(v.shape[0], self.num_heads, v.shape[2], dtype=factors.dtype)
            keys = self._image_keys.to(v.device)  # (a model split over devices)
            norms[:, :, keys] = value_norms(v[:, :, keys], factors)
            self.norms[layer] = KeyTable(norms, 0.0)
        row = q[:, :, -1:]
        if mask.pattern.drops_keys:
            group = self.stepped.setdefault(mask.pattern.kind, _StepLayers())
            group.layers.append(layer)
            group.scales[layer] = scale
            group.softcap = _same_softcap(group.softcap, softcap, len(group.layers))
            self.add(layer, row, k, mask)
            return
        self.queries[layer] = LayerRows()
        self.queries[layer].append(row.clone())
        self.keys[layer] = k
        self.scales[layer] = scale
        self.held_softcap = _same_softcap(self.held_softcap, softcap, len(self.queries))
        self.held_mask = mask
        padding = mask.padding
        self.padding = KeyTable(padding, False) \
            if padding is not None and bool(padding.any()) else None

    def begin_step(self) -> None:
        """A decode step begins (before its forward): the last step's rows of the layers
        whose cache drops keys are pooled, the rows held are folded once there are
        :attr:`FOLD` of them, and the step is counted."""
        self._flush()
        if self.held_rows() >= self.FOLD:
            self._fold()  # between two steps: the last step's rows and keys are in
        self.end += 1

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor, mask: MaskCall) -> None:
        """The step's query row ``q`` (B, H, 1, D) and key cache ``k`` of one layer: kept
        (references, no computation); those of a layer whose cache drops keys wait for the
        next :meth:`begin_step` or :meth:`pool`."""
        if mask.pattern.drops_keys:
            group = self.stepped[mask.pattern.kind]
            group.q[layer], group.k[layer] = q, k
            group.mask = mask
        else:
            self.queries[layer].append(q)
            self.keys[layer] = k

    def pool(self, b: int, steps: int, finished: bool) -> torch.Tensor:
        """(kmax, width) float32 (column block*L*H + l*H + h): row b's last ``steps``
        query rows' pooled attention, averaged: the rows still held and the sum
        :meth:`_fold` kept of the older ones, and the running sums of the layers pooled at
        each step. ``finished``: the row generates no more."""
        self._flush()
        end = self.end
        if end - self.open_from[b] != steps:
            raise RuntimeError(f"headscope.hf.Tracer: row {b}'s span has {steps} tokens but "
                               f"{end - self.open_from[b]} forward steps ran since it began "
                               f"(one forward per generated token is required)")
        if self.running is not None:
            pooled = self.running[b] / steps
            self.running[b].zero_()
        else:
            pooled = None
        if self.queries:
            rows = end - max(self.open_from[b], self.first)
            held = self._mean_last(b, rows)
            folded = self.folded.pop(b, None)
            if folded is not None:
                held = (held * rows + folded) / steps
            if pooled is None and len(self.queries) * self.num_heads == self.block_width:
                pooled = held
            else:
                if pooled is None:
                    pooled = held.new_zeros(self.kmax, self.width)
                pooled[:, self._columns(sorted(self.queries), pooled.device)] = held
        self.open_from[b] = None if finished else end
        self._drop_before(min((s for s in self.open_from if s is not None), default=end))
        return pooled

    def held_rows(self) -> int:
        """Query rows held per layer that keeps every key (0 without such layers)."""
        return self.end - self.first if self.queries else 0

    # ---- pooling -----------------------------------------------------------------------

    def _flush(self) -> None:
        """Pools the current step's rows of the layers whose cache drops keys into each
        batch row's running sum (one call per mask kind)."""
        for group in self.stepped.values():
            if not group.q:
                continue
            if len(group.q) != len(group.layers):
                raise RuntimeError(f"headscope.hf.Tracer: a step ran layers "
                                   f"{sorted(group.q)} of {group.layers}")
            q = [group.q[layer] for layer in group.layers]
            k = [group.k[layer] for layer in group.layers]
            group.q.clear()
            group.k.clear()
            mask = group.mask
            B = q[0].shape[0]
            pattern = mask.op_pattern(group.softcap)
            end = mask.kv_offset + mask.kv_length
            region_ids = self.region_ids.upto(end)[:, mask.kv_offset:]
            q, k, key_weights = self._blocks_of(q, k, group.layers, slice(None),
                                                mask.kv_offset, end)
            pooled = torch.ops.headscope.region_pool_qk_layers(
                q, k, self._weights(B, 1, region_ids.device), region_ids, self.kmax,
                [group.scales[layer] for layer in group.layers] * len(self.blocks), True,
                mask.padding, "sum", [pattern["window"] or 0] * len(q),
                [pattern["chunk"] or 0] * len(q), pattern["block_ids"], group.softcap,
                pattern["window_bounds_blocks"], key_weights, pattern["chunk_origin"])
            if self.running is None:
                self.running = pooled.new_zeros(B, self.kmax, self.width)
            if group.columns is None:
                group.columns = self._columns(group.layers, pooled.device)
            self.running.index_add_(2, group.columns, pooled)

    def _fold(self) -> None:
        """Pools the rows held into each open span's running sum and drops them, so that a
        span that never ends holds at most :attr:`FOLD` rows per layer. Called between two
        steps: the rows are then the last ones before the keys of the last step, and the
        bottom-right aligned causal mask still gives each its own keys."""
        end = self.end
        for b, start in enumerate(self.open_from):
            if start is not None and end > max(start, self.first):
                rows = end - max(start, self.first)
                total = self._mean_last(b, rows) * rows
                self.folded[b] = total if b not in self.folded else self.folded[b] + total
        self._drop_before(end)

    def _mean_last(self, b: int, rows: int) -> torch.Tensor:
        """(kmax, blocks*Lh*H), the layers that keep every key in order, per block of
        :attr:`blocks`: the mean over row b's last ``rows`` query rows of their pooled
        attention (region_pool_qk normalises the query weights; ``rows`` >= 1: a fold
        leaves no open span without the row of its last step, which the next step's
        forward adds before the span can end)."""
        layers = sorted(self.queries)
        length = self.keys[layers[0]].shape[2]  # these layers' caches hold every position
        region_ids = self.region_ids.upto(length)[b:b + 1]
        one_row = len(self.open_from) == 1  # else row b is cut out of the batch
        padding = None if self.padding is None else self.padding.upto(length)[b:b + 1]
        pattern = self.held_mask.pattern
        block_ids = pattern.block_ids(0, length)
        if block_ids is not None:
            block_ids = block_ids[b:b + 1].to(region_ids.device)
        q = [self.queries[layer].last(rows) for layer in layers]
        k = [self.keys[layer] for layer in layers]
        if not one_row:
            q, k = [x[b:b + 1] for x in q], [x[b:b + 1] for x in k]
        q, k, key_weights = self._blocks_of(q, k, layers, slice(b, b + 1), 0, length)
        pooled = torch.ops.headscope.region_pool_qk_layers(
            q, k, self._weights(1, rows, region_ids.device), region_ids, self.kmax,
            [self.scales[layer] for layer in layers] * len(self.blocks), True, padding, "sum",
            None, None, block_ids, self.held_softcap, pattern.window_bounds_blocks,
            key_weights)
        return pooled[0]

    def _blocks_of(self, q: List[torch.Tensor], k: List[torch.Tensor], layers: List[int],
                   batch_rows: slice, start: int, end: int) -> tuple:
        """q, k and key_weights of one pooling call over keys [start, end) of ``layers``:
        the layers once per block of :attr:`blocks` (so the output's columns are block,
        layer, head), each weighted block with the layer's value norms, the others with
        ones (None when no block is weighted: the plain op)."""
        if not self.weighted:
            return q, k, None
        batch = q[0].shape[0]
        if self._unit is None:
            self._unit = KeyTable(q[0].new_ones(len(self.open_from), 1, end, dtype=torch.float32),
                                  1.0)
        key_weights = []
        for weighted in self.blocks:
            for layer in layers:
                if weighted:
                    key_weights.append(self.norms[layer].upto(end)[batch_rows, :, start:end])
                else:
                    key_weights.append(self._unit.upto(end)[:batch, :, start:end])
        return q * len(self.blocks), k * len(self.blocks), key_weights

    def _weights(self, batch: int, rows: int, device) -> torch.Tensor:
        weights = self._ones.get((batch, rows))
        if weights is None:
            weights = self._ones[batch, rows] = torch.ones(batch, rows, device=device)
        return weights

    def _columns(self, layers: List[int], device) -> torch.Tensor:
        """The feature columns of a pooling call's output over ``layers`` (block, layer,
        head), each block after the previous one's L*H columns."""
        H = self.num_heads
        return torch.tensor([block * self.block_width + layer * H + h
                             for block in range(len(self.blocks))
                             for layer in layers for h in range(H)], device=device)

    def _drop_before(self, step: int) -> None:
        if step > self.first:
            for rows in self.queries.values():
                rows.drop_first(step - self.first)
            self.first = step


class LayerRows:
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


class _StepLayers:
    """The layers of one mask kind whose cache drops keys: each one's query row and keys
    of the current step, pooled at the next :meth:`SpanRows.begin_step` or
    :meth:`SpanRows.pool`."""

    def __init__(self):
        self.layers: List[int] = []  # in call order, fixed by the prefill
        self.q: Dict[int, torch.Tensor] = {}
        self.k: Dict[int, torch.Tensor] = {}
        self.scales: Dict[int, float] = {}
        self.mask: Optional[MaskCall] = None  # of the current step
        self.softcap: Optional[float] = None
        self.columns: Optional[torch.Tensor] = None  # their columns l*H + h


def _same_softcap(old: Optional[float], new: Optional[float], count: int) -> Optional[float]:
    """The soft cap of layers pooled in one call: they must share it."""
    if count > 1 and old != new:
        raise NotImplementedError(f"headscope.hf.Tracer: layers of one mask pattern with "
                                  f"different soft caps ({old} and {new})")
    return new
