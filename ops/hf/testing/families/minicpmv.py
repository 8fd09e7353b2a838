"""The tests' side of MiniCPM-V 4.6 (``headscope.hf.families.minicpmv``): the tiny random
models, one picture's prompt as the processor lays it out, the real processor sized to the
tiny vision tower, and the shared tests' choices."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ...families.minicpmv import MiniCPMV, merge_factor
from ...families.qwen_vl import mrope_section
from ..spec import TinyFamily, TinySpec, llava_template, register_tiny
from ..tokens import EOS, IMAGE_TOKEN, MARKER_IDS, VIDEO_TOKEN, VISION_END, VISION_START
from .qwen_vl import qwen3_5_text

# the tiny models' markers of slices and picture numbers, and the newline between rows of
# slices
SLICE_START, SLICE_END = MARKER_IDS[0], MARKER_IDS[1]
IMAGE_ID_START, IMAGE_ID_END = MARKER_IDS[2], MARKER_IDS[3]
NEWLINE = MARKER_IDS[4]
UNKNOWN = 1  # the tiny word-level tokenizer's id of a word it lacks (a picture's number)


@register_tiny(MiniCPMV)
class TinyMiniCPMV(TinyFamily):
    spec = TinySpec(
        tokens={"<|image_pad|>": IMAGE_TOKEN, "<|video_pad|>": VIDEO_TOKEN,
                "<image>": VISION_START, "</image>": VISION_END, "<slice>": SLICE_START,
                "</slice>": SLICE_END, "<image_id>": IMAGE_ID_START,
                "</image_id>": IMAGE_ID_END, "\n": NEWLINE, "<|endoftext|>": EOS},
        tokenizer_extras={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                          "image_start_token": "<image>", "image_end_token": "</image>",
                          "slice_start_token": "<slice>", "slice_end_token": "</slice>",
                          "image_id_start_token": "<image_id>",
                          "image_id_end_token": "</image_id>"},
        chat_template=llava_template("<|image_pad|> "),
        grids=((8, 16), (16, 8)), cat_dims={"pixel_values": -1},
        effects={"minicpmv4_6": ("zero",)})

    def config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
               ids: Dict[str, int]):
        import transformers as tf
        rope = dict(rope_type="default", rope_theta=10000.0,
                    mrope_section=mrope_section(text["head_dim"]))
        text = qwen3_5_text({"model_type": "qwen3_5_text", **text}, rope)
        vision = dict(hidden_size=vision_hidden, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, image_size=32, patch_size=4)
        return tf.MiniCPMV4_6Config(
            text_config=text, vision_config=vision, image_token_id=ids["image_token_id"],
            video_token_id=ids["video_token_id"], image_size=32, drop_vision_last_layer=False,
            insert_layer_id=0, tie_word_embeddings=False), tf.MiniCPMV4_6ForConditionalGeneration

    def image(self, model, grid: Tuple[int, int], generator: torch.Generator
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """A picture numbered 0 whose source view is ``grid`` patches, cut into two
        slices along its longer side (2 x 1 slices of a square one), each slice half of
        ``grid``: as the processor lays out such a picture."""
        h, w = grid
        R, C = (2, 1) if h >= w else (1, 2)
        sizes = [(h, w)] + [(h // R, w // C)] * (R * C)
        fh, fw = merge_factor(model.config)
        image = [torch.full(((sh // fh) * (sw // fw),), IMAGE_TOKEN) for sh, sw in sizes]
        ids = [torch.tensor([IMAGE_ID_START, UNKNOWN, IMAGE_ID_END, VISION_START]), image[0],
               torch.tensor([VISION_END])]
        for k, tokens in enumerate(image[1:]):
            if k and k % C == 0:
                ids.append(torch.tensor([NEWLINE]))
            ids += [torch.tensor([SLICE_START]), tokens, torch.tensor([SLICE_END])]
        vc = model.config.vision_config
        patches = sum(sh * sw for sh, sw in sizes)
        pixels = torch.randn(1, vc.num_channels, vc.patch_size, patches * vc.patch_size,
                             generator=generator)
        return torch.cat(ids), {"pixel_values": pixels,
                                "target_sizes": torch.tensor(sizes, dtype=torch.int32)}

    def processor(self, model_type: str, tokenizer, *, max_tiles: int, **_):
        """Patches of 4 pixels; a picture larger than 32 x 32 pixels gets up to
        ``max_tiles`` slices of about 32 x 32."""
        import transformers as tf
        sizes = dict(patch_size=4, scale_resolution=32, max_slice_nums=max_tiles)
        return tf.MiniCPMV4_6Processor(
            image_processor=tf.MiniCPMV4_6ImageProcessor(**sizes),
            video_processor=tf.MiniCPMV4_6VideoProcessor(**sizes), tokenizer=tokenizer,
            chat_template=self.spec.chat_template)
