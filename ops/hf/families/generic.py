"""Any other VLM that puts its image tokens in the sequence, read by its structure
(``headscope.hf.structure``): its image placeholder tokens are those its own
``get_placeholder_mask`` finds, and each run of consecutive placeholders is one picture
with no known layout on the picture plane. Ward regions then cluster a run's tokens in
sequence order (a ``1 x n`` grid); ``grid_regions``, which needs each token's place on
the picture, is refused."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Tuple

import torch

from ..capture import decoder_kwargs
from ..structure import placeholder_token_ids
from .base import Family
from .layout import ImageTokens, View, image_positions, runs

# a forward's arguments the probe leaves out: it runs without a cache
_CACHE_KEYS = ("cache", "past_key_values", "use_cache")


class Generic(Family):
    name = "generic"
    layout = "none: each run of image placeholders is one picture, in sequence order"
    has_layout = False

    def image_token_ids(self, config) -> Tuple[int, ...]:
        ids = placeholder_token_ids(config)
        if ids is None:
            raise ValueError(no_image_tokens(config))
        return ids

    def layout_inputs(self, model, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        """``input_ids`` and which placeholders hold a piece of the picture
        (``picture_slots``, by :func:`picture_slots`' probe of the model on ``kwargs``)."""
        inputs = super().layout_inputs(model, kwargs)
        with torch.no_grad():
            inputs["picture_slots"] = picture_slots(model, self.decoder(model), kwargs,
                                                    self.image_token_ids(model.config))
        return inputs

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        """Each run of consecutive placeholders is one picture; of its slots, those that
        ``inputs["picture_slots"]`` ``(B, T)`` bool marks as holding no piece of the picture
        (begin/end, row breaks, indicator tokens: see :func:`picture_slots`) are markers,
        region -1."""
        slots = inputs.get("picture_slots")
        pictures = []
        for b, positions in enumerate(image_positions(inputs["input_ids"],
                                                      self.image_token_ids(config))):
            row = []
            for run in runs(positions):
                content = run if slots is None else run[slots[b, run].cpu()]
                if not len(content):
                    continue
                markers = run[~torch.isin(run, content)]
                row.append(ImageTokens((View("run", content, 1, len(content)),),
                                       markers=markers))
            pictures.append(row)
        return pictures


def picture_slots(model, decoder: torch.nn.Module, kwargs: Dict[str, Any],
                  token_ids: Tuple[int, ...]) -> torch.Tensor:
    """``(B, T)`` bool: the placeholders whose input to the text decoder changes with the
    picture's pixels. The model runs once more, to its text decoder, on the same inputs
    with and without noise added to every ``pixel_values*`` input; a slot whose embedding, and whatever
    the decoder gets per placeholder besides (features it adds at later layers, in
    placeholder order), stays bitwise the same holds a learned marker (begin/end of image,
    row break, indicator), not the picture. ``decoder``: the model's text decoder;
    ``token_ids``: the placeholders' ids."""
    named = inspect.signature(model.forward).parameters
    kwargs = {k: v for k, v in kwargs.items()  # (generate's own arguments left out)
              if k in named and named[k].kind is not inspect.Parameter.VAR_KEYWORD
              and k not in _CACHE_KEYS}
    g = torch.Generator().manual_seed(0)
    noisy = dict(kwargs)
    for key, value in kwargs.items():
        if key.startswith("pixel_values") and isinstance(value, torch.Tensor) \
                and value.is_floating_point():
            noise = torch.randn(value.shape, generator=g).to(value.device, value.dtype)
            noisy[key] = value + noise
    plain = decoder_kwargs(model, decoder, kwargs)
    probed = decoder_kwargs(model, decoder, noisy)
    is_image = torch.isin(kwargs["input_ids"].cpu(), torch.tensor(list(token_ids)))
    changed = (probed["inputs_embeds"] != plain["inputs_embeds"]).any(-1).cpu() & is_image
    count = int(is_image.sum())
    later = [(a, b) for a, b in zip(_tensors(plain), _tensors(probed))
             if a.dim() == 2 and a.shape[0] == count and a is not plain["inputs_embeds"]]
    for a, b in later:  # per placeholder, in sequence order
        changed[is_image] |= (a != b).any(-1).cpu()
    if count and not bool(changed.any()):
        raise NotImplementedError(
            f"headscope.hf.Tracer: the image features of this {model.config.model_type} "
            f"model reach its text decoder neither through the placeholders' embeddings nor "
            f"through per-placeholder decoder inputs, so headscope cannot tell which "
            f"placeholders hold the picture")
    return changed


def _tensors(value) -> List[torch.Tensor]:
    """The tensors in a decoder input (nested in dicts, lists and tuples), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def no_image_tokens(config) -> str:
    """Why a model whose config names no image placeholder cannot be traced."""
    return (f"its config ({type(config).__name__}) names no image placeholder token "
            f"(image_token_id, image_token_index or what its get_placeholder_mask reads), so "
            f"its sequence holds no image tokens to attribute to")
