"""The masks one forward of the text decoder asked transformers' mask interface for, by
layer type (:class:`MaskLog`): each traced layer's attention call is checked against the
mask of its type and reads its attention pattern from it."""
from __future__ import annotations

from typing import Dict, List, Optional

from .masks import MaskCall


class MaskLog:
    """This forward's :class:`~headscope.hf.masks.MaskCall` per layer type. ``layer_types``:
    each traced layer's transformers layer type; None: every layer takes the one mask
    built (it is then logged under ``""`` too)."""

    def __init__(self, layer_types: Optional[List[str]]):
        self.layer_types = layer_types
        self.masks: Dict[str, MaskCall] = {}
        self.unsupported: List[str] = []  # why each mask the ops cannot express is so
        self._built: set = set()  # ids of the masks this forward's calls returned

    def note(self, kwargs) -> None:
        """A call of the mask interface, before the mask is built (its ``kwargs``)."""
        if not self._built:  # the first mask of a forward
            self.masks, self.unsupported = {}, []
        mask = MaskCall(kwargs)
        if mask.pattern is None:
            self.unsupported.append(mask.why)
        else:
            self.masks[mask.pattern.kind] = mask
            if not self.layer_types:
                self.masks[""] = mask

    def built(self, mask) -> None:
        """The mask the noted call returned."""
        self._built.add(id(mask))

    def start_forward(self, attention_mask) -> None:
        """The decoder's forward begins with ``attention_mask``: the masks noted stay if the
        VLM built them before calling the decoder (one, or a dict by layer type), else the
        decoder builds its own."""
        built = attention_mask.values() if isinstance(attention_mask, dict) else [attention_mask]
        if not all(id(m) in self._built for m in built):
            self.masks, self.unsupported = {}, []
        self._built = set()

    def of_layer(self, layer: int) -> Optional[MaskCall]:
        """The mask of traced layer ``layer``'s type, unchecked (None: none built)."""
        return self.masks.get(self.layer_types[layer] if self.layer_types else "")

    def checked(self, layer: int, kwargs, k) -> MaskCall:
        """The mask of traced layer ``layer``'s type in this forward, checked against its
        attention call (``kwargs``, key cache ``k``)."""
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError("headscope.hf.Tracer: attention with sinks ('s_aux') is "
                                      "not supported")
        layer_type = self.layer_types[layer] if self.layer_types else ""
        mask = self.masks.get(layer_type)
        if mask is None or (not self.layer_types and len(self.masks) > 2):
            if self.unsupported:
                why = "its attention pattern has " + "; ".join(self.unsupported)
            elif self.masks:
                why = (f"layer {layer} is a {layer_type or 'layer'} but this forward built "
                       f"masks for {sorted(k for k in self.masks if k)}")
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
