"""The shapes world and headscope's embedded tiny VLM.

    model, processor, head = headscope.shapes.load()   # the model shipped in the package
    image, objects = headscope.shapes.scene(seed, num_objects)
    inputs = headscope.shapes.prompt(processor, image)  # "Describe the image."
    ids = model.generate(**inputs, max_new_tokens=48)

``load(MIXER_DIR)`` is the same model trained with mixer attention in its vision tower.
``python -m headscope.shapes train|demo|accuracy|latency|data|hallucination|faithfulness|
head-eval|mixer|reproduce``; see docs/shapes.md.
Needs ``transformers`` (``pip install headscope[hf]``).
"""
from .model import MIXER_DIR, load, prompt
from .world import (COLOURS, IMAGE_SIZE, PLACES, PROMPT, SHAPES, SceneObject, describe,
                    match_object, parse_description, parse_sentence, scene)

__all__ = ["COLOURS", "IMAGE_SIZE", "MIXER_DIR", "PLACES", "PROMPT", "SHAPES", "SceneObject", "describe",
           "load", "match_object", "parse_description", "parse_sentence", "prompt", "scene"]
