"""Tiny randomly initialised transformers VLMs and image prompts for them, built from
configs (no downloads): what the tests and ``python -m headscope.bench --family hf`` run on.

``tiny_model(family)`` gives a model of one of :data:`FAMILIES`, all with grouped-query
attention in the text decoder; ``image_prompt(model, grids, text_before, text_after)``
gives its inputs for one image per prompt (random pixels), in the layout its processor
would produce, left-padded when the rows differ in length. ``tiny_checkpoint(folder,
family)`` saves such a model with a real processor (``tiny_processor``) for
``from_pretrained``, and ``tiny_dataset(folder, count)`` writes synthetic images in the
DATA format of ``python -m headscope collect`` (both in ``checkpoint.py``).
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")

# Token ids of the tiny vocabulary (random weights: only their roles matter).
VOCAB = 512
IMAGE_TOKEN = 500
VIDEO_TOKEN = 501
VISION_START = 502
VISION_END = 503
EOS = 504
PAD = 0


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
               dtype: torch.dtype = torch.float32, seed: int = 0):
    """A randomly initialised VLM of ``family`` in eval mode. The text decoder has
    ``layers`` layers of ``heads`` query and ``kv_heads`` key/value heads of width
    ``hidden // heads`` and a vocabulary of ``vocab`` (>= :data:`VOCAB`, whose top ids are
    the special tokens); the vision tower is one or two small blocks."""
    import transformers as tf

    head_dim = hidden // heads
    if vocab < VOCAB:
        raise ValueError(f"headscope.hf.testing.tiny_model: vocab must be >= {VOCAB}, got {vocab}")
    text = _text(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab)
    ids = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
               vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    if family == "qwen2_vl":
        rope = dict(rope_type="default", rope_theta=10000.0,
                    mrope_section=_mrope_section(head_dim))
        config = tf.Qwen2VLConfig(
            text_config=dict(text, rope_parameters=rope),
            vision_config=dict(depth=1, embed_dim=vision_hidden, hidden_size=hidden,
                               num_heads=2, patch_size=4, spatial_merge_size=2,
                               temporal_patch_size=2), **ids)
        cls = tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        rope = dict(rope_type="default", rope_theta=10000.0,
                    mrope_section=_mrope_section(head_dim))
        config = tf.Qwen2_5_VLConfig(
            text_config=dict(text, rope_parameters=rope),
            vision_config=dict(depth=2, hidden_size=vision_hidden, intermediate_size=64,
                               num_heads=2, patch_size=4, spatial_merge_size=2,
                               temporal_patch_size=2, out_hidden_size=hidden,
                               window_size=16, fullatt_block_indexes=[1]), **ids)
        cls = tf.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_vl":
        rope = dict(rope_type="default", rope_theta=10000.0,
                    mrope_section=_mrope_section(head_dim), mrope_interleaved=True)
        config = tf.Qwen3VLConfig(
            text_config=dict(text, rope_parameters=rope),
            vision_config=dict(depth=2, hidden_size=vision_hidden, intermediate_size=64,
                               num_heads=2, patch_size=4, spatial_merge_size=2,
                               temporal_patch_size=2, out_hidden_size=hidden,
                               num_position_embeddings=64, deepstack_visual_indexes=[0]),
            **ids)
        cls = tf.Qwen3VLForConditionalGeneration
    elif family == "llava":
        config = tf.LlavaConfig(
            text_config=dict(text, model_type="llama"),
            vision_config=dict(model_type="clip_vision_model", hidden_size=vision_hidden,
                               intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=16, patch_size=4,
                               projection_dim=vision_hidden),
            image_token_index=IMAGE_TOKEN, image_seq_length=16,
            vision_feature_layer=-1, vision_feature_select_strategy="default")
        cls = tf.LlavaForConditionalGeneration
    else:
        raise ValueError(f"headscope.hf.testing.tiny_model: family must be one of {FAMILIES}, "
                         f"got {family!r}")
    config.text_config._attn_implementation_internal = attn_implementation
    config.vision_config._attn_implementation_internal = "sdpa"
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def _mrope_section(head_dim: int) -> list:
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def image_grid(model, grid: Tuple[int, int]) -> Tuple[int, int]:
    """The token grid (rows, columns) of an image of ``grid`` patches (Qwen) or of the
    model's fixed size (LLaVA, ``grid`` ignored)."""
    if model.config.model_type == "llava":
        side = model.config.vision_config.image_size // model.config.vision_config.patch_size
        return side, side
    m = model.config.vision_config.spatial_merge_size
    return grid[0] // m, grid[1] // m


