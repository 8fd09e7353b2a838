"""Tiny randomly initialised transformers VLMs, their processors and checkpoints, and the
checks the tests share: what the tests and ``python -m headscope.bench --family hf`` run on,
built from configs (no downloads).

``tiny_model(family)`` gives a model of one of :data:`FAMILIES`, all with grouped-query
attention in the text decoder; ``image_prompt(model, grids, text_before, text_after)``
gives its inputs for one image per prompt (random pixels), in the layout its processor
would produce, left-padded when the rows differ in length (``models.py``).
``tiny_checkpoint(folder, family)`` saves such a model with its real processor
(``tiny_processor``) for ``from_pretrained``, and ``tiny_dataset(folder, count)`` writes
synthetic images in the DATA format of ``python -m headscope collect``
(``checkpoint.py``). Each family's tiny models, prompts, processor and test choices are
its module in ``families/`` (``tiny_of(family)``), the shared token ids ``tokens.py``'s;
``newest.py`` holds the tiny models of model types that have no family module. The
geometry tests' pictures and checks are ``geometry.py``'s, the eager reference
``reference.py``'s.
"""
from .checkpoint import special_tokens, tiny_dataset, tiny_processor, tiny_tokenizer
from .families import tiny_of
from .geometry import assert_quarter_colours, assert_quarters_are_regions, quarters
from .models import FAMILIES, image_prompt, tiny_checkpoint, tiny_model
from .reference import eager_reference
from .spec import TinyFamily, TinySpec, llava_template
from .tokens import EOS, IMAGE_TOKEN, PAD, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB

__all__ = ["EOS", "FAMILIES", "IMAGE_TOKEN", "PAD", "TinyFamily", "TinySpec", "VIDEO_TOKEN",
           "VISION_END", "VISION_START", "VOCAB", "assert_quarter_colours",
           "assert_quarters_are_regions", "eager_reference", "image_prompt", "llava_template",
           "quarters", "special_tokens", "tiny_checkpoint", "tiny_dataset", "tiny_model",
           "tiny_of", "tiny_processor", "tiny_tokenizer"]
