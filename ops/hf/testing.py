"""Tiny randomly initialised transformers VLMs and image prompts for them, built from
configs (no downloads): what the tests and ``python -m headscope.bench --family hf`` run on.

``tiny_model(family)`` gives a model of one of :data:`FAMILIES`, all with grouped-query
attention in the text decoder; ``image_prompt(model, grids, text_before, text_after)``
gives its inputs for one image per prompt (random pixels), in the layout its processor
would produce, left-padded when the rows differ in length. ``tiny_checkpoint(folder,
family)`` saves such a model with a real processor (``tiny_processor``, built in
``checkpoint.py``) for ``from_pretrained``, and ``tiny_dataset(folder, count)`` (also
``checkpoint.py``) writes synthetic images in the DATA format of ``python -m headscope
collect``. The model types are the family modules' (each family's ``tiny_config``,
``tiny_image`` and ``TinySpec``), the shared token ids :mod:`headscope.hf.tiny`'s.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from .checkpoint import tiny_dataset, tiny_processor, tiny_tokenizer  # noqa: F401 (the API)
from .families import supported_model_types
from .tiny import (EOS, IMAGE_TOKEN, PAD, VIDEO_TOKEN, VISION_END, VISION_START,  # noqa: F401
                   VOCAB)

# every model type of a registered family (headscope.hf.families)
FAMILIES = supported_model_types()


def _text(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
          intermediate: int, vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, eos_token_id=EOS,
                pad_token_id=PAD, bos_token_id=None, max_position_embeddings=8192,
                tie_word_embeddings=False)


def tiny_model(family: str = "qwen2_vl", *, hidden: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
               vision_hidden: int = 32, vocab: int = VOCAB,
               attn_implementation: str = "sdpa",
               dtype: torch.dtype = torch.float32, seed: int = 0,
               text_overrides: Optional[Dict] = None, overrides: Optional[Dict] = None):
    """A randomly initialised VLM of model type ``family`` (one of :data:`FAMILIES`) in
    eval mode. The text decoder has ``layers`` layers of ``heads`` query and ``kv_heads``
    key/value heads of width ``hidden // heads`` and a vocabulary of ``vocab`` (>=
    :data:`VOCAB`, whose top ids are the special tokens); the vision tower is one or two
    small blocks (the family module's ``tiny_config``). ``attn_implementation`` is the
    family's ``tiny_attention`` where it has one (PaliGemma 2: eager).
    ``text_overrides``: text config entries over the family's own (another decoder's
    ``model_type``, a ``sliding_window``); ``overrides``: config entries set on the built
    config before the model is made, a dict value setting entries of that sub-config (the
    benchmarks' real sizes: ``{"text_config": {"sliding_window": 1024}}``)."""
    from .families import family_of
    if family not in FAMILIES:
        raise ValueError(f"headscope.hf.testing.tiny_model: family must be one of {FAMILIES}, "
                         f"got {family!r}")
    if vocab < VOCAB:
        raise ValueError(f"headscope.hf.testing.tiny_model: vocab must be >= {VOCAB}, got {vocab}")
    text = _text(hidden, layers, heads, kv_heads, hidden // heads, intermediate, vocab)
    text.update(text_overrides or {})
    ids = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
               vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    family_module = family_of(SimpleNamespace(model_type=family))
    config, cls = family_module.tiny_config(family, text, vision_hidden, ids)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict):
            for name, entry in value.items():
                setattr(getattr(config, key), name, entry)
        else:
            setattr(config, key, value)
    config.text_config._attn_implementation_internal = family_module.tiny_attention or \
        attn_implementation
    config.vision_config._attn_implementation_internal = "sdpa"
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def tiny_checkpoint(path: Union[str, Path], family: str = "qwen2_vl", **model_kwargs) -> Path:
    """Saves a tiny random ``family`` model (``tiny_model(family, **model_kwargs)``) and
    its :func:`tiny_processor` into the folder ``path`` (created), loadable offline with
    ``AutoModelForImageTextToText.from_pretrained(path)`` and
    ``AutoProcessor.from_pretrained(path)``. Returns the folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tiny_model(family, **model_kwargs).save_pretrained(path)
    tiny_processor(family).save_pretrained(path)
    return path


def image_prompt(model, grids: Sequence[Tuple[int, int]] = ((8, 8),),
                 text_before: Sequence[int] = (3,), text_after: Sequence[int] = (5,),
                 seed: int = 0) -> Dict[str, torch.Tensor]:
    """Inputs for a batch of prompts, row b being ``text_before[b]`` text tokens, one
    image of ``grids[b]`` patches (Qwen: even sizes; LLaVA: its fixed size; LLaVA-NeXT: the
    picture's height and width in patches of its tower) laid out by
    its family's ``tiny_image``, and ``text_after[b]`` text tokens; rows are left-padded
    to one length, with the per-position type inputs the family's processor gives
    (``mm_token_type_ids``, ``token_type_ids``)."""
    from .families import family_of
    family = family_of(model)
    g = torch.Generator().manual_seed(seed)
    rows, extras = [], []
    for grid, nb, na in zip(grids, text_before, text_after):
        before = torch.randint(1, IMAGE_TOKEN, (nb,), generator=g)
        after = torch.randint(1, IMAGE_TOKEN, (na,), generator=g)
        image, inputs = family.tiny_image(model, grid, g)
        rows.append(torch.cat([before, image, after]))
        extras.append(inputs)
    T = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), T), PAD)
    attention_mask = torch.zeros(len(rows), T, dtype=torch.int64)
    for b, r in enumerate(rows):
        input_ids[b, T - len(r):] = r
        attention_mask[b, T - len(r):] = 1
    out = dict(input_ids=input_ids, attention_mask=attention_mask)
    for key, items in family.tiny.index_inputs.items():
        shift = 0
        for inputs in extras:
            inputs[key] = torch.where(inputs[key] >= 0, inputs[key] + shift, inputs[key])
            shift += inputs[items][..., 0].numel()
    for key in extras[0]:
        parts = [e[key] for e in extras]
        dim = family.tiny.cat_dims.get(key)
        out[key] = _cat_padded(parts) if dim is None else torch.cat(parts, dim)
    out["pixel_values"] = out["pixel_values"].to(model.dtype)
    typed = [family.tiny.tokens[name] for name in family.tiny.typed_tokens]
    is_image = torch.isin(input_ids, torch.tensor([*family.image_token_ids(model.config),
                                                   *typed]))
    out.update(family.prompt_types(model, is_image))
    return out


def _cat_padded(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` concatenated along dim 0, each zero-padded at the end of its other
    dims to the largest size (as processors pad a batch's pictures to the most tiles:
    all-zero tiles, which the models drop)."""
    size = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        pad = [n for d in reversed(range(1, t.dim())) for n in (0, size[d - 1] - t.shape[d])]
        padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)


def quarters(height: int, width: int, colours):
    """A PIL picture of ``height x width`` pixels whose quarters (top left, top right,
    bottom left, bottom right) have the four RGB ``colours``: the geometry tests check
    that each token's box lies in the quarter whose colour its pixels carry."""
    import numpy as np
    from PIL import Image
    pixels = np.empty((height, width, 3), np.uint8)
    top, left = height // 2, width // 2
    colours = np.asarray(colours, dtype=np.uint8)
    pixels[:top, :left], pixels[:top, left:] = colours[0], colours[1]
    pixels[top:, :left], pixels[top:, left:] = colours[2], colours[3]
    return Image.fromarray(pixels)


def assert_quarter_colours(boxes: torch.Tensor, colours: torch.Tensor,
                           ignore: Optional[int] = None) -> None:
    """The geometry tests' check of a picture made by :func:`quarters`: ``boxes``
    ``(N, 4)`` are N image tokens' boxes on it, ``colours`` ``(N, P)`` the index (0 to 3)
    of the quarter colour nearest each of a token's P pixels as the model sees them
    (``ignore``: an index that may also appear, such as the black of padding). Every
    pixel of a token whose box lies in one quarter has that quarter's colour (resizing
    blurs the edges by less than half the distance between two colours); a token astride
    the picture's middle lines carries, among its own, the colour of the quarter holding
    its box's centre (where ``grid_regions(2, 2)`` puts it)."""
    from .regions import grid_regions
    quarter = grid_regions(2, 2).of_boxes(boxes)
    astride = ((boxes[:, 0] < 0.5) & (boxes[:, 2] > 0.5)) | \
        ((boxes[:, 1] < 0.5) & (boxes[:, 3] > 0.5))
    assert bool((~astride).any()), "no token lies within one quarter"
    matches = colours == quarter[:, None]
    allowed = matches if ignore is None else matches | (colours == ignore)
    bad = (~allowed[~astride]).any(1).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} tokens within one quarter read another colour"
    assert bool(matches[astride].any(1).all()), \
        "a token astride the middle lacks the colour of its centre's quarter"


