"""Tiny random models of VLM families that have no family module, built from their
configs as their own transformers tests build them, and prompts for them: what the tests
of the generic reading (``headscope.hf.families.generic``) run on.

``tiny_newest(model_type)`` gives ``(model, picture)``: the model in eval mode, and
``picture(generator)``, one picture's model inputs (tensors to concatenate over a batch's
pictures along dim 0). ``newest_prompt(model, picture, text_before, text_after)`` lays
out a left-padded batch of one picture per row, with as many image placeholders as the
model's own ``get_image_features`` returns features for that picture.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .tiny import EOS, IMAGE_TOKEN, PAD, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB

Picture = Callable[[torch.Generator], Dict[str, torch.Tensor]]


@dataclass
class Recipe:
    """A tiny model's config and class, and ``picture(generator)``: one picture's model
    inputs. ``offsets``: inputs that index into another input's items, by that input's name (they
    are shifted past the earlier pictures' items when concatenated); ``markers``: token ids the processor puts
    before and after a picture's placeholders (in its bidirectional image block where
    the model has one, ``typed_markers``); ``tokens``: a picture's placeholder count from its inputs, where
    ``get_image_features`` does not give it for one picture alone."""
    config: Any
    cls: type
    picture: Picture
    offsets: Dict[str, Tuple[str, int]] = field(default_factory=dict)
    markers: Tuple[Tuple[int, ...], Tuple[int, ...]] = ((), ())
    typed_markers: bool = False  # whether mm_token_type_ids marks the markers as image
    tokens: Optional[Callable[[Dict[str, torch.Tensor]], int]] = None


def _text(**extra) -> dict:
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
                max_position_embeddings=4096, tie_word_embeddings=False)
    text.update(extra)
    return text


def _pixels(*shape) -> Picture:
    return lambda g: {"pixel_values": torch.randn(*shape, generator=g)}


def _lfm2_vl():
    import transformers as tf
    config = tf.Lfm2VlConfig(
        text_config=_text(model_type="lfm2", layer_types=None, full_attn_idxs=[1],
                          conv_L_cache=3, conv_bias=False, block_multiple_of=2),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                           num_attention_heads=2, num_patches=16, patch_size=4),
        image_token_id=IMAGE_TOKEN, downsample_factor=2, projector_hidden_size=32,
        tie_word_embeddings=False)

    def picture(g):
        return {"pixel_values": torch.randn(1, 64, 3 * 4 * 4, generator=g),
                "spatial_shapes": torch.tensor([[8, 8]]),
                "pixel_attention_mask": torch.ones(1, 64, dtype=torch.int64)}
    return Recipe(config, tf.Lfm2VlForConditionalGeneration, picture)


def _cohere2_vision():
    import transformers as tf
    config = tf.Cohere2VisionConfig(
        text_config=_text(model_type="cohere2", layer_types=["sliding_attention",
                                                             "full_attention"],
                          sliding_window=8),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=8, vision_use_head=False),
        image_token_id=IMAGE_TOKEN, downsample_factor=2, alignment_intermediate_size=32,
        tie_word_embeddings=False)
    return Recipe(config, tf.Cohere2VisionForConditionalGeneration, _pixels(1, 3, 32, 32))


def _ovis2():
    import transformers as tf
    config = tf.Ovis2Config(
        text_config=_text(model_type="qwen2"),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, vocab_size=64,
                           num_hidden_layers=2, num_attention_heads=4, intermediate_size=54,
                           hidden_stride=2),
        image_token_id=IMAGE_TOKEN, visual_indicator_token_ids=[], vocab_size=VOCAB,
        hidden_size=64, tie_word_embeddings=False)
    return Recipe(config, tf.Ovis2ForConditionalGeneration, _pixels(1, 3, 32, 32))


def _granite4_vision():
    import transformers as tf
    config = tf.Granite4VisionConfig(
        text_config=_text(model_type="granite"),
        vision_config=dict(model_type="clip_vision_model", hidden_size=64,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=8, patch_size=2, projection_dim=64),
        image_token_index=IMAGE_TOKEN, image_grid_pinpoints=[[8, 8]], downsample_rate="1/2",
        deepstack_layer_map=[[1, 0]], projector_dropout=0.0, tie_word_embeddings=False,
        qformer_config=dict(intermediate_size=64))

    def picture(g):
        return {"pixel_values": torch.randn(1, 2, 3, 8, 8, generator=g),
                "image_sizes": torch.tensor([[8, 8]])}
    return Recipe(config, tf.Granite4VisionForConditionalGeneration, picture)


def _molmo2():
    import transformers as tf
    from transformers.models.molmo2.configuration_molmo2 import (Molmo2AdapterConfig,
                                                                  Molmo2TextConfig,
                                                                  Molmo2VisionConfig)
    text = _text(rope_theta=10000.0, rms_norm_eps=1e-6)
    text.pop("rope_theta")
    config = tf.Molmo2Config(
        text_config=Molmo2TextConfig(**text),
        vision_config=Molmo2VisionConfig(hidden_size=32, intermediate_size=37,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, head_dim=8, image_size=[16, 16],
                                         patch_size=4),
        adapter_config=Molmo2AdapterConfig(vision_feature_layer=[1], hidden_size=32,
                                           num_attention_heads=4, num_key_value_heads=4,
                                           head_dim=8, intermediate_size=37,
                                           text_hidden_size=64),
        image_start_token_id=VISION_START, image_end_token_id=VISION_END,
        image_patch_id=IMAGE_TOKEN, tie_word_embeddings=False)
    patches = 16  # a 16 x 16 crop in patches of 4

    def picture(g):  # 2 x 2 + 2 x 2 pooled tokens, each pooling 4 of the crop's patches
        pooling = torch.randint(0, patches, (8, 4), generator=g)
        return {"pixel_values": torch.randn(1, patches, 4 * 4 * 3, generator=g),
                "image_token_pooling": pooling,
                "image_grids": torch.tensor([[2, 2, 2, 2]]),
                "image_num_crops": torch.ones(1, dtype=torch.int64)}
    return Recipe(config, tf.Molmo2ForConditionalGeneration, picture,
                  offsets={"image_token_pooling": ("pixel_values", 1)},
                  markers=((VISION_START,), (VISION_END,)), typed_markers=True,
                  tokens=lambda inputs: 8)


def _gemma4():
    import transformers as tf
    layer_types = ["sliding_attention", "full_attention"] * 2
    text = _text(layer_types=layer_types, num_hidden_layers=4, num_kv_shared_layers=2,
                 sliding_window=8, vocab_size_per_layer_input=VOCAB,
                 hidden_size_per_layer_input=16, use_bidirectional_attention="vision",
                 per_layer_config={i: {"head_dim": 32} for i, t in enumerate(layer_types)
                                   if t == "full_attention"})
    config = tf.Gemma4Config(
        text_config=text,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                           patch_size=4, pooling_kernel_size=2, position_embedding_size=64),
        image_token_id=IMAGE_TOKEN, boi_token_id=VISION_START, eoi_token_id=VISION_END,
        video_token_id=VIDEO_TOKEN, audio_token_id=VIDEO_TOKEN + 10,
        tie_word_embeddings=False)
    side = 4  # patches per side: pooled 2 x 2 to 4 tokens

    def picture(g):
        xs, ys = torch.arange(side).repeat(side), torch.arange(side).repeat_interleave(side)
        return {"pixel_values": torch.randn(1, side * side, 4 * 4 * 3, generator=g),
                "image_position_ids": torch.stack([xs, ys], -1).unsqueeze(0)}
    return Recipe(config, tf.Gemma4ForConditionalGeneration, picture,
                  markers=((VISION_START,), (VISION_END,)))


def _vipllava():
    import transformers as tf
    from .families.llava import clip_vision
    config = tf.VipLlavaConfig(
        text_config=_text(model_type="llama"), vision_config=clip_vision(32),
        image_token_index=IMAGE_TOKEN, vision_feature_layers=[-2, -1], image_seq_length=16,
        tie_word_embeddings=False)
    return Recipe(config, tf.VipLlavaForConditionalGeneration, _pixels(1, 3, 16, 16))


def _got_ocr2():
    import transformers as tf
    config = tf.GotOcr2Config(
        text_config=_text(model_type="qwen2"),
        vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2,
                           num_attention_heads=2, image_size=64, patch_size=4, window_size=4,
                           global_attn_indexes=[1], mlp_dim=64),
        image_token_index=IMAGE_TOKEN, tie_word_embeddings=False)
    return Recipe(config, tf.GotOcr2ForConditionalGeneration, _pixels(1, 3, 64, 64))


# model type: (its name as the README lists it, its recipe)
RECIPES = {
    "vipllava": ("VipLLaVA", _vipllava),
    "got_ocr2": ("GOT-OCR 2", _got_ocr2),
    "gemma4": ("Gemma 4", _gemma4),
    "molmo2": ("Molmo 2", _molmo2),
    "granite4_vision": ("Granite 4 Vision", _granite4_vision),
    "lfm2_vl": ("LFM2-VL", _lfm2_vl),
    "cohere2_vision": ("Cohere 2 Vision", _cohere2_vision),
    "ovis2": ("Ovis 2", _ovis2),
}


def tiny_newest(model_type: str, seed: int = 0, attn_implementation: str = "sdpa"
                ) -> Tuple[torch.nn.Module, Recipe]:
    """A tiny random ``model_type`` model (one of :data:`RECIPES`) and its recipe."""
    if model_type not in RECIPES:
        raise ValueError(f"headscope.hf.tiny_newest: model_type must be one of "
                         f"{sorted(RECIPES)}, got {model_type!r}")
    recipe = RECIPES[model_type][1]()
    recipe.config.get_text_config(decoder=True)._attn_implementation_internal = \
        attn_implementation
    torch.manual_seed(seed)
    model = recipe.cls(recipe.config).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model, recipe


def feature_count(model, inputs: Dict[str, torch.Tensor]) -> int:
    """How many image features the model scatters into placeholders for ``inputs``."""
    with torch.no_grad():
        out = model.model.get_image_features(**inputs)
    pooled = getattr(out, "pooler_output", out)
    if pooled is None:  # features added at decoder layers only (Granite 4 Vision)
        pooled = out.deepstack_features[0][1]
    if isinstance(pooled, (list, tuple)):
        return sum(int(p.reshape(-1, p.shape[-1]).shape[0]) for p in pooled)
    return int(pooled.reshape(-1, pooled.shape[-1]).shape[0])


def newest_rows(model, recipe: Recipe, text_before: Sequence[int] = (3,),
                text_after: Sequence[int] = (5,), seed: int = 0) -> List[Dict[str, Any]]:
    """Prompts of one picture each, unpadded: row b is ``text_before[b]`` text tokens, the
    picture's placeholders (between the recipe's markers) and ``text_after[b]`` text
    tokens, with the picture's inputs and ``mm_token_type_ids`` (1 on the picture) where
    the model takes them."""
    g = torch.Generator().manual_seed(seed)
    before, after = (torch.tensor(m, dtype=torch.int64) for m in recipe.markers)
    typed = "mm_token_type_ids" in inspect.signature(model.forward).parameters
    rows = []
    for nb, na in zip(text_before, text_after):
        inputs = recipe.picture(g)
        count = recipe.tokens(inputs) if recipe.tokens else feature_count(model, inputs)
        image = torch.cat([before, torch.full((count,), IMAGE_TOKEN), after])
        text = [torch.randint(1, IMAGE_TOKEN, (n,), generator=g) for n in (nb, na)]
        ids = torch.cat([text[0], image, text[1]])[None]
        row = dict(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs)
        if typed:
            on_image = torch.ones(len(image)) if recipe.typed_markers else torch.cat(
                [torch.zeros(len(before)), torch.ones(count), torch.zeros(len(after))])
            row["mm_token_type_ids"] = torch.cat(
                [torch.zeros(nb), on_image, torch.zeros(na)]).to(torch.int32)[None]
        rows.append(row)
    return rows


def batch_rows(recipe: Recipe, rows: Sequence[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """The rows of :func:`newest_rows` as one left-padded batch, their pictures' inputs
    concatenated as a processor does."""
    T = max(r["input_ids"].shape[1] for r in rows)
    out = {}
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in rows[0]:
            out[key] = torch.cat([torch.nn.functional.pad(
                r[key], (T - r[key].shape[1], 0), value=PAD if key == "input_ids" else 0)
                for r in rows])
    for key in rows[0]:
        if key in out:
            continue
        parts, shift = [], 0
        for r in rows:
            parts.append(r[key] + shift if key in recipe.offsets else r[key])
            if key in recipe.offsets:
                source, dim = recipe.offsets[key]
                shift += r[source].shape[dim]
        out[key] = torch.cat(parts)
    return out


def newest_prompt(model, recipe: Recipe, text_before: Sequence[int] = (3,),
                  text_after: Sequence[int] = (5,), seed: int = 0) -> Dict[str, torch.Tensor]:
    """A left-padded batch of :func:`newest_rows`."""
    return batch_rows(recipe, newest_rows(model, recipe, text_before, text_after, seed))
