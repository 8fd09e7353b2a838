"""The shapes model's processor: a word-level tokenizer over the shapes world's words and
Qwen2-VL's image processor at the world's image size, saved so that
``AutoProcessor.from_pretrained`` loads it offline."""
from __future__ import annotations

from .world import COLOURS, IMAGE_SIZE, PLACES, PROMPT, SHAPES

PATCH_SIZE = 8
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# Every image is IMAGE_SIZE square and kept at that size: a grid of TOKEN_GRID x TOKEN_GRID
# image tokens (after merging MERGE_SIZE x MERGE_SIZE patches).
TOKEN_GRID = IMAGE_SIZE // (PATCH_SIZE * MERGE_SIZE)
SPECIAL_TOKENS = ("<pad>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<unk>")
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
# The model was trained on the image followed by the request, no role markers: the chat
# template renders a one-turn message as exactly that, so tools that build prompts with
# apply_chat_template give the model what it knows.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}" + IMAGE_TEXT + "{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}")


def words() -> list:
    """Every word of the prompts and descriptions, in a fixed order."""
    found = ["A", "An", *COLOURS, *SHAPES, "."]
    for text in [PROMPT] + [phrase for _, phrase in PLACES.values()]:
        found += text.replace(".", " .").split()
    return list(dict.fromkeys(found))


def build_processor():
    """A ``Qwen2VLProcessor`` with the word-level tokenizer (special tokens first, then
    :func:`words`) and an image processor that keeps images at ``IMAGE_SIZE`` square."""
    import transformers as tf

    from ..hf.tokenizer import word_level_tokenizer
    fast = word_level_tokenizer([*SPECIAL_TOKENS, *words()], SPECIAL_TOKENS, "<|endoftext|>")
    pixels = IMAGE_SIZE * IMAGE_SIZE
    sizes = dict(min_pixels=pixels, max_pixels=pixels, patch_size=PATCH_SIZE,
                 merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE)
    return tf.Qwen2VLProcessor(image_processor=tf.Qwen2VLImageProcessor(**sizes),
                               tokenizer=fast,
                               video_processor=tf.Qwen2VLVideoProcessor(**sizes),
                               chat_template=CHAT_TEMPLATE)