def assert_quarters_are_regions(model, inputs: Dict[str, torch.Tensor], colours):
    """The geometry tests' check through the model, on a processor's ``inputs`` of one
    :func:`quarters` picture per row: ``colours(b, image)`` gives, for row b's picture
    (an ``ImageTokens``), the ``(tokens, P)`` indices of its tokens' pixels' colours in the
    order of ``image.positions`` (as :func:`assert_quarter_colours` takes them). Traces
    ``model(**inputs)`` with ``grid_regions(2, 2)``: the logits are bitwise the untraced
    model's, each row has 4 regions, every token whose pixels read one colour has that
    colour's region (the colours and the blocks are both numbered row-major), the tokens
    of each kind of view read all four colours, and every other position is -1. Returns
    the detached tracer."""
    from .families import family_of
    from .regions import grid_regions
    from .tracer import Tracer
    with torch.no_grad():
        plain = model(**inputs).logits
        with Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
            assert torch.equal(model(**inputs).logits, plain)
    B = inputs["input_ids"].shape[0]
    assert tr.num_regions == [4] * B
    is_image = torch.isin(inputs["input_ids"],
                          torch.tensor(family_of(model).image_token_ids(model.config)))
    for b in range(B):
        (image,) = tr.images[b]
        read = colours(b, image)
        single = (read == read[:, :1]).all(1)  # tokens whose pixels read one colour only
        regions = tr.region_ids[b, image.positions]
        names = [v.name for v in image.views for _ in range(len(v.positions))]
        seen: Dict[str, set] = {}
        for colour, region, name, one in zip(read[:, 0].tolist(), regions.tolist(), names,
                                             single.tolist()):
            if one:
                assert region == colour, (b, name, colour, region)
                seen.setdefault(name, set()).add(colour)
        assert seen == {name: {0, 1, 2, 3} for name in names}, (b, seen)
        assert bool((tr.region_ids[b][~is_image[b]] == -1).all())
    return tr


