"""The tests' side of Kimi K2.5 (``headscope.hf.families.kimi_k25``): the tiny random models,
one picture's prompt as the processor lays it out, the real processor sized to the tiny
vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.kimi_k25 import KimiK25
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START

MEDIA_CONTENT = MARKER_IDS[0]  # <|media_content|>, between <|media_begin|> and the picture

# the tiny models' MLA decoder (DeepSeek-V3 as its transformers tests build it): latent keys
# and values of rank 16, rope and no-rope parts of 8, one dense layer then 4 experts; the
# queries low-rank as in the checkpoints (a full-rank q_proj is taken for the vision
# tower's when the model is saved: Kimi K2.5's weight conversion matches "attn.q_proj")
MLA_TEXT = dict(model_type="deepseek_v3", kv_lora_rank=16, q_lora_rank=16,
                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                first_k_dense_replace=1)


@register_tiny(KimiK25)
class TinyKimiK25(TinyFamily):
    spec = TinySpec(
        tokens={"<|media_pad|>": IMAGE_TOKEN, "<|kimi_k25_video_placeholder|>": VIDEO_TOKEN,
                "<|media_begin|>": VISION_START, "<|media_end|>": VISION_END,
                "<|media_content|>": MEDIA_CONTENT, "[EOS]": EOS},
        tokenizer_extras={"image_token": "<|media_pad|>",
                          "video_token": "<|kimi_k25_video_placeholder|>"},
        chat_template=llava_template(
            "<|media_begin|><|media_content|><|media_pad|><|media_end|> "),
        effects={"kimi_k25": ("mask",)})

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        """MLA_TEXT's decoder (as many key/value heads as query heads), a MoonViT of patches
        of 4 pooled 2 x 2, as Kimi K2.5's transformers tests build them."""
        import transformers as tf
        text = {k: v for k, v in text.items() if k != "head_dim"}
        text.update(MLA_TEXT, num_key_value_heads=text["num_attention_heads"])
        config = tf.Kimi_K25Config(
            text_config=text,
            vision_config=dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, pos_emb_time=2,
                               num_attention_heads=2, num_hidden_layers=2,
                               hidden_size=vision_hidden, intermediate_size=64),
            projection_hidden_size=vision_hidden, tie_word_embeddings=False, **ids)
        return config, tf.Kimi_K25ForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        vc = model.config.vision_config
        kh, kw = vc.merge_kernel_size
        tokens = torch.full(((grid[0] // kh) * (grid[1] // kw),), IMAGE_TOKEN)
        ids = torch.cat([torch.tensor([VISION_START, MEDIA_CONTENT]), tokens,
                         torch.tensor([VISION_END])])
        pixels = torch.randn(grid[0] * grid[1], 3, vc.patch_size, vc.patch_size,
                             generator=generator)
        return ids, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, *grid]])}

    def processor(self, model_type: str, tokenizer, *, max_pixels: int,
                  longest_edge: int, **_):
        """Patches of 4 pixels pooled 2 x 2, pictures shrunk to at most ``max_pixels``
        and ``longest_edge`` pixels a side."""
        import transformers as tf
        side = longest_edge // 4  # the image processor's limit per side, in patches
        images = tf.Kimi_K25ImageProcessor(size={"max_height": side, "max_width": side},
                                           patch_size=4, merge_size=2,
                                           max_patches=max_pixels // 16)
        video = tf.Kimi_K25VideoProcessor(patch_size=4, merge_size=2)
        return tf.Kimi_K25Processor(image_processor=images, tokenizer=tokenizer,
                                    video_processor=video,
                                    chat_template=self.spec.chat_template)
