"""Tiny randomly initialised transformers VLMs and image prompts for them, built from
configs (no downloads): what the tests and ``python -m headscope.bench --family hf`` run on.
Each family's models, prompts and processor are its module in
``headscope.hf.testing.families`` (its :class:`~headscope.hf.testing.spec.TinyFamily`); the
shared token ids are :mod:`headscope.hf.testing.tokens`'.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from ..families import family_of, supported_model_types
from .checkpoint import tiny_processor
from .families import tiny_of
from .tokens import EOS, IMAGE_TOKEN, PAD, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB

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
    small blocks (the family's ``TinyFamily.config``). ``attn_implementation`` is the
    family's ``TinyFamily.attention`` where it has one (PaliGemma 2: eager).
    ``text_overrides``: text config entries over the family's own (another decoder's
    ``model_type``, a ``sliding_window``); ``overrides``: config entries set on the built
    config before the model is made, a dict value setting entries of that sub-config (the
    benchmarks' real sizes: ``{"text_config": {"sliding_window": 1024}}``)."""
    if family not in FAMILIES:
        raise ValueError(f"headscope.hf.testing.tiny_model: family must be one of {FAMILIES}, "
                         f"got {family!r}")
    if vocab < VOCAB:
        raise ValueError(f"headscope.hf.testing.tiny_model: vocab must be >= {VOCAB}, got {vocab}")
    text = _text(hidden, layers, heads, kv_heads, hidden // heads, intermediate, vocab)
    text.update(text_overrides or {})
    ids = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
               vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    tiny = tiny_of(family)
    config, cls = tiny.config(family, text, vision_hidden, ids)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict):
            for name, entry in value.items():
                setattr(getattr(config, key), name, entry)
        else:
            setattr(config, key, value)
    config.text_config._attn_implementation_internal = tiny.attention or attn_implementation
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
    its family's ``TinyFamily.image``, and ``text_after[b]`` text tokens; rows are left-padded
    to one length, with the per-position type inputs the family's processor gives
    (``mm_token_type_ids``, ``token_type_ids``)."""
    family = family_of(model)
    tiny = tiny_of(family)
    g = torch.Generator().manual_seed(seed)
    rows, extras = [], []
    for grid, nb, na in zip(grids, text_before, text_after):
        before = torch.randint(1, IMAGE_TOKEN, (nb,), generator=g)
        after = torch.randint(1, IMAGE_TOKEN, (na,), generator=g)
        image, inputs = tiny.image(model, grid, g)
        rows.append(torch.cat([before, image, after]))
        extras.append(inputs)
    T = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), T), PAD)
    attention_mask = torch.zeros(len(rows), T, dtype=torch.int64)
    for b, r in enumerate(rows):
        input_ids[b, T - len(r):] = r
        attention_mask[b, T - len(r):] = 1
    out = dict(input_ids=input_ids, attention_mask=attention_mask)
    for key, items in tiny.spec.index_inputs.items():
        shift = 0
        for inputs in extras:
            inputs[key] = torch.where(inputs[key] >= 0, inputs[key] + shift, inputs[key])
            shift += inputs[items][..., 0].numel()
    for key in extras[0]:
        parts = [e[key] for e in extras]
        dim = tiny.spec.cat_dims.get(key)
        out[key] = _cat_padded(parts) if dim is None else torch.cat(parts, dim)
    out["pixel_values"] = out["pixel_values"].to(model.dtype)
    typed = [tiny.spec.tokens[name] for name in tiny.spec.typed_tokens]
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


