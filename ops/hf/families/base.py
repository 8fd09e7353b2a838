"""The interface every family module implements (one module per family of VLMs)."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

import torch

from .layout import ImageTokens

# The per-position type inputs processors give (image or text per token; ERNIE 4.5-VL's
# moe_mm_token_type_ids also mark the picture's markers): a generated answer continues
# each with the family's answer_type
TYPE_INPUTS = ("mm_token_type_ids", "moe_mm_token_type_ids", "token_type_ids")


class Family:
    """How headscope reads one family of transformers VLMs: where its text decoder is,
    which tokens are image tokens, and where each lies on its picture. The Tracer,
    ``region_effects`` and the commands ask the family and know no family by name.

    A subclass sets :attr:`name`, :attr:`titles`, :attr:`model_types` (the
    ``config.model_type`` values it reads), :attr:`layout` (one line for the families
    table), :attr:`input_keys` (the model inputs :meth:`images` needs besides
    ``input_ids``; the Tracer takes them from the model's forward or from ``generate``'s
    arguments), :attr:`layout_keys` (those of them the model does not take) and implements
    :meth:`images`. :func:`register` enters the class in the registry every list of
    families derives from. What the tests need of the family (its tiny random models, their
    real processor, the shared tests' choices) is its module in
    ``headscope.hf.testing.families``."""

    name: str = ""
    # the family's names as the README lists them ("GLM-4.1V", "GLM-4.5V")
    titles: Tuple[str, ...] = ()
    model_types: Tuple[str, ...] = ()
    layout: str = ""
    input_keys: Tuple[str, ...] = ()
    # inputs that describe the layout for headscope alone, where the processor drops what
    # the layout needs: the Tracer withholds them from the model (generate refuses inputs
    # the model does not use) and region_effects skips them
    layout_keys: Tuple[str, ...] = ()
    # whether each image token's place on the picture is known (grid_regions needs it)
    has_layout: bool = True

    def decoder(self, model) -> torch.nn.Module:
        """The text decoder: its attention layers are the traced ones."""
        return model.get_decoder()

    def image_token_ids(self, config) -> Tuple[int, ...]:
        """The ids of the tokens that stand for image features in ``input_ids``."""
        for name in ("image_token_id", "image_token_index"):
            value = getattr(config, name, None)
            if value is not None:
                return (int(value),)
        raise ValueError(f"headscope.hf: the config of this {self.name} model names no "
                         f"image token (image_token_id)")

    def layout_inputs(self, model, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        """What :meth:`images` reads of a forward's (or ``generate``'s) keyword arguments
        ``kwargs``: ``input_ids`` and :attr:`input_keys`."""
        inputs = {key: kwargs.get(key) for key in self.input_keys}
        inputs["input_ids"] = kwargs.get("input_ids")
        return inputs

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        """Per batch row, its pictures in sequence order, from ``inputs`` (``input_ids``
        ``(B, T)`` and :attr:`input_keys`)."""
        raise NotImplementedError

    def model_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        """``inputs`` without :attr:`layout_keys`: what the model itself takes."""
        return {k: v for k, v in inputs.items() if k not in self.layout_keys}

    def prompt_types(self, model, is_image: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The per-position type inputs a processor gives a prompt whose image tokens are
        ``is_image`` ``(B, T)`` bool (empty: none)."""
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            return {"mm_token_type_ids": is_image.to(torch.int32)}
        return {}

    def answer_type(self, name: str) -> int:
        """The value of the per-position input ``name`` (``token_type_ids``, ...) for a
        generated token, as the model's generate extends it."""
        return 0

    def final_softcap(self, config) -> Optional[float]:
        """The soft cap the model's forward puts on its output logits (None: none)."""
        return None

    def check_answer(self, config, answer_ids: torch.Tensor,
                     who: str = "headscope.hf.Tracer") -> None:
        """Raises a ValueError if a generated answer ``(B, N)`` holds an image token: the
        model would take prompt plus answer for a prompt with one more picture than it
        has, and fail deep in transformers (features and image tokens do not match)."""
        image_ids = list(self.image_token_ids(config))
        is_image = torch.isin(answer_ids.cpu(), torch.tensor(image_ids))
        if bool(is_image.any()):
            rows, steps = is_image.nonzero().t().tolist()
            raise ValueError(
                f"{who}: the generated answer holds the image token "
                f"{int(answer_ids[rows[0], steps[0]])} (row {rows[0]}, answer token "
                f"{steps[0]}; {len(rows)} in all), so prompt plus answer is no valid model "
                f"input and the final sequence cannot be traced; keep the model from "
                f"generating it: generate(..., suppress_tokens={image_ids})")


REGISTRY: List[Family] = []


def register(cls: Type[Family]) -> Type[Family]:
    """Class decorator: enters one instance of a family in :data:`REGISTRY`, after checking
    that the class sets its own names (no family falls back to a parent's) and that its
    model types are new."""
    family = cls()
    who = f"headscope.hf.families: {cls.__name__}"
    missing = [a for a in ("name", "titles", "model_types", "layout") if a not in vars(cls)]
    if missing:
        raise TypeError(f"{who} must set its own {', '.join(missing)}")
    taken = {t for f in REGISTRY for t in f.model_types}
    clash = taken.intersection(family.model_types)
    if clash:
        raise ValueError(f"{who}: model types {sorted(clash)} are already registered")
    REGISTRY.append(family)
    return cls


def missing_input(config, key: str, detail: str = "") -> ValueError:
    """The error for a picture layout that needs the model input ``key``, which plain
    ``model.generate`` does not hand to the model's forward (the Tracer's own generate
    passes it along)."""
    return ValueError(f"headscope.hf.Tracer: regions of a {config.model_type} model need the "
                      f"{key} of its inputs{detail}, and model.generate does not pass it to "
                      f"the model's forward; generate with tr.generate(**inputs, ...) or "
                      f"tr.generate_with(on_span, **inputs, ...)")
