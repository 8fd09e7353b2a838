"""HunYuan-VL's layout (headscope.hf.families.hunyuan_vl, model type "hunyuan_vl") against
its real processor (HunYuanVLProcessor with a tiny image processor and tokenizer, built
offline): each picture's grid, newline, begin and end slots for several aspect ratios,
which of the patch merger's outputs each patch reaches (the slots none), a four-coloured
picture whose tokens' pixels must lie where their boxes say, and grid_regions on it
through the tiny model."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

from conftest import (assert_generation_keeps_regions,  # noqa: E402
                      assert_grids_are_checked, nearest_colour, quarter_prompts)
from headscope.hf import grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.regions import region_ids  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, assert_quarters_are_regions,
                                  tiny_model, tiny_processor)

# (height, width): square, 1:2 wide, 3:1 tall, larger than max_pixels (scaled down), thin,
# and odd sizes
SIZES = ((32, 32), (24, 48), (60, 20), (200, 100), (16, 40), (30, 50))


@pytest.fixture(scope="module")
def model():
    return tiny_model("hunyuan_vl")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("hunyuan_vl")


def run_processor(processor, sizes, per_row):
    return quarter_prompts(processor, sizes, per_row, "<image_start><image><image_end>")


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (2, 1, 3)])
def test_views_follow_the_processors_layout(model, processor, per_row):
    inputs = run_processor(processor, SIZES, per_row)
    images = family_of(model).images(model.config, inputs)
    ids = inputs["input_ids"]
    assert [len(row) for row in images] == list(per_row)
    want_tokens = processor._get_num_multimodal_tokens(image_sizes=SIZES).num_image_tokens
    rid, counts = region_ids(grid_regions(1, 1), images, torch.zeros(*ids.shape, 1))
    picture = 0
    for b, row in enumerate(images):
        for image in row:
            t, h, w = inputs["image_grid_thw"][picture].tolist()
            (view,) = image.views
            assert view.name == "base" and image.grid is view and view.box == (0, 0, 1, 1)
            assert (view.rows, view.cols) == (h // 2, w // 2) and t == 1
            assert view.rows * (view.cols + 1) + 2 == want_tokens[picture]
            # one run of placeholders between the begin and end text tokens: a begin slot,
            # each row's tokens and a newline slot, an end slot
            first = int(image.markers[0])
            run = torch.arange(first, first + want_tokens[picture])
            assert int(ids[b, first - 1]) == VISION_START
            assert int(ids[b, run[-1] + 1]) == VISION_END
            lines = run[1:-1].reshape(view.rows, view.cols + 1)
            assert torch.equal(view.positions, lines[:, :-1].flatten())
            assert image.markers.tolist() == [first, *lines[:, -1].tolist(), int(run[-1])]
            picture += 1
        # every placeholder once, in a view or among the markers; region -1 off the views
        placed = torch.cat([torch.cat([im.positions, im.markers]) for im in row])
        assert torch.equal(placed.sort().values, (ids[b] == IMAGE_TOKEN).nonzero().flatten())
        on_views = torch.zeros_like(ids[b], dtype=torch.bool)
        on_views[torch.cat([im.positions for im in row])] = True
        assert bool((rid[b][on_views] >= 0).all()) and bool((rid[b][~on_views] == -1).all())
        assert counts[b] == len(row)
    assert picture == len(SIZES)


def test_a_grid_that_does_not_match_input_ids_raises(model, processor):
    assert_grids_are_checked(model, run_processor(processor, ((24, 48),), (1,)))


def merger_patches(model, h: int, w: int) -> list:
    """For each output of the vision tower's patch merger on an ``h x w`` grid of patches,
    the patches (indices in the tower's order) it reads: those its gradient reaches."""
    merger = model.model.vision_tower.patch_merger
    hidden = torch.randn(1, h * w, merger.config.hidden_size, dtype=torch.float64)
    merger = merger.double()
    try:
        jacobian = torch.autograd.functional.jacobian(
            lambda x: merger(x, size=(h, w)).sum(-1)[0], hidden)  # (outputs, 1, h*w, C)
    finally:
        merger.float()
    reached = jacobian[:, 0].abs().sum(-1) > 0
    return [row.nonzero().flatten() for row in reached]


def token_colours(model, processor, inputs, picture: int, image) -> torch.Tensor:
    """(tokens, pixels): the index of the nearest quarter colour for each pixel each token
    of ``picture`` (read as ``image``) reads, in the order of ``image.positions``. A patch
    row of ``pixel_values`` holds channels x p x p (the tower's patch convolution reads it
    so), the model scatters the merger's outputs over the picture's placeholders in
    order; the merger's outputs at the marker slots read no patch."""
    vc = model.config.vision_config
    thw = inputs["image_grid_thw"]
    _, h, w = thw[picture].tolist()
    start = int(thw[:picture].prod(-1).sum())
    patches = inputs["pixel_values"][start:start + h * w]
    pixels = patches.reshape(h * w, vc.num_channels, -1).transpose(1, 2)  # (patches, p*p, C)
    which = merger_patches(model, h, w)
    first = int(image.markers[0])
    empty = [first + n for n, reads in enumerate(which) if len(reads) == 0]
    assert empty == image.markers.tolist()
    return torch.stack([nearest_colour(processor, pixels[which[p - first]].reshape(1, -1, 3))[0]
                        for p in image.positions.tolist()])


@pytest.mark.parametrize("size", SIZES)
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    assert_quarter_colours(image.boxes, token_colours(model, processor, inputs, 0, image))


def test_grid_regions_give_each_quarter_one_region_through_the_model(model, processor):
    inputs = run_processor(processor, ((32, 32), (24, 48), (60, 20)), (1, 1, 1))
    assert_quarters_are_regions(
        model, inputs, lambda b, image: token_colours(model, processor, inputs, b, image))


def test_generation_keeps_the_prompts_regions(model, processor):
    inputs = run_processor(processor, ((24, 48), (60, 20), (32, 32)), (2, 1))
    assert_generation_keeps_regions(model, inputs, "image_grid_thw")
