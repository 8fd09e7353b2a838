"""The shapes model: a tiny Qwen2-VL (vision tower and text decoder) sized to train on two
CPU cores, its inputs, and loading it from the package's data folder."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

from ..hf.families.qwen_vl import mrope_section
from .processor import IMAGE_TEXT, MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE
from .world import PROMPT

DATA_DIR = Path(__file__).resolve().parent / "data"
HEAD_FILE = "head.safetensors"
# The same model trained with the mixer (headscope.hf.use_mixer) in its vision tower.
MIXER_DIR = DATA_DIR / "mixer"


def build_model(processor, seed: int, *, hidden: int = 96, layers: int = 3, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 256, vision_width: int = 64,
                vision_depth: int = 2, vision_mlp_ratio: int = 2, mixer_rank: int = 0):
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` for ``processor``'s
    vocabulary, initialised from ``seed``: a text decoder of ``layers`` layers of width
    ``hidden`` (``heads`` query heads sharing ``kv_heads`` key/value heads) and a vision
    tower of ``vision_depth`` blocks of width ``vision_width`` (4 heads) on 8-pixel
    patches, merged 2 x 2 into one image token. ``mixer_rank`` > 0 puts the mixer of that
    rank (:func:`headscope.hf.use_mixer`) in every vision layer in place of softmax
    attention."""
    import transformers as tf

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"headscope.shapes.build_model: 'hidden' ({hidden}) must be a "
                         f"multiple of 'heads' ({heads}) and 'heads' a multiple of "
                         f"'kv_heads' ({kv_heads})")

    tok = processor.tokenizer
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"))}
    head_dim = hidden // heads
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim, max_position_embeddings=256, tie_word_embeddings=True,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=None,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                     mrope_section=mrope_section(head_dim)))
    vision = dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden, num_heads=4,
                  mlp_ratio=vision_mlp_ratio,
                  patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                  temporal_patch_size=TEMPORAL_PATCH_SIZE)
    config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids,
                              tie_word_embeddings=True)
    config.text_config._attn_implementation_internal = "sdpa"
    config.vision_config._attn_implementation_internal = "sdpa"
    torch.manual_seed(seed)
    model = tf.Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.do_sample = False
    if mixer_rank:
        from ..hf.mixer import use_mixer
        use_mixer(model, mixer_rank)
    return model


def prompt(processor, image) -> Dict[str, torch.Tensor]:
    """The model inputs (batch of 1) asking ``processor``'s model to describe ``image``."""
    return processor(text=[IMAGE_TEXT + PROMPT], images=[image], return_tensors="pt")


def training_batch(processor, images: Sequence, answers: Sequence[str]) -> Dict[str, torch.Tensor]:
    """Teacher-forcing inputs for ``images`` and their ``answers`` (right-padded): the
    labels are the answer tokens and the end-of-sequence token, -100 elsewhere."""
    tok = processor.tokenizer
    texts = [IMAGE_TEXT + PROMPT + " " + a + tok.eos_token for a in answers]
    batch = processor(text=texts, images=list(images), return_tensors="pt", padding=True,
                      padding_side="right")
    prompt_length = len(prompt_ids(processor, batch["image_grid_thw"][0]))
    labels = batch["input_ids"].clone()
    labels[:, :prompt_length] = -100
    labels[batch["attention_mask"] == 0] = -100
    batch["labels"] = labels
    return batch


def prompt_ids(processor, grid_thw: torch.Tensor) -> list:
    """The token ids of the prompt for an image of ``grid_thw`` patches."""
    image_tokens = int(grid_thw.prod()) // MERGE_SIZE ** 2
    text = IMAGE_TEXT.replace("<|image_pad|>", "<|image_pad|>" * image_tokens) + PROMPT
    return processor.tokenizer(text)["input_ids"]


def _from_pretrained(cls, path: Path, expected: bool):
    """``cls.from_pretrained(path)`` in eval mode. ``expected``: the checkpoint holds vision
    mixers, which the model gets back after loading: their keys are not reported as
    unexpected (transformers' load report is silenced and checked here instead)."""
    if not expected:
        return cls.from_pretrained(path).eval()
    from transformers.utils import logging as tf_logging

    from ..hf.mixer import is_mixer_key
    verbosity = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        model, info = cls.from_pretrained(path, output_loading_info=True)
    finally:
        tf_logging.set_verbosity(verbosity)
    wrong = {kind: keys for kind, keys in (
        ("missing", list(info["missing_keys"])),
        ("mismatched", [k[0] if isinstance(k, tuple) else k for k in info["mismatched_keys"]]),
        ("unexpected", [k for k in info["unexpected_keys"] if not is_mixer_key(k)]))
        if keys}
    if wrong:
        raise ValueError(f"headscope.shapes.load: {path} does not match its config: {wrong}")
    return model.eval()


def load(path: Optional[Path] = None, *, head: bool = True):
    """``(model, processor, head)`` of the shapes model in ``path`` (default: the one
    shipped in the package's data folder): the model in eval mode on the CPU, its
    ``Qwen2VLProcessor`` (``processor.tokenizer`` is the tokenizer) and its
    :class:`~headscope.AttributionHead` (None when the folder has none or ``head=False``).
    A model trained with vision mixers gets them back with their saved rank."""
    import transformers as tf

    path = Path(path) if path is not None else DATA_DIR
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"headscope.shapes.load: no model in {path} (config.json "
                                f"missing); train one with python -m headscope.shapes train")
    from ..hf.mixer import saved_mixer_rank, use_mixer
    rank = saved_mixer_rank(path)
    model = _from_pretrained(tf.Qwen2VLForConditionalGeneration, path, expected=rank > 0)
    if rank:
        use_mixer(model, rank).load(path)
    processor = tf.AutoProcessor.from_pretrained(path)
    attribution_head = None
    if head and (path / HEAD_FILE).is_file():
        from ..head import AttributionHead
        attribution_head = AttributionHead.load(str(path / HEAD_FILE))
    return model, processor, attribution_head
