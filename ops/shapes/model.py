"""The shapes models: a tiny Qwen2-VL (vision tower and text decoder) sized to train on two
CPU cores, its inputs (a picture, or a clip of the shapes world in time) and loading it
from the package's data folder."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from ..hf.families.qwen_vl import mrope_section
from .clips import CLIP_PROMPT, FPS
from .processor import IMAGE_TEXT, MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, VIDEO_TEXT
from .world import PROMPT

DATA_DIR = Path(__file__).resolve().parent / "data"
HEAD_FILE = "head.safetensors"
# The same model trained with the mixer (headscope.hf.use_mixer) in its vision tower.
MIXER_DIR = DATA_DIR / "mixer"
# The video model: trained on clips (headscope.shapes.clip), its vocabulary the clips'.
VIDEO_DIR = DATA_DIR / "video"


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


def clip_prompt(processor, frames) -> Dict[str, torch.Tensor]:
    """The model inputs (batch of 1) asking ``processor``'s video model to describe the clip
    of ``frames`` (PIL images, as :func:`~headscope.shapes.clip` draws them): ``input_ids``
    with the video's ``<|video_pad|>`` tokens, ``pixel_values_videos`` and
    ``video_grid_thw``, as ``Qwen2VLProcessor`` lays them out."""
    return processor(text=[VIDEO_TEXT + CLIP_PROMPT], **_videos([frames]), return_tensors="pt")


def _videos(clips: Sequence) -> dict:
    """The processor's video arguments for ``clips`` (each a list of frames): each clip as
    one ``(frames, height, width, 3)`` array and its timeline (``FPS`` frames per second),
    from which the video processor samples its frames."""
    videos = [np.stack([np.asarray(frame) for frame in frames]) for frames in clips]
    return {"videos": videos,
            "video_metadata": [{"total_num_frames": len(v), "fps": FPS} for v in videos]}


def training_batch(processor, visuals: Sequence, answers: Sequence[str], *,
                   video: bool = False) -> Dict[str, torch.Tensor]:
    """Teacher-forcing inputs for ``visuals`` (images; with ``video``, clips as lists of
    frames) and their ``answers`` (right-padded): the labels are the answer tokens and the
    end-of-sequence token, -100 elsewhere."""
    tok = processor.tokenizer
    request = VIDEO_TEXT + CLIP_PROMPT if video else IMAGE_TEXT + PROMPT
    texts = [request + " " + a + tok.eos_token for a in answers]
    media = _videos(visuals) if video else {"images": list(visuals)}
    batch = processor(text=texts, **media, return_tensors="pt", padding=True,
                      padding_side="right")
    grid = batch["video_grid_thw" if video else "image_grid_thw"][0]
    prompt_length = len(prompt_ids(processor, grid, video=video))
    labels = batch["input_ids"].clone()
    labels[:, :prompt_length] = -100
    labels[batch["attention_mask"] == 0] = -100
    batch["labels"] = labels
    return batch


def prompt_ids(processor, grid_thw: torch.Tensor, *, video: bool = False) -> list:
    """The token ids of the prompt for an image (``video``: a video) of ``grid_thw``
    patches."""
    tokens = int(grid_thw.prod()) // MERGE_SIZE ** 2
    if video:
        text = VIDEO_TEXT.replace("<|video_pad|>", "<|video_pad|>" * tokens) + CLIP_PROMPT
    else:
        text = IMAGE_TEXT.replace("<|image_pad|>", "<|image_pad|>" * tokens) + PROMPT
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


def start_from(model, processor, folder: Path) -> None:
    """Copies the weights of the shapes model in ``folder`` into ``model`` (built with the
    same sizes for ``processor``): every weight as it is, and the token embeddings (tied
    to the output layer) of the folder's vocabulary, which ``processor``'s must extend with
    the same ids (as the video model's extends the picture model's); the rows of the words
    it adds keep ``model``'s own initialisation."""
    source, source_processor, _ = load(folder, head=False)
    theirs, ours = source_processor.tokenizer.get_vocab(), processor.tokenizer.get_vocab()
    if any(ours.get(word) != i for word, i in theirs.items()):
        raise ValueError(f"headscope.shapes.start_from: the vocabulary of {folder} is not the "
                         f"first {len(theirs)} words of the new model's")
    weights, start = model.state_dict(), source.state_dict()
    if weights.keys() != start.keys():
        raise ValueError(f"headscope.shapes.start_from: {folder} holds other weights than the "
                         f"new model: {sorted(weights.keys() ^ start.keys())[:3]}")
    with torch.no_grad():
        for name, weight in weights.items():
            value = start[name]
            rows = (len(ours), len(theirs))
            if value.shape == weight.shape:
                weight.copy_(value)
            elif (weight.shape[0], value.shape[0]) == rows and weight.shape[1:] == value.shape[1:]:
                weight[:len(theirs)].copy_(value)
            else:
                raise ValueError(f"headscope.shapes.start_from: {name} is {tuple(value.shape)} "
                                 f"in {folder}, {tuple(weight.shape)} in the new model; train "
                                 f"with the sizes of {folder / 'config.json'}")
