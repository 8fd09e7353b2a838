"""The interface every family module implements (one module per family of VLMs)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS, VOCAB
from .layout import ImageTokens

# LLaVA's chat template, with "<image> " where a picture goes: ``llava_template("[IMG] ")``
# puts another family's image marker there.
_LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image> "
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


# The per-position type inputs processors give (image or text per token; ERNIE 4.5-VL's
# moe_mm_token_type_ids also mark the picture's markers): a generated answer continues
# each with the family's answer_type
TYPE_INPUTS = ("mm_token_type_ids", "moe_mm_token_type_ids", "token_type_ids")


def llava_template(image: str = "<image> ") -> str:
    """LLaVA's one-turn chat template ("USER: ... ASSISTANT:") with ``image`` where each
    picture goes."""
    return _LLAVA_TEMPLATE.replace("<image> ", image)


@dataclass(frozen=True)
class TinySpec:
    """What the tests need of a family besides its layout: the tiny vocabulary's special
    tokens, the processor's settings, and which shared tests run on it.

    ``tokens``: every special token of the tiny tokenizer by name, with its id: the shared
    ids of :mod:`headscope.hf.tiny` (``IMAGE_TOKEN``, ``EOS``, ...) and the family's own
    markers from ``MARKER_IDS`` (ids may repeat across families, never within one: checked
    at registration). ``tokenizer_extras``: the named special tokens its processor reads
    off the tokenizer (``image_token``, ``boi_token``, ...). ``chat_template``: a one-turn
    template for the processor. ``typed_tokens``: the tokens besides the image token that
    the processor types as the picture's in ``mm_token_type_ids`` (Molmo 2's markers, in
    its bidirectional image block). ``index_inputs``: inputs whose entries index the items
    of another input, by that input's name (Molmo 2's ``image_token_pooling``, the patches
    of ``pixel_values``: its rows flattened to the last dim; -1 none): a batch's pictures'
    entries are shifted past the earlier pictures' items, as the processor numbers them.

    The shared tests' choices: ``grids``, the two pictures of the contract's prompts
    (``image_prompt``'s ``grids``); ``contract_xfail``, ``(exception, reason)`` where the
    contract cannot hold yet (every contract test a strict xfail); ``effects``, per model
    type the ablations checked against one region at a time (test_effects.py);
    ``unseen_region_effects``, the model types whose effects are checked zero on a region
    no query sees; ``cat_dims``, the inputs of ``tiny_image`` whose pictures a batch
    concatenates along another dim than 0 (NaViT-packed patches side by side);
    ``commands``, the model types the commands run end to end on, from a saved checkpoint
    (test_commands.py); ``geometry_waiver``, why a family has no geometry
    test against its real processor (a ``tests/python/test_families_*.py`` that names its
    model types), if so; ``batch_numbers_pictures``, whether the model's own forward numbers
    a batch's pictures in order (HunYuan-VL's rope), so that a padded batch's later rows
    differ from those rows alone in the model itself: the contract then checks the first
    row alone, that difference in the untraced model, and every row's regions."""
    tokens: Mapping[str, int]
    chat_template: str
    tokenizer_extras: Mapping[str, str] = field(default_factory=dict)
    typed_tokens: Tuple[str, ...] = ()
    index_inputs: Mapping[str, str] = field(default_factory=dict)
    grids: Tuple[Tuple[int, int], ...] = ((8, 8), (6, 4))
    contract_xfail: Optional[Tuple[Type[BaseException], str]] = None
    effects: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    unseen_region_effects: Tuple[str, ...] = ()
    cat_dims: Mapping[str, int] = field(default_factory=dict)
    commands: Tuple[str, ...] = ()
    geometry_waiver: Optional[str] = None
    batch_numbers_pictures: bool = False

    def by_id(self) -> Dict[int, str]:
        """The special tokens by id."""
        return {i: name for name, i in self.tokens.items()}


