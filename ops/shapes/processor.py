"""The shapes models' processor: a word-level tokenizer over the shapes world's words (and,
for the video model, the clips' words after them), Qwen2-VL's image processor at the
world's image size and its video processor sampling a clip's frames at that size, saved so
that ``AutoProcessor.from_pretrained`` loads it offline."""
from __future__ import annotations

from .clips import FRAMES, clip_words
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
VIDEO_TEXT = "<|vision_start|><|video_pad|><|vision_end|>"
# The models were trained on the image (or video) followed by the request, no role markers:
# the chat template renders a one-turn message as exactly that, so tools that build prompts
# with apply_chat_template give the model what it knows.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}" + IMAGE_TEXT + "{% elif c['type'] == 'video' %}"
    + VIDEO_TEXT + "{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}")


def words(video: bool = False) -> list:
    """Every word of the prompts and descriptions, in a fixed order; ``video``: the clips'
    words after the pictures', so a picture word has the same id in both vocabularies."""
    found = ["A", "An", *COLOURS, *SHAPES, "."]
    for text in [PROMPT] + [phrase for _, phrase in PLACES.values()]:
        found += text.replace(".", " .").split()
    if video:
        found += clip_words()
    return list(dict.fromkeys(found))


def build_processor(video: bool = False):
    """A ``Qwen2VLProcessor`` with the word-level tokenizer (special tokens first, then
    :func:`words`), an image processor that keeps images at ``IMAGE_SIZE`` square and a
    video processor that keeps frames at that size and samples ``FRAMES`` of a video
    uniformly (a clip's frames are all of them). ``video``: the vocabulary holds the clips'
    words (the video model's processor)."""
    import transformers as tf

    from ..hf.tokenizer import word_level_tokenizer
    fast = word_level_tokenizer([*SPECIAL_TOKENS, *words(video)], SPECIAL_TOKENS,
                                "<|endoftext|>")
    pixels = IMAGE_SIZE * IMAGE_SIZE
    sizes = dict(min_pixels=pixels, max_pixels=pixels, patch_size=PATCH_SIZE,
                 merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE)
    frames = dict(do_sample_frames=True, num_frames=FRAMES, cap_pixels_per_frame=True)
    return tf.Qwen2VLProcessor(image_processor=tf.Qwen2VLImageProcessor(**sizes),
                               tokenizer=fast,
                               video_processor=tf.Qwen2VLVideoProcessor(**sizes, **frames),
                               chat_template=CHAT_TEMPLATE)
