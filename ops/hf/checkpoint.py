"""What makes a tiny model folder load like a real checkpoint, offline: a real processor
for each family of :data:`~headscope.hf.tiny.FAMILIES` (image processor, a small
word-level tokenizer, a chat template, the image special tokens at the tiny vocabulary's
ids), so that :func:`~headscope.hf.testing.tiny_checkpoint` saves a folder that
``AutoProcessor.from_pretrained(folder)`` and
``AutoModelForImageTextToText.from_pretrained(folder)`` load without a hub; and a DATA
folder of synthetic images (``tiny_dataset``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Sequence, Union

from .tiny import EOS, FAMILIES, IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB

# Words of the tiny vocabulary, ids 2.. in this order (0 = padding, 1 = unknown); the
# remaining ids up to the special tokens are filler words w<id>.
WORDS = ("user assistant system . , ! ? : a an the this that is are was of and or to in "
         "on at with what where which who how describe image picture photo shows show see "
         "there it its left right top bottom middle center red green blue yellow black white "
         "big small cat dog car tree house person ball box sky road water one two three "
         "color shape near next above below behind front").split()

# Chat template of the Qwen-VL family, reduced to what a one-turn image prompt needs.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image> "
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


# "<image>" tokens and the LLaVA chat template
LLAVA_FAMILIES = ("llava", "llava_next", "llava_onevision")
MISTRAL3_TEMPLATE = LLAVA_TEMPLATE.replace("<image> ", "[IMG] ")
INTERNVL_TEMPLATE = LLAVA_TEMPLATE.replace("<image> ", "<IMG_CONTEXT> ")
LLAMA4_TEMPLATE = LLAVA_TEMPLATE.replace("<image> ", "<|image|> ")
GLM4V_TEMPLATE = LLAVA_TEMPLATE.replace("<image> ",
                                        "<|begin_of_image|><|image|><|end_of_image|> ")
GEMMA3_TEMPLATE = LLAVA_TEMPLATE.replace("<image> ", "<start_of_image> ")


def special_tokens(family: str) -> Dict[int, str]:
    """The special tokens of ``family``'s tiny vocabulary, by id (the ids
    :mod:`headscope.hf.testing`'s models use)."""
    if family == "llava_onevision":
        return {IMAGE_TOKEN: "<image>", VIDEO_TOKEN: "<video>", EOS: "</s>"}
    if family in LLAVA_FAMILIES:
        return {IMAGE_TOKEN: "<image>", EOS: "</s>"}
    if family == "mistral3":
        from .families.mistral3 import IMAGE_BREAK, IMAGE_END
        return {IMAGE_TOKEN: "[IMG]", IMAGE_BREAK: "[IMG_BREAK]", IMAGE_END: "[IMG_END]",
                EOS: "</s>"}
    if family == "internvl":
        from .families.internvl import IMAGE_END as END, IMAGE_START as START
        return {IMAGE_TOKEN: "<IMG_CONTEXT>", VIDEO_TOKEN: "<video>", START: "<img>",
                END: "</img>", EOS: "</s>"}
    if family in ("idefics3", "smolvlm"):
        from .families.idefics3 import tiny_tokens
        return {**tiny_tokens(), IMAGE_TOKEN: "<image>", EOS: "</s>"}
    if family == "llama4":
        from .families.llama4 import GLOBAL_MARKER, TILE_X_SEPARATOR, TILE_Y_SEPARATOR
        return {IMAGE_TOKEN: "<|patch|>", VISION_START: "<|image_start|>",
                VISION_END: "<|image_end|>", TILE_X_SEPARATOR: "<|tile_x_separator|>",
                TILE_Y_SEPARATOR: "<|tile_y_separator|>", GLOBAL_MARKER: "<|image|>",
                EOS: "</s>"}
    if family == "gemma3":
        return {IMAGE_TOKEN: "<image_soft_token>", VISION_START: "<start_of_image>",
                VISION_END: "<end_of_image>", EOS: "</s>"}
    if family in ("glm4v", "glm4v_moe"):
        from .families.glm4v import VIDEO_END, VIDEO_START
        return {IMAGE_TOKEN: "<|image|>", VIDEO_TOKEN: "<|video|>",
                VISION_START: "<|begin_of_image|>", VISION_END: "<|end_of_image|>",
                VIDEO_START: "<|begin_of_video|>", VIDEO_END: "<|end_of_video|>",
                EOS: "<|endoftext|>"}
    return {IMAGE_TOKEN: "<|image_pad|>", VIDEO_TOKEN: "<|video_pad|>",
            VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>",
            EOS: "<|endoftext|>", EOS + 1: "<|im_start|>", EOS + 2: "<|im_end|>"}


