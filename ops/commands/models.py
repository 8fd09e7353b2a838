"""A model and its processor for the commands: the folder ``--model`` names (a local
folder or a hub id in the local cache, never a download), its config, processor and model
loaded with a one-line error for each way that fails, the device ``--device`` picks (the
process's own GPU under torchrun), the decoder's traced sizes, and a prompt's model inputs
through the chat template. ``collect``, ``eval``, ``explain``, ``vas`` and the benchmarks
load models with it."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch

from .errors import UsageError
from .torchrun import local_rank


def device(args) -> torch.device:
    """The device of ``--device``, else this process's GPU if any, else the CPU."""
    if args.device:
        return torch.device(args.device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def model_folder(name: str) -> Path:
    """The folder of ``--model``: a local folder (as save_pretrained writes), or the
    snapshot of a hub id in the local Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``;
    nothing is downloaded)."""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import constants, snapshot_download
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - a bad id or one not in the cache: same answer
        raise UsageError(f"--model {name}: no such folder, nor a model in the local Hugging "
                         f"Face cache {constants.HF_HUB_CACHE}; allowed: a model folder, or a "
                         f"hub id fetched first with `hf download {name}`") from e


def load_config(folder: str):
    """The config of a local transformers model folder."""
    import transformers as tf
    try:
        return tf.AutoConfig.from_pretrained(model_folder(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {folder}: no readable config.json: {e}") from e


def load_processor(folder: str):
    """The processor of a local transformers model folder; it must have a chat template."""
    import transformers as tf
    try:
        processor = tf.AutoProcessor.from_pretrained(model_folder(folder),
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {folder}: its processor cannot be loaded with "
                         f"from_pretrained: {e}") from e
    if getattr(processor, "chat_template", None) is None:
        raise UsageError(f"--model {folder}: its processor has no chat template")
    return processor


def load_model(folder: str, dtype: str, device: torch.device):
    """Model and processor of a local transformers folder (no network)."""
    import transformers as tf
    processor = load_processor(folder)
    try:
        model = tf.AutoModelForImageTextToText.from_pretrained(
            model_folder(folder), dtype=getattr(torch, dtype), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {folder}: cannot be loaded with from_pretrained: {e}") from e
    return model.to(device).eval(), processor


def text_sizes(config) -> tuple:
    """(traced layers, attention heads) of the model's text decoder: a hybrid decoder's
    softmax attention layers only (its ``layer_types`` of an attention kind), as the
    Tracer traces them."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    layers = sum(t in SOFTMAX_LAYER_TYPES for t in types) if types \
        else int(text.num_hidden_layers)
    return layers, int(text.num_attention_heads)


# transformers' layer types of softmax attention (a hybrid's others: "linear_attention",
# "conv", ...)
SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def chat_inputs(processor, prompt: str, images: List, device) -> Dict[str, torch.Tensor]:
    """The model inputs (batch of 1) of a user turn of ``images`` then the text ``prompt``,
    through the processor's chat template (:func:`headscope.explainer.prompt_inputs`), on
    ``device``."""
    from ..explainer import prompt_inputs as chat
    return {k: v.to(device) for k, v in chat(processor, images, prompt).items()}
