"""Kimi K2.5's layout (headscope.hf.families.kimi_k25, model type "kimi_k25") against its
real processor (Kimi_K25Processor with a tiny image processor and tokenizer, built
offline): each picture's grid and the box it covers past the picture's padding, by the
image processor's own resize, for several aspect ratios; a four-coloured picture whose
tokens' pixels (gathered by the vision tower's own pooling) lie where their boxes say;
grid_regions on it through the tiny model (an MLA decoder)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

from conftest import (QUARTER_COLOURS, assert_every_image_token_placed,  # noqa: E402
                      assert_generation_keeps_regions, assert_grids_are_checked,
                      nearest_colour, quarter_prompts)
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing.families.kimi_k25 import MEDIA_CONTENT  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END,  # noqa: E402
                                  assert_quarter_colours, assert_quarters_are_regions,
                                  tiny_model, tiny_processor)

# (height, width): square, 1:2 wide, 3:1 tall, larger than the patch budget (shrunk),
# thin, and odd sizes (padded right and bottom)
SIZES = ((32, 32), (24, 48), (60, 20), (200, 100), (16, 40), (30, 50))
BLACK = len(QUARTER_COLOURS)  # the padding's colour index in token_colours


@pytest.fixture(scope="module")
def model():
    return tiny_model("kimi_k25")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("kimi_k25")


def run_processor(processor, sizes, per_row):
    return quarter_prompts(processor, sizes, per_row,
                           "<|media_begin|><|media_content|><|media_pad|><|media_end|>")


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (2, 1, 3)])
def test_views_follow_the_processors_layout(model, processor, per_row):
    from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize
    inputs = run_processor(processor, SIZES, per_row)
    images = family_of(model).images(model.config, inputs)
    ids = inputs["input_ids"]
    assert [len(row) for row in images] == list(per_row)
    want_tokens = processor._get_num_multimodal_tokens(image_sizes=SIZES).num_image_tokens
    ip = processor.image_processor
    picture = 0
    for b, row in enumerate(images):
        for image in row:
            t, h, w = inputs["image_grid_thw"][picture].tolist()
            (view,) = image.views
            assert view.name == "base" and image.grid is view and t == 1
            assert (view.rows, view.cols) == (h // 2, w // 2)
            assert view.rows * view.cols == want_tokens[picture]
            # the grid covers the padded canvas: past the shrunk picture on its right and
            # bottom, by the image processor's own resize
            (rh, rw), (ph, pw) = navit_resize(*SIZES[picture], ip.patch_size, ip.merge_size,
                                              ip.max_patches, ip.size["max_height"])
            assert (ph, pw) == (h * ip.patch_size, w * ip.patch_size)
            assert view.box == pytest.approx((0, 0, pw / rw, ph / rh), abs=1e-12)
            first, last = int(view.positions[0]), int(view.positions[-1])
            assert torch.equal(view.positions, torch.arange(first, last + 1))
            assert int(ids[b, first - 1]) == MEDIA_CONTENT and int(ids[b, last + 1]) == VISION_END
            picture += 1
    assert picture == len(SIZES)
    assert_every_image_token_placed(images, ids, IMAGE_TOKEN)


def test_a_layout_without_its_inputs_raises(model, processor):
    assert_grids_are_checked(model, run_processor(processor, ((24, 48),), (1,)),
                             ("image_grid_thw", "pixel_values"))


def test_a_black_edge_is_read_as_padding_by_less_than_one_token(model, processor):
    """The padding is black, like a picture's own black edge: the reading takes at most
    the processor's padding (less than one token) of it."""
    from headscope.hf.testing import quarters
    dark = quarters(32, 48, ((255, 0, 0), (0, 0, 0), (0, 0, 255), (0, 0, 0)))  # right half black
    inputs = processor(text=["<|media_begin|><|media_content|><|media_pad|><|media_end|>"],
                       images=[dark], return_tensors="pt")
    (image,), = family_of(model).images(model.config, inputs)
    _, x1 = image.grid.box[0], image.grid.box[2]
    assert 1.0 < x1 <= 48 / (48 - 8 + 1)


def token_colours(model, processor, inputs, picture: int) -> torch.Tensor:
    """(tokens, pixels): the nearest of the quarter colours and black for each pixel each
    token of ``picture`` reads, in the model's token order: the vision tower's own pooling
    (``temporal_merge``) run on each patch's index gathers the patches of each token, and a
    patch of ``pixel_values`` is channels x p x p, as its patch convolution reads it."""
    tower = model.model.vision_tower
    thw = inputs["image_grid_thw"][picture:picture + 1]
    start = int(inputs["image_grid_thw"][:picture].prod(-1).sum())
    count = int(thw.prod())
    index = torch.arange(count, dtype=torch.float32)[:, None]
    which = tower.temporal_merge(index, thw, *tower.merge_kernel_size).round().long()[..., 0]
    patches = inputs["pixel_values"][start:start + count]
    pixels = patches.flatten(2).transpose(1, 2)[which].flatten(1, 2)  # (tokens, k*p*p, C)
    return nearest_colour(processor, pixels, QUARTER_COLOURS + ((0, 0, 0),))


@pytest.mark.parametrize("size", SIZES)
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    colours = token_colours(model, processor, inputs, 0)
    assert bool((colours != BLACK).any(1).all())  # no token lies wholly in the padding
    assert_quarter_colours(image.boxes, colours, ignore=BLACK)


def test_grid_regions_give_each_quarter_one_region_through_the_model(model, processor):
    # a padded picture, and a tall one whose right column of tokens lies within the picture
    inputs = run_processor(processor, ((32, 32), (30, 50), (64, 24)), (1, 1, 1))
    assert_quarters_are_regions(
        model, inputs, lambda b, image: token_colours(model, processor, inputs, b))


def test_generation_keeps_the_prompts_regions(model, processor):
    inputs = run_processor(processor, ((24, 48), (60, 20), (30, 50)), (2, 1))
    assert_generation_keeps_regions(model, inputs, "image_grid_thw")
