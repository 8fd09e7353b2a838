"""The tests' side of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE
(``headscope.hf.families.qwen_vl``): the tiny random models, one picture's prompt as the
processor lays it out, the real processor sized to the tiny vision tower, and the shared
tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.qwen_vl import QwenVL, mrope_section
from ..spec import TinyFamily, TinySpec, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START

# Qwen-VL's chat template, reduced to what a one-turn image prompt needs.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen3_5_config(model_type: str, text: Dict[str, Any], rope: Dict[str, Any],
                   vision: Dict[str, Any], ids: Dict[str, int]):
    """A tiny Qwen3.5 (or -MoE): gated delta nets and softmax layers in turn, the last a
    softmax layer, as in the checkpoints; the Qwen3-VL vision tower without deepstack."""
    import transformers as tf
    hybrid = qwen3_5_text(text, rope)
    vision = {k: v for k, v in vision.items() if k != "deepstack_visual_indexes"}
    if model_type == "qwen3_5":
        return tf.Qwen3_5Config(text_config=hybrid, vision_config=vision,
                                tie_word_embeddings=False, **ids), \
            tf.Qwen3_5ForConditionalGeneration
    hybrid.update(num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=text["intermediate_size"] // 2,
                  shared_expert_intermediate_size=text["intermediate_size"] // 2)
    return tf.Qwen3_5MoeConfig(text_config=hybrid, vision_config=vision,
                               tie_word_embeddings=False, **ids), \
        tf.Qwen3_5MoeForConditionalGeneration


def patch_width(vision_config) -> int:
    """The numbers in one patch row of ``pixel_values``: channels x frames x p x p (Cosmos 3
    Edge's tower names its channels ``num_channels`` and takes one frame a patch)."""
    channels = getattr(vision_config, "in_channels", None) or vision_config.num_channels
    frames = getattr(vision_config, "temporal_patch_size", 1)
    return channels * frames * vision_config.patch_size ** 2


def qwen3_5_text(text: Dict[str, Any], rope: Dict[str, Any]) -> Dict[str, Any]:
    """A tiny Qwen3.5 text config (also MiniCPM-V 4.6's decoder): gated delta nets and
    softmax layers in turn, the last a softmax layer, as in the checkpoints; the entries
    of ``text`` win."""
    layers = text["num_hidden_layers"]
    hybrid = dict(layer_types=["full_attention" if i % 2 else "linear_attention"
                               for i in range(layers)],
                  linear_conv_kernel_dim=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4)
    hybrid.update(text)
    hybrid["rope_parameters"] = rope
    return hybrid


@register_tiny(QwenVL)
class TinyQwenVL(TinyFamily):
    spec = TinySpec(
        tokens={"<|image_pad|>": IMAGE_TOKEN, "<|video_pad|>": VIDEO_TOKEN,
                "<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END,
                "<|endoftext|>": EOS, "<|im_start|>": MARKER_IDS[0],
                "<|im_end|>": MARKER_IDS[1]},
        tokenizer_extras={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                          "vision_bos_token": "<|vision_start|>",
                          "vision_eos_token": "<|vision_end|>"},
        chat_template=QWEN_TEMPLATE,
        effects={"qwen2_vl": ("mask", "zero", "mean"), "qwen3_vl": ("mask", "zero", "mean")},
        unseen_region_effects=("qwen2_vl",),
        geometry_waiver="each picture is one grid of image_grid_thw's patches merged 2 x 2, "
                        "the numbers the processor writes and the model reads; the commands' "
                        "tests run the real Qwen2-VL processor end to end")

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        head_dim = text["head_dim"]
        rope = dict(rope_type="default", rope_theta=10000.0,
                    mrope_section=mrope_section(head_dim))
        merge = dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
        if model_type == "qwen2_vl":
            return tf.Qwen2VLConfig(
                text_config=dict(text, rope_parameters=rope),
                vision_config=dict(depth=1, embed_dim=vision_hidden, hidden_size=text["hidden_size"],
                                   num_heads=2, **merge), **ids), \
                tf.Qwen2VLForConditionalGeneration
        if model_type == "qwen2_5_vl":
            return tf.Qwen2_5_VLConfig(
                text_config=dict(text, rope_parameters=rope),
                vision_config=dict(depth=2, hidden_size=vision_hidden, intermediate_size=64,
                                   num_heads=2, out_hidden_size=text["hidden_size"],
                                   window_size=16, fullatt_block_indexes=[1], **merge),
                **ids), tf.Qwen2_5_VLForConditionalGeneration
        rope["mrope_interleaved"] = True
        vision = dict(depth=2, hidden_size=vision_hidden, intermediate_size=64, num_heads=2,
                      out_hidden_size=text["hidden_size"], num_position_embeddings=64,
                      deepstack_visual_indexes=[0], **merge)
        if model_type == "qwen3_vl":
            return tf.Qwen3VLConfig(text_config=dict(text, rope_parameters=rope),
                                    vision_config=vision, **ids), \
                tf.Qwen3VLForConditionalGeneration
        moe = dict(text, rope_parameters=rope, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=text["intermediate_size"] // 2, decoder_sparse_step=1)
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            return qwen3_5_config(model_type, text, rope, vision, ids)
        return tf.Qwen3VLMoeConfig(text_config=moe, vision_config=vision, **ids), \
            tf.Qwen3VLMoeForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        vc = model.config.vision_config
        m = vc.spatial_merge_size
        tokens = torch.full(((grid[0] // m) * (grid[1] // m),), IMAGE_TOKEN)
        ids = torch.cat([torch.tensor([VISION_START]), tokens, torch.tensor([VISION_END])])
        pixels = torch.randn(grid[0] * grid[1], patch_width(vc), generator=generator)
        return ids, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, *grid]])}

    def processor(self, model_type: str, tokenizer, *, min_pixels: int, max_pixels: int,
                  **_):
        """Patches of 4 pixels merged 2 x 2, pictures resized to between ``min_pixels``
        and ``max_pixels``."""
        import transformers as tf
        sizes = dict(patch_size=4, temporal_patch_size=2, merge_size=2)
        images = tf.Qwen2VLImageProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **sizes)
        if model_type in ("qwen2_vl", "qwen2_5_vl"):
            video = tf.Qwen2VLVideoProcessor(**sizes)
            cls = tf.Qwen2VLProcessor if model_type == "qwen2_vl" else tf.Qwen2_5_VLProcessor
        else:
            video, cls = tf.Qwen3VLVideoProcessor(**sizes), tf.Qwen3VLProcessor
        return cls(image_processor=images, tokenizer=tokenizer, video_processor=video,
                   chat_template=self.spec.chat_template)
