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
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from .families.llava import clip_vision
from .tokens import EOS, IMAGE_TOKEN, PAD, VOCAB

Picture = Callable[[torch.Generator], Dict[str, torch.Tensor]]


@dataclass
class Recipe:
    """A tiny model's config and class, and ``picture(generator)``: one picture's model
    inputs."""
    config: Any
    cls: type
    picture: Picture


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


def _vipllava():
    import transformers as tf
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
    "granite4_vision": ("Granite 4 Vision", _granite4_vision),
    "lfm2_vl": ("LFM2-VL", _lfm2_vl),
    "cohere2_vision": ("Cohere 2 Vision", _cohere2_vision),
    "ovis2": ("Ovis 2", _ovis2),
}


def tiny_newest(model_type: str, seed: int = 0, attn_implementation: str = "sdpa"
                ) -> Tuple[torch.nn.Module, Recipe]:
    """A tiny random ``model_type`` model (one of :data:`RECIPES`) and its recipe."""
    if model_type not in RECIPES:
        raise ValueError(f"headscope.hf.testing.newest: model_type must be one of "
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
    picture's placeholders and ``text_after[b]`` text
    tokens, with the picture's inputs and ``mm_token_type_ids`` (1 on the picture) where
    the model takes them."""
    g = torch.Generator().manual_seed(seed)
    typed = "mm_token_type_ids" in inspect.signature(model.forward).parameters
    rows = []
    for nb, na in zip(text_before, text_after):
        inputs = recipe.picture(g)
        count = feature_count(model, inputs)
        image = torch.full((count,), IMAGE_TOKEN)
        text = [torch.randint(1, IMAGE_TOKEN, (n,), generator=g) for n in (nb, na)]
        ids = torch.cat([text[0], image, text[1]])[None]
        row = dict(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs)
        if typed:
            row["mm_token_type_ids"] = torch.cat(
                [torch.zeros(nb), torch.ones(count), torch.zeros(na)]).to(torch.int32)[None]
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
        out[key] = torch.cat([r[key] for r in rows])
    return out


def newest_prompt(model, recipe: Recipe, text_before: Sequence[int] = (3,),
                  text_after: Sequence[int] = (5,), seed: int = 0) -> Dict[str, torch.Tensor]:
    """A left-padded batch of :func:`newest_rows`."""
    return batch_rows(recipe, newest_rows(model, recipe, text_before, text_after, seed))
