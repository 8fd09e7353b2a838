"""The shapes world and headscope's embedded tiny VLM.

    model, processor, head = headscope.shapes.load()   # the model shipped in the package
    image, objects = headscope.shapes.scene(seed, num_objects)
    inputs = headscope.shapes.prompt(processor, image)  # "Describe the image."
    ids = model.generate(**inputs, max_new_tokens=48)

``load(MIXER_DIR)`` is the same model trained with mixer attention in its vision tower.
``load(VIDEO_DIR)`` is the video model: ``frames, objects = clip(seed, num_objects)``, then
``clip_prompt(processor, frames)`` ("Describe the video.").
``python -m headscope.shapes train|demo|accuracy|latency|data|hallucination|faithfulness|
head-eval|mixer|reproduce``; see docs/shapes.md.
Needs ``transformers`` (``pip install headscope[hf]``).
"""
from .clips import (CLIP_PROMPT, ClipObject, ClipSentence, clip, describe_clip,
                    match_clip_object, parse_clip_description, parse_clip_sentence)
from .model import MIXER_DIR, VIDEO_DIR, clip_prompt, load, prompt
from .world import (COLOURS, IMAGE_SIZE, PLACES, PROMPT, SHAPES, SceneObject, describe,
                    match_object, parse_description, parse_sentence, scene)

__all__ = ["CLIP_PROMPT", "COLOURS", "ClipObject", "ClipSentence", "IMAGE_SIZE", "MIXER_DIR",
           "PLACES", "PROMPT", "SHAPES", "SceneObject", "VIDEO_DIR", "clip", "clip_prompt",
           "describe", "describe_clip", "load", "match_clip_object", "match_object",
           "parse_clip_description", "parse_clip_sentence", "parse_description",
           "parse_sentence", "prompt", "scene"]
