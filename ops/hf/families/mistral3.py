"""Mistral 3 (Pixtral vision tower): one grid per picture, resized to multiples of
``patch_size * spatial_merge_size`` keeping its aspect ratio, laid out row by row with an
``[IMG_BREAK]`` after each row and ``[IMG_END]`` after the last (markers, not image
tokens); ``image_sizes`` gives each picture's processed size."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..tiny import EOS, IMAGE_TOKEN, MARKER_IDS
from .base import Family, TinySpec, llava_template, missing_input, register
from .layout import ImageTokens, View, image_positions, runs, split_images

WHO = "headscope.hf.Tracer"

# The tiny models' marker tokens
IMAGE_BREAK = MARKER_IDS[2]  # [IMG_BREAK]
IMAGE_END = MARKER_IDS[3]    # [IMG_END]


@register
class Mistral3(Family):
    name = "mistral3"
    titles = ("Mistral 3",)
    model_types = ("mistral3",)
    layout = ("one grid per picture (its processed size / (patch x merge)), rows separated "
              "by [IMG_BREAK], ended by [IMG_END]")
    # plain generate hands the model the vision output (its per-picture token counts), not
    # image_sizes; each picture's first run of image tokens then gives its width
    input_keys = ("image_sizes", "mm_encoder_outputs")
    tiny = TinySpec(tokens={"[IMG]": IMAGE_TOKEN, "[IMG_BREAK]": IMAGE_BREAK,
                            "[IMG_END]": IMAGE_END, "</s>": EOS},
                    chat_template=llava_template("[IMG] "), effects={"mistral3": ("mask",)},
                    commands=("mistral3",))

    def grids(self, config, image_sizes) -> List[Tuple[int, int]]:
        """Each picture's token grid (rows, cols) from its processed ``(height, width)``, as
        the model's projector merges it (``image_sizes // (patch_size * merge)``)."""
        step = int(config.vision_config.patch_size) * int(config.spatial_merge_size)
        return [(int(h) // step, int(w) // step) for h, w in torch.as_tensor(image_sizes).tolist()]

    def images(self, config, inputs: Dict[str, Any]) -> List[List[ImageTokens]]:
        sizes = inputs.get("image_sizes")
        encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
        if sizes is not None:
            grids = self.grids(config, sizes)
            counts = [r * c for r, c in grids]
        elif encoded is not None:
            grids, counts = None, [len(t) for t in encoded.pooler_output]
        else:
            raise missing_input(config, "image_sizes")
        per_row = image_positions(inputs["input_ids"], self.image_token_ids(config))
        pictures = split_images(WHO, per_row, counts)
        grid = iter(grids) if grids is not None else None
        out = []
        for row in pictures:
            images = []
            for positions in row:
                rows, cols = next(grid) if grid is not None else _grid_of_runs(positions)
                _check_rows(positions, rows, cols)
                images.append(ImageTokens((View("base", positions, rows, cols),)))
            out.append(images)
        return out

    # ---- tiny models ----------------------------------------------------------------------

    def tiny_config(self, model_type: str, text: Dict[str, Any], vision_hidden: int,
                    ids: Dict[str, int]):
        import transformers as tf
        # The real checkpoints' text models have no sliding window; MistralConfig's own
        # default is 4096.
        return tf.Mistral3Config(
            text_config=dict({"model_type": "mistral", "sliding_window": None}, **text),
            vision_config=dict(model_type="pixtral", hidden_size=vision_hidden,
                               intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, head_dim=vision_hidden // 2,
                               image_size=64, patch_size=4),
            image_token_index=ids["image_token_id"], spatial_merge_size=2,
            vision_feature_layer=-1, tie_word_embeddings=False), \
            tf.Mistral3ForConditionalGeneration

    def tiny_image(self, model, grid: Tuple[int, int], generator: torch.Generator
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``grid``: the picture's patch grid (even sizes)."""
        vc = model.config.vision_config
        patch, merge = vc.patch_size, model.config.spatial_merge_size
        rows, cols = grid[0] // merge, grid[1] // merge
        ids = torch.full((rows, cols + 1), IMAGE_TOKEN)
        ids[:, -1] = IMAGE_BREAK
        ids[-1, -1] = IMAGE_END
        size = (grid[0] * patch, grid[1] * patch)
        pixels = torch.randn(1, vc.num_channels, *size, generator=generator)
        return ids.flatten(), {"pixel_values": pixels, "image_sizes": torch.tensor([size])}

    def tiny_processor(self, model_type: str, tokenizer, *, longest_edge: int, **_):
        """Longest edge ``longest_edge`` pixels, sides rounded up to multiples of 8,
        patches of 4 merged 2 x 2."""
        import transformers as tf
        images = tf.PixtralImageProcessor(size={"longest_edge": longest_edge})
        return tf.PixtralProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                   spatial_merge_size=2, chat_template=self.tiny.chat_template)


def _grid_of_runs(positions: torch.Tensor) -> Tuple[int, int]:
    """(rows, cols) of a picture of ``len(positions)`` tokens whose first row is its first
    run of consecutive positions."""
    cols = len(runs(positions)[0])
    if len(positions) % cols:
        raise ValueError(f"{WHO}: a picture of {len(positions)} image tokens does not split "
                         f"into rows of {cols} (its first run of image tokens)")
    return len(positions) // cols, cols


def _check_rows(positions: torch.Tensor, rows: int, cols: int) -> None:
    """A picture's tokens must be ``rows`` runs of ``cols`` consecutive positions, each
    run one marker (``[IMG_BREAK]``) after the last."""
    at = positions.reshape(rows, cols)
    within = bool((at[:, 1:] - at[:, :-1] == 1).all())
    between = bool((at[1:, 0] - at[:-1, -1] == 2).all())
    if not (within and between):
        raise ValueError(f"{WHO}: a picture of {rows}x{cols} tokens is not laid out as "
                         f"{rows} rows of {cols} image tokens, each followed by one break "
                         f"token, in input_ids (image_sizes do not describe input_ids)")