def eager_reference(model_eager, inputs: Dict[str, torch.Tensor], **forward_kwargs):
    """The way attention is inspected without headscope: a model loaded with eager
    attention, run with ``output_attentions=True`` and forward hooks on the o_proj inputs.
    Returns ``(output, attentions, head_writes)``: per softmax attention layer of the
    decoder (all of them but a hybrid's other mixers) its ``(B, H, T, T)`` attention and
    ``(B, H, T, Dh)`` per-head outputs (before an output gate, where the layer has one)."""
    from .families import family_of
    from .structure import output_projection, softmax_attention_layers
    decoder = family_of(model_eager).decoder(model_eager)
    H = decoder.config.num_attention_heads
    writes, gates, hooks = [], [], []

    def grab(module, args):
        x = args[0]
        if gates:  # o_proj gets the attention output times sigmoid(gate): divide it out
            x = x / torch.sigmoid(gates.pop())
        writes.append(x.reshape(*x.shape[:2], H, -1).transpose(1, 2))

    def gate(module, args, out):  # q_proj gives (query, gate) per head (Qwen3.5's)
        gates.append(out.reshape(*out.shape[:2], H, -1).chunk(2, -1)[1]
                     .reshape(*out.shape[:2], -1))

    for attention in softmax_attention_layers(decoder):
        hooks.append(output_projection(attention).register_forward_pre_hook(grab))
        query, head_dim = getattr(attention, "q_proj", None), getattr(attention, "head_dim", 0)
        if query is not None and query.out_features == 2 * H * head_dim:
            hooks.append(query.register_forward_hook(gate))
    try:
        with torch.no_grad():
            out = model_eager(**inputs, output_attentions=True, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, list(out.attentions), writes
