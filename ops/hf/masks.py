"""What the model's mask function was asked for: the attention pattern of a layer type,
read from the ``mask_function`` closure transformers composes (``masking_utils``), and the
sizes, offsets and padding of the call.

transformers builds each layer type's mask from a few index functions: causal, the
sliding-window and chunked overlays (ANDed), bidirectional blocks (``blockwise_overlay``,
ORed), composed with ``and_masks``/``or_masks``. :func:`read_pattern` walks that tree and
gives the q/k ops' arguments (``window``, ``chunk``, ``chunk_origin``, ``block_ids``,
``window_bounds_blocks``, docs/vas.md); anything else (a custom function, packed
sequences, a bidirectional decoder) is named in an error, never approximated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
from transformers import masking_utils as _mu


class UnsupportedPattern(NotImplementedError):
    pass


def _code(fn: Callable):
    return getattr(fn, "__code__", None)


_ONE = torch.zeros(1, 1, dtype=torch.int64)
_AND = _code(_mu.and_masks(_mu.causal_mask_function))
_OR = _code(_mu.or_masks(_mu.causal_mask_function))
_SLIDING = _code(_mu.sliding_window_overlay(1))
_CHUNKED = _code(_mu.chunked_overlay(1, _ONE))
_BLOCKS = _code(_mu.blockwise_overlay(_ONE))


def _cells(fn: Callable) -> Dict[str, Any]:
    return {name: cell.cell_contents
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


@dataclass
class Pattern:
    """Which keys a query sees, in the ops' terms. ``blocks`` ``(B, N)`` int64 is indexed
    by absolute position and ``left_padding`` ``(B,)`` (given with ``chunk``: where each
    row's chunk 0 starts) is an absolute position, as the closures hold them."""
    window: int = 0
    chunk: int = 0
    left_padding: Optional[torch.Tensor] = None
    blocks: Optional[torch.Tensor] = None
    window_bounds_blocks: bool = True

    @property
    def drops_keys(self) -> bool:
        """Whether a cache may drop keys an earlier query saw (sliding and chunked layers)."""
        return self.window > 0 or self.chunk > 0

    @property
    def kind(self) -> str:
        """The transformers layer type this pattern is the mask of."""
        return ("sliding_attention" if self.window else
                "chunked_attention" if self.chunk else "full_attention")

    def chunk_origin(self, start: int) -> Optional[torch.Tensor]:
        """(B,) int64: where each row's chunk 0 starts among keys from absolute position
        ``start`` on (negative once a cache has dropped the keys before it); None without
        chunks."""
        if not self.chunk:
            return None
        return self.left_padding.to(torch.int64).reshape(-1) - start

    def block_ids(self, start: int, length: int) -> Optional[torch.Tensor]:
        """(B, length) block ids of absolute key positions [start, start + length), -1
        past the ids transformers was given (generated tokens are in no block)."""
        if self.blocks is None:
            return None
        ids = self.blocks
        if ids.shape[1] < start + length:
            ids = torch.nn.functional.pad(ids, (0, start + length - ids.shape[1]), value=-1)
        return ids[:, start:start + length].to(torch.int64)


def mask_function(pattern: Pattern, batch: int) -> Callable:
    """The mask function transformers would compose for ``pattern`` over a batch of
    ``batch`` rows that share its blocks (one prompt's, expanded)."""
    fn = _mu.causal_mask_function
    blocks = None if pattern.blocks is None else \
        _mu.blockwise_overlay(pattern.blocks[:1].expand(batch, -1))
    if blocks is not None and pattern.window_bounds_blocks:
        fn = _mu.or_masks(fn, blocks)
    if pattern.window:
        fn = _mu.and_masks(fn, _mu.sliding_window_overlay(pattern.window))
    if pattern.chunk:
        fn = _mu.and_masks(fn, _mu.chunked_overlay(pattern.chunk, pattern.left_padding))
    if blocks is not None and not pattern.window_bounds_blocks:
        fn = _mu.or_masks(fn, blocks)
    return fn


def read_pattern(fn: Callable) -> Pattern:
    """The :class:`Pattern` of a mask function transformers composed; raises
    :class:`UnsupportedPattern` naming what it cannot express."""
    if fn is _mu.causal_mask_function:
        return Pattern()
    code = _code(fn)
    if code is _AND or code is _OR:
        base, window, chunk, left_padding, blocks = None, 0, 0, None, None
        for part in _cells(fn)["mask_functions"]:
            part_code = _code(part)
            if code is _AND and part_code is _SLIDING:
                window = _merge(window, int(_cells(part)["sliding_window"]), "sliding window")
            elif code is _AND and part_code is _CHUNKED:
                cells = _cells(part)
                chunk = _merge(chunk, int(cells["chunk_size"]), "chunk")
                left_padding = cells["left_padding"]
            elif code is _OR and part_code is _BLOCKS:
                if blocks is not None:
                    raise UnsupportedPattern("two sets of bidirectional blocks")
                blocks = _cells(part)["block_sequence_ids"]
            else:
                inner = read_pattern(part)  # names a function it does not know
                if base is not None:
                    raise UnsupportedPattern(f"{_name(fn)} of two attention patterns")
                base = inner
        if base is None:
            raise UnsupportedPattern(f"{_name(fn)} of overlays without a causal mask")
        if window:
            base.window = _merge(base.window, window, "sliding window")
        if chunk:
            base.chunk = _merge(base.chunk, chunk, "chunk")
            base.left_padding = left_padding
        if blocks is not None:
            if base.blocks is not None:
                raise UnsupportedPattern("two sets of bidirectional blocks")
            base.blocks = blocks
            # ORed after the window: a query sees its whole block (PaliGemma 2)
            base.window_bounds_blocks = not base.drops_keys
        return base
    raise UnsupportedPattern(f"the mask function {_name(fn)}")


def _merge(old: int, new: int, what: str) -> int:
    if old and old != new:
        raise UnsupportedPattern(f"two {what}s ({old} and {new})")
    return new


class MaskCall:
    """One call of the mask interface: the pattern of its layer type (None: not
    expressible, ``why`` says what), its sizes and offsets, and the padding keys."""

    def __init__(self, kwargs: Dict[str, Any]):
        self.q_length = int(kwargs["q_length"])
        self.kv_length = int(kwargs["kv_length"])
        self.q_offset = int(kwargs.get("q_offset", 0))
        self.kv_offset = int(kwargs.get("kv_offset", 0))
        self._attention_mask = kwargs.get("attention_mask")
        self._padding: Optional[torch.Tensor] = None
        self.lengths = self.offsets = None
        self.full = self.q_offset == 0 and self.kv_offset == 0 and \
            self.q_length == self.kv_length
        self.why = ""
        try:
            self.pattern: Optional[Pattern] = read_pattern(
                kwargs.get("mask_function", _mu.causal_mask_function))
            self._check_alignment()
        except UnsupportedPattern as e:
            self.pattern, self.why = None, str(e)
        self.plain = self.pattern is not None and not self.pattern.drops_keys \
            and self.pattern.blocks is None

    def _check_alignment(self) -> None:
        # the ops align queries with the last keys (bottom-right)
        if self.q_offset != self.kv_offset + self.kv_length - self.q_length:
            raise UnsupportedPattern(f"queries at {self.q_offset} not aligned with the last of "
                                     f"the keys [{self.kv_offset}, "
                                     f"{self.kv_offset + self.kv_length})")

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

    def op_pattern(self, softcap: Optional[float]) -> Dict[str, Any]:
        """The q/k ops' pattern arguments for this call's keys."""
        p = self.pattern
        return dict(window=p.window or None, chunk=p.chunk or None,
                    block_ids=p.block_ids(self.kv_offset, self.kv_length), softcap=softcap,
                    window_bounds_blocks=p.window_bounds_blocks,
                    chunk_origin=p.chunk_origin(self.kv_offset))

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
