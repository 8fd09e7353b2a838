"""What the tests need of a VLM family besides its layout: its side in
``headscope.hf.testing.families`` (:class:`TinyFamily`, registered with
:func:`register_tiny`): the tiny random models' config, one picture's prompt tokens and
model inputs, the real processor sized to the tiny vision tower, and a :class:`TinySpec`
of the tiny vocabulary's special tokens, the processor's settings and the shared tests'
choices."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Type

import torch

from ..families.base import Family
from .tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VOCAB

# LLaVA's chat template, with "<image> " where a picture goes: ``llava_template("[IMG] ")``
# puts another family's image marker there.
_LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image> "
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def llava_template(image: str = "<image> ") -> str:
    """LLaVA's one-turn chat template ("USER: ... ASSISTANT:") with ``image`` where each
    picture goes."""
    return _LLAVA_TEMPLATE.replace("<image> ", image)


@dataclass(frozen=True)
class TinySpec:
    """What the tests need of a family besides its layout: the tiny vocabulary's special
    tokens, the processor's settings, and which shared tests run on it.

    ``tokens``: every special token of the tiny tokenizer by name, with its id: the shared
    ids of :mod:`headscope.hf.testing.tokens` (``IMAGE_TOKEN``, ``EOS``, ...) and the family's own
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
    no query sees; ``cat_dims``, the inputs of :meth:`TinyFamily.image` whose pictures a batch
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


class TinyFamily:
    """The tests' side of one family: its tiny random models (:meth:`config`), one
    picture's prompt (:meth:`image`), the real processor (:meth:`processor`), :attr:`spec`
    (the tiny tokens and the shared tests' choices) and :attr:`attention`. ``family``: the
    production family it serves."""

    # the tiny test models' vocabulary, processor settings and shared tests (each family
    # sets its own)
    spec: TinySpec = None
    # the tiny models' text attention when the family's decoder runs under one only
    attention: Optional[str] = None

    def __init__(self, family: Family):
        self.family = family

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        """``(config, model class)`` of a tiny ``model_type`` model with text config
        ``text``, a vision tower of width ``vision_hidden`` and the special token ids
        ``ids`` (image_token_id, video_token_id, vision_start_token_id, ...)."""
        raise NotImplementedError

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """One picture's prompt tokens (markers included) and its model inputs (each a
        tensor to concatenate over the batch's pictures along dim 0, zero-padded in its
        other dims to the batch's largest, as processors pad pictures of fewer tiles),
        ``grid`` a size hint the family may ignore."""
        raise NotImplementedError

    def processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
                  longest_edge: int, max_tiles: int):
        """The real transformers processor of a tiny ``model_type`` model, offline:
        ``tokenizer`` (the tiny vocabulary with :attr:`spec`'s tokens), an image processor
        sized to :meth:`config`'s vision tower and :attr:`spec`'s chat template. The size
        options are :func:`headscope.hf.testing.tiny_processor`'s; each family reads those
        that its image processor has."""
        raise NotImplementedError(f"headscope.hf.testing.tiny_processor: no tiny {model_type} "
                                  f"processor")


# the tests' side of each family, by its family class
TINY: Dict[Type[Family], TinyFamily] = {}


def register_tiny(family: Type[Family]):
    """Class decorator of a :class:`TinyFamily` subclass: enters one instance of it in
    :data:`TINY` as the tests' side of ``family``, after checking that the class sets its
    own :class:`TinySpec` (no family falls back to a parent's tokens), that the family has
    no other, that its test choices name the family's own model types, and that its tiny
    tokens are in the vocabulary, one id each."""
    def enter(cls: Type[TinyFamily]) -> Type[TinyFamily]:
        who = f"headscope.hf.testing.families: {cls.__name__}"
        if "spec" not in vars(cls) or not isinstance(cls.spec, TinySpec):
            raise TypeError(f"{who} must set its own tiny spec (spec: a TinySpec)")
        if family in TINY:
            raise ValueError(f"{who}: {family.__name__} has its tests' side already "
                             f"({type(TINY[family]).__name__})")
        spec, model_types = cls.spec, set(family.model_types)
        named = {*spec.effects, *spec.unseen_region_effects, *spec.commands}
        if not named <= model_types:
            raise ValueError(f"{who}: its TinySpec names model types of no family of its own: "
                             f"{sorted(named - model_types)}")
        ids = list(spec.tokens.values())
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            roles = [n for n, i in spec.tokens.items() if i in repeated]
            raise ValueError(f"{who}: the tiny tokens {roles} share the ids {repeated}")
        outside = [n for n, i in spec.tokens.items() if not 0 < i < VOCAB]
        if outside or IMAGE_TOKEN not in ids or EOS not in ids:
            raise ValueError(f"{who}: the tiny tokens need IMAGE_TOKEN and EOS, every id in "
                             f"[1, {VOCAB}) (family markers in MARKER_IDS "
                             f"{MARKER_IDS[0]}..{MARKER_IDS[-1]}); out of range: {outside}")
        TINY[family] = cls(family())
        return cls
    return enter
