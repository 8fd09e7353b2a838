"""The tests' side of Gemma 4 (``headscope.hf.families.gemma4``): the tiny random models, one
picture's prompt as the processor lays it out, the real processor sized to the tiny vision
tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.gemma4 import Gemma4
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START
from .gemma3 import alternating_layers

# The tiny models' audio tokens: the processor needs their names on the tokenizer
AUDIO_TOKEN, AUDIO_START, AUDIO_END = MARKER_IDS[:3]
TINY_PATCH = 4        # the tiny vision tower's patch size in pixels
TINY_POOLING = 2      # its pooling kernel: 2 x 2 patches to a token
TINY_SOFT_TOKENS = 70  # the image processor's least budget of tokens per picture
# the KV-shared layers the tiny models add after their own (the checkpoints' last layers
# reuse the keys and values of the last earlier layer of their type): a sliding and a full
TINY_KV_SHARED = 2


@register_tiny(Gemma4)
class TinyGemma4(TinyFamily):
    spec = TinySpec(
        tokens={"<|image|>": IMAGE_TOKEN, "<|video|>": VIDEO_TOKEN,
                "<start_of_image>": VISION_START, "<end_of_image>": VISION_END,
                "<audio_soft_token>": AUDIO_TOKEN, "<start_of_audio>": AUDIO_START,
                "<end_of_audio>": AUDIO_END, "<eos>": EOS},
        tokenizer_extras={"image_token": "<|image|>", "video_token": "<|video|>",
                          "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                          "audio_token": "<audio_soft_token>", "boa_token": "<start_of_audio>",
                          "eoa_token": "<end_of_audio>"},
        chat_template=llava_template("<|image|> "), grids=((4, 4), (3, 2)),
        effects={"gemma4": ("mask", "zero")})

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        """The caller's ``num_hidden_layers`` and :data:`TINY_KV_SHARED` KV-shared layers
        after them, sliding and full in turn (a window of 8, shorter than the prompts);
        full layers of twice the head size, per-layer inputs, soft-capped logits."""
        import transformers as tf
        layers = text["num_hidden_layers"] + TINY_KV_SHARED
        types = alternating_layers(layers)
        text = dict(text, num_hidden_layers=layers, layer_types=types, sliding_window=8,
                    num_kv_shared_layers=TINY_KV_SHARED, use_bidirectional_attention="vision",
                    vocab_size_per_layer_input=text["vocab_size"],
                    hidden_size_per_layer_input=16, final_logit_softcapping=30.0,
                    per_layer_config={i: {"head_dim": 2 * text["head_dim"]}
                                      for i, t in enumerate(types) if t == "full_attention"})
        # patch positions up to the longest side the processor's budget allows
        longest = TINY_SOFT_TOKENS * TINY_POOLING
        vision = dict(hidden_size=vision_hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                      patch_size=TINY_PATCH, pooling_kernel_size=TINY_POOLING,
                      position_embedding_size=longest)
        return tf.Gemma4Config(
            text_config=text, vision_config=vision, image_token_id=ids["image_token_id"],
            boi_token_id=ids["vision_start_token_id"], eoi_token_id=ids["vision_end_token_id"],
            video_token_id=ids["video_token_id"], audio_token_id=AUDIO_TOKEN,
            boa_token_id=AUDIO_START, eoa_token_index=AUDIO_END,
            tie_word_embeddings=False), tf.Gemma4ForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the picture's rows x cols tokens; its patches random, padded to the
        image processor's least budget as the processor pads them."""
        vc = model.config.vision_config
        k = int(vc.pooling_kernel_size)
        height, width = grid[0] * k, grid[1] * k  # in patches
        budget = TINY_SOFT_TOKENS * k * k
        pixels = torch.zeros(1, budget, 3 * vc.patch_size ** 2)
        pixels[0, :height * width] = torch.rand(height * width, pixels.shape[-1],
                                                generator=generator)
        positions = torch.full((1, budget, 2), -1, dtype=torch.int64)
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        positions[0, :height * width] = torch.stack([xs.flatten(), ys.flatten()], -1)
        tokens = torch.full((grid[0] * grid[1],), IMAGE_TOKEN)
        ids = torch.cat([torch.tensor([VISION_START]), tokens, torch.tensor([VISION_END])])
        return ids, {"pixel_values": pixels, "image_position_ids": positions}

    def processor(self, model_type: str, tokenizer, **_):
        """Patches of 4 pixels pooled 2 x 2, at most 70 tokens a picture."""
        import transformers as tf
        sizes = dict(patch_size=TINY_PATCH, pooling_kernel_size=TINY_POOLING,
                     max_soft_tokens=TINY_SOFT_TOKENS)
        return tf.Gemma4Processor(
            feature_extractor=tf.Gemma4AudioFeatureExtractor(),
            image_processor=tf.Gemma4ImageProcessor(**sizes),
            video_processor=tf.Gemma4VideoProcessor(**sizes), tokenizer=tokenizer,
            image_seq_length=TINY_SOFT_TOKENS, chat_template=self.spec.chat_template)