def image_prompt(model, grids: Sequence[Tuple[int, int]] = ((8, 8),),
                 text_before: Sequence[int] = (3,), text_after: Sequence[int] = (5,),
                 seed: int = 0) -> Dict[str, torch.Tensor]:
    """Inputs for a batch of prompts, row b being ``text_before[b]`` text tokens, one
    image of ``grids[b]`` patches (Qwen: even sizes; LLaVA: its fixed size), and
    ``text_after[b]`` text tokens; rows are left-padded to one length."""
    g = torch.Generator().manual_seed(seed)
    is_llava = model.config.model_type == "llava"
    rows, types, pixels, thw = [], [], [], []
    for grid, nb, na in zip(grids, text_before, text_after):
        th, tw = image_grid(model, grid)
        before = torch.randint(1, IMAGE_TOKEN, (nb,), generator=g)
        after = torch.randint(1, IMAGE_TOKEN, (na,), generator=g)
        image = torch.full((th * tw,), IMAGE_TOKEN)
        if is_llava:
            ids = torch.cat([before, image, after])
            vc = model.config.vision_config
            pixels.append(torch.randn(1, 3, vc.image_size, vc.image_size, generator=g))
        else:
            ids = torch.cat([before, torch.tensor([VISION_START]), image,
                             torch.tensor([VISION_END]), after])
            vc = model.config.vision_config
            patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
            pixels.append(torch.randn(grid[0] * grid[1], patch, generator=g))
            thw.append(torch.tensor([1, grid[0], grid[1]]))
        rows.append(ids)
        types.append((ids == IMAGE_TOKEN).to(torch.int32))
    T = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), T), PAD)
    attention_mask = torch.zeros(len(rows), T, dtype=torch.int64)
    mm_types = torch.zeros(len(rows), T, dtype=torch.int32)
    for b, (r, t) in enumerate(zip(rows, types)):
        input_ids[b, T - len(r):] = r
        attention_mask[b, T - len(r):] = 1
        mm_types[b, T - len(r):] = t
    dtype = model.dtype
    out = dict(input_ids=input_ids, attention_mask=attention_mask,
               pixel_values=torch.cat(pixels).to(dtype))
    if not is_llava:
        out["image_grid_thw"] = torch.stack(thw)
        out["mm_token_type_ids"] = mm_types
    return out


def eager_reference(model_eager, inputs: Dict[str, torch.Tensor], **forward_kwargs):
    """The way attention is inspected without headscope: a model loaded with eager
    attention, run with ``output_attentions=True`` and forward hooks on the o_proj inputs.
    Returns ``(output, attentions, head_writes)``: per decoder layer its ``(B, H, T, T)``
    attention and ``(B, H, T, Dh)`` per-head outputs."""
    H = model_eager.config.text_config.num_attention_heads
    writes, hooks = [], []

    def grab(module, args):
        x = args[0]
        writes.append(x.reshape(*x.shape[:2], H, -1).transpose(1, 2))

    for layer in model_eager.get_decoder().layers:
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(grab))
    try:
        with torch.no_grad():
            out = model_eager(**inputs, output_attentions=True, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, list(out.attentions), writes


from .checkpoint import tiny_checkpoint, tiny_dataset, tiny_processor, tiny_tokenizer  # noqa: E402,F401