class Family:
    """How headscope reads one family of transformers VLMs: where its text decoder is,
    which tokens are image tokens, and where each lies on its picture. The Tracer,
    ``region_effects`` and the commands ask the family and know no family by name.

    A subclass sets :attr:`name`, :attr:`titles`, :attr:`model_types` (the
    ``config.model_type`` values it reads), :attr:`layout` (one line for the families table), :attr:`input_keys` (the
    model inputs :meth:`images` needs besides ``input_ids``; the Tracer takes them from the
    model's forward or from ``generate``'s arguments), :attr:`layout_keys` (those of them
    the model does not take) and implements :meth:`images`;
    :meth:`tiny_config` and :meth:`tiny_image` build the tiny random models and prompts of
    the tests (``headscope.hf.testing``), :meth:`tiny_processor` their real processor and
    :attr:`tiny` (a :class:`TinySpec`) their tokens and tests. :func:`register` enters the
    class in the registry every list of families derives from."""

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
    # the tiny models' text attention when the family's decoder runs under one only
    tiny_attention: Optional[str] = None
    # the tiny test models' vocabulary, processor settings and shared tests
    tiny: TinySpec = None

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

    # ---- tiny models for the tests ------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        """``(config, model class)`` of a tiny ``model_type`` model with text config
        ``text``, a vision tower of width ``vision_hidden`` and the special token ids
        ``ids`` (image_token_id, video_token_id, vision_start_token_id, ...)."""
        raise NotImplementedError

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """One picture's prompt tokens (markers included) and its model inputs (each a
        tensor to concatenate over the batch's pictures along dim 0, zero-padded in its
        other dims to the batch's largest, as processors pad pictures of fewer tiles),
        ``grid`` a size hint the family may ignore."""
        raise NotImplementedError

    def tiny_processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
                       longest_edge: int, max_tiles: int):
        """The real transformers processor of a tiny ``model_type`` model, offline:
        ``tokenizer`` (the tiny vocabulary with :attr:`tiny`'s tokens), an image processor
        sized to :meth:`tiny_config`'s vision tower and :attr:`tiny`'s chat template. The
        size options are :func:`headscope.hf.testing.tiny_processor`'s; each family reads
        those that its image processor has."""
        raise NotImplementedError(f"headscope.hf.testing.tiny_processor: no tiny {model_type} "
                                  f"processor")


REGISTRY: List[Family] = []


def register(cls: Type[Family]) -> Type[Family]:
    """Class decorator: enters one instance of a family in :data:`REGISTRY`, after checking
    that the class sets its own names and :class:`TinySpec` (no family falls back to a
    parent's tokens), that its model types are new, that its TinySpec's test choices name
    its own model types, and that its tiny tokens are in the vocabulary, one id each."""
    family = cls()
    who = f"headscope.hf.families: {cls.__name__}"
    missing = [a for a in ("name", "titles", "model_types", "layout", "tiny")
               if a not in vars(cls)]
    if missing or not isinstance(family.tiny, TinySpec):
        raise TypeError(f"{who} must set its own {', '.join(missing or ['tiny'])} "
                        f"(tiny: a TinySpec)")
    taken = {t for f in REGISTRY for t in f.model_types}
    clash = taken.intersection(family.model_types)
    if clash:
        raise ValueError(f"{who}: model types {sorted(clash)} are already registered")
    named = {*family.tiny.effects, *family.tiny.unseen_region_effects, *family.tiny.commands}
    if not named <= set(family.model_types):
        raise ValueError(f"{who}: its TinySpec names model types of no family of its own: "
                         f"{sorted(named - set(family.model_types))}")
    ids = list(family.tiny.tokens.values())
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        roles = [n for n, i in family.tiny.tokens.items() if i in repeated]
        raise ValueError(f"{who}: the tiny tokens {roles} share the ids {repeated}")
    outside = [n for n, i in family.tiny.tokens.items() if not 0 < i < VOCAB]
    if outside or IMAGE_TOKEN not in ids or EOS not in ids:
        raise ValueError(f"{who}: the tiny tokens need IMAGE_TOKEN and EOS, every id in "
                         f"[1, {VOCAB}) (family markers in MARKER_IDS "
                         f"{MARKER_IDS[0]}..{MARKER_IDS[-1]}); out of range: {outside}")
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