def word_level_tokenizer(tokens: Sequence[str], special: Sequence[str], eos: str,
                         **kwargs):
    """A ``PreTrainedTokenizerFast`` whose ids are the positions in ``tokens`` (which hold
    ``"<pad>"``, ``"<unk>"``, ``eos`` and every ``special`` token, never split): text
    splits on whitespace and punctuation; decoding joins words with spaces and none before
    punctuation ("top left."). ``kwargs`` go to the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.add_special_tokens(list(special))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                   pad_token="<pad>", eos_token=eos, **kwargs)


def tiny_tokenizer(family: str = "qwen2_vl", vocab: int = VOCAB):
    """A word-level tokenizer (:func:`word_level_tokenizer`) of ``vocab`` ids for
    ``family``: padding 0, unknown 1, :data:`WORDS`, filler words, and the family's
    special tokens at the ids of :func:`special_tokens`."""
    special = special_tokens(family)
    words = ["<pad>", "<unk>", *WORDS]
    names = [special.get(i, words[i] if i < len(words) else f"w{i}") for i in range(vocab)]
    if len(set(names)) != vocab or max(special) >= vocab:
        raise ValueError(f"headscope.hf.testing.tiny_tokenizer: vocab must be > {max(special)}, "
                         f"got {vocab}")
    eos = special[max(i for i, n in special.items() if n in ("</s>", "<|endoftext|>"))]
    # the named special tokens the family's processor reads off its tokenizer
    qwen = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"}
    glm = {"image_token": "<|image|>", "video_token": "<|video|>"}
    extra = {} if family in LLAVA_FAMILIES + ("mistral3", "idefics3", "smolvlm", "llama4") else {
        "internvl": {"start_image_token": "<img>", "end_image_token": "</img>",
                     "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        "glm4v": glm, "glm4v_moe": glm,
        "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                   "image_token": "<image_soft_token>"},
    }.get(family, qwen)
    return word_level_tokenizer(names, list(special.values()), eos,
                                extra_special_tokens=extra)


def tiny_processor(family: str = "qwen2_vl", *, min_pixels: int = 16 * 16,
                   max_pixels: int = 48 * 48, longest_edge: int = 64, max_tiles: int = 6):
    """The processor of a tiny ``family`` model (:func:`~headscope.hf.testing.tiny_model`'s
    vision sizes): its transformers image processor (Qwen: patches of 4 pixels, merged
    2 x 2, images resized to between ``min_pixels`` and ``max_pixels``; LLaVA: 16 x 16
    pixels; LLaVA-NeXT and LLaVA-OneVision: a base and tiles of 16 x 16 pixels on the
    canvases of ``tiny_pinpoints``; Mistral 3: longest edge ``longest_edge`` pixels, sides
    rounded up to multiples of 8, patches of 4 merged 2 x 2; InternVL: up to ``max_tiles``
    tiles of 16 x 16 pixels and a thumbnail, 4 tokens each; Idefics3: longest edge 48
    pixels, up to 3 x 3 tiles of 16 x 16 pixels and a global image, 4 tokens each; Llama 4:
    a canvas of up to ``max_tiles`` tiles of 16 x 16 pixels and a global image, 4 tokens
    each; Gemma 3: 32 x 32 pixels, 16 tokens, pan-and-scan when the call asks for it;
    GLM-4.1V: Qwen's sizes), :func:`tiny_tokenizer` and a chat template. All but
    LLaVA need torchvision (their processors do in transformers 5)."""
    import transformers as tf

    tokenizer = tiny_tokenizer(family)
    if family == "llava":
        images = tf.CLIPImageProcessor(size={"shortest_edge": 16},
                                       crop_size={"height": 16, "width": 16})
        return tf.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                 vision_feature_select_strategy="default",
                                 num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE)
    if family == "llava_next":
        from .families.llava import clip_vision
        from .families.llava_next import tiny_pinpoints
        vision = clip_vision(32)
        tile = vision["image_size"]
        images = tf.LlavaNextImageProcessor(size={"shortest_edge": tile},
                                            crop_size={"height": tile, "width": tile},
                                            image_grid_pinpoints=tiny_pinpoints(vision))
        return tf.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer,
                                     patch_size=vision["patch_size"],
                                     vision_feature_select_strategy="default",
                                     num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE)
    if family == "llava_onevision":
        from .families.llava_next import tiny_pinpoints
        from .families.llava_onevision import TINY_ASPECT, tiny_siglip
        vision = tiny_siglip(32)
        tile = vision["image_size"]
        images = tf.LlavaOnevisionImageProcessor(size={"height": tile, "width": tile},
                                                 image_grid_pinpoints=tiny_pinpoints(vision))
        return tf.LlavaOnevisionProcessor(
            image_processor=images, tokenizer=tokenizer,
            video_processor=tf.LlavaOnevisionVideoProcessor(size={"height": tile, "width": tile}),
            num_image_tokens=(tile // vision["patch_size"]) ** 2,
            vision_feature_select_strategy="full", vision_aspect_ratio=TINY_ASPECT,
            chat_template=LLAVA_TEMPLATE)
    if family == "mistral3":
        images = tf.PixtralImageProcessor(size={"longest_edge": longest_edge})
        return tf.PixtralProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                   spatial_merge_size=2, chat_template=MISTRAL3_TEMPLATE)
    if family == "idefics3":
        from .families.idefics3 import TINY_TILE
        images = tf.Idefics3ImageProcessor(size={"longest_edge": 3 * TINY_TILE},
                                           max_image_size={"longest_edge": TINY_TILE})
        return tf.Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                    image_seq_len=4, chat_template=LLAVA_TEMPLATE)
    if family == "llama4":
        from .families.llama4 import TINY_TILE as TILE
        images = tf.Llama4ImageProcessor(size={"height": TILE, "width": TILE},
                                         max_patches=max_tiles)
        return tf.Llama4Processor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                  pixel_shuffle_ratio=0.5, chat_template=LLAMA4_TEMPLATE)
    if family == "gemma3":
        from .families.gemma3 import siglip_vision
        side = siglip_vision(32)["image_size"]
        images = tf.Gemma3ImageProcessor(size={"height": side, "width": side})
        return tf.Gemma3Processor(image_processor=images, tokenizer=tokenizer,
                                  image_seq_length=16, chat_template=GEMMA3_TEMPLATE)
    if family == "internvl":
        images = tf.GotOcr2ImageProcessor(size={"height": 16, "width": 16}, crop_to_patches=True,
                                          min_patches=1, max_patches=max_tiles)
        return tf.InternVLProcessor(image_processor=images, tokenizer=tokenizer,
                                    video_processor=tf.InternVLVideoProcessor(),
                                    image_seq_length=4, chat_template=INTERNVL_TEMPLATE)
    sizes = dict(patch_size=4, temporal_patch_size=2, merge_size=2)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    if family in ("glm4v", "glm4v_moe"):
        return tf.Glm4vProcessor(image_processor=tf.Glm4vImageProcessor(size=size, **sizes),
                                 tokenizer=tokenizer,
                                 video_processor=tf.Glm4vVideoProcessor(**sizes),
                                 chat_template=GLM4V_TEMPLATE)
    images = tf.Qwen2VLImageProcessor(size=size, **sizes)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        video = tf.Qwen2VLVideoProcessor(**sizes)
        cls = tf.Qwen2VLProcessor if family == "qwen2_vl" else tf.Qwen2_5_VLProcessor
    elif family == "qwen3_vl":
        video = tf.Qwen3VLVideoProcessor(**sizes)
        cls = tf.Qwen3VLProcessor
    else:
        raise ValueError(f"headscope.hf.testing.tiny_processor: family must be one of "
                         f"{FAMILIES}, got {family!r}")
    return cls(image_processor=images, tokenizer=tokenizer, video_processor=video,
               chat_template=QWEN_TEMPLATE)


def tiny_dataset(path: Union[str, Path], count: int = 4, *, size: tuple = (48, 40),
                 prompt: str = "describe the image .", seed: int = 0) -> Path:
    """Writes a DATA folder for ``python -m headscope collect|eval`` into ``path``:
    ``count`` PNG images of ``size`` (width, height), each a noisy background with one
    coloured rectangle, and ``data.jsonl`` with one line per image
    (``{"image", "prompt", "boxes": {"box": [x0, y0, x1, y1]}}``). Returns the folder."""
    import json

    import numpy as np
    from PIL import Image

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width, height = size
    lines = []
    for i in range(count):
        pixels = rng.integers(0, 80, (height, width, 3), dtype=np.uint8)
        x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        x1, y1 = x0 + width // 3, y0 + height // 3
        pixels[y0:y1, x0:x1] = rng.integers(128, 256, 3, dtype=np.uint8)
        Image.fromarray(pixels).save(path / f"image{i}.png")
        lines.append(json.dumps({"image": f"image{i}.png", "prompt": prompt,
                                 "boxes": {"box": [x0, y0, x1, y1]}}))
    (path / "data.jsonl").write_text("\n".join(lines) + "\n")
    return path
