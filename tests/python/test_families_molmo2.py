"""Molmo 2's layout (headscope.hf.families.molmo2) against its real processor
(Molmo2Processor with a tiny Molmo2ImageProcessor and tokenizer, built offline): the views'
token grids and boxes follow the image processor's own canvas (compute_crop_geometry) on
several aspect ratios, the markers and the image block (mm_token_type_ids) follow its
prompt, the tiny prompts are the processor's, a four-coloured picture's tokens (global view
and canvas) read the colour of their box's quarter through the patches they pool by index,
and grid_regions(2, 2) gives each quarter one region in both views."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

from conftest import (assert_every_image_token_placed, nearest_colour,  # noqa: E402
                      quarter_prompts)
from headscope.hf import Tracer  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing.families.molmo2 import (COLUMN, LOW_RES_START,  # noqa: E402
                                                  TINY_CROP, TINY_MARGINS, TINY_PATCH,
                                                  TINY_POOL)
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, assert_quarters_are_regions,
                                  image_prompt, tiny_model, tiny_processor)

MAX_CROPS = 6
# (height, width): one crop, square, 2:1 wide, 1:2 tall, 1:5 wide, odd sizes, thin and tall
SIZES = ((20, 20), (40, 40), (30, 60), (60, 30), (20, 100), (50, 70), (90, 13))


@pytest.fixture(scope="module")
def model():
    return tiny_model("molmo2")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("molmo2", max_tiles=MAX_CROPS)


def run_processor(processor, sizes, per_row, global_columns=False):
    """``quarter_prompts`` through the processor, ``<im_col>`` after the global view's
    rows too where ``global_columns`` (the processor's default; the checkpoints' is not)."""
    processor.use_single_crop_col_tokens = None if global_columns else False
    return quarter_prompts(processor, sizes, per_row, "<|image|>")


def pooled_axis(patches: int):
    """(tokens, first, last): a view's tokens along one axis of ``patches`` patches pooled
    in windows of 2, and where the first and last token's edges lie on the picture (the
    padding centred, the extra one after)."""
    tokens = -(-patches // TINY_POOL[0])
    before = (tokens * TINY_POOL[0] - patches) // 2
    return tokens, -before / patches, (tokens * TINY_POOL[0] - before) / patches


def expected_views(size):
    """((rows, cols, box) of the global view, of the canvas), from the canvas that the
    image processor's own compute_crop_geometry chooses for a picture of ``size``."""
    from transformers.models.molmo2.image_processing_molmo2 import compute_crop_geometry
    _, _, height, width = compute_crop_geometry(
        *size, max_crops=MAX_CROPS, overlap_margins=list(TINY_MARGINS), crop_size=TINY_CROP,
        patch_size=TINY_PATCH)
    views = []
    for h, w in ((TINY_CROP, TINY_CROP), (height, width)):
        rows, y0, y1 = pooled_axis(h // TINY_PATCH)
        cols, x0, x1 = pooled_axis(w // TINY_PATCH)
        views.append((rows, cols, (x0, y0, x1, y1)))
    return views


@pytest.mark.parametrize("global_columns", [False, True])
@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (2, 1, 4)])
def test_views_markers_and_block_follow_the_processor(model, processor, per_row,
                                                      global_columns):
    inputs = run_processor(processor, SIZES, per_row, global_columns)
    images = family_of(model).images(model.config, inputs)
    ids, typed = inputs["input_ids"], inputs["mm_token_type_ids"]
    assert [len(row) for row in images] == list(per_row)
    picture = 0
    for b, row in enumerate(images):
        block = torch.zeros(ids.shape[1], dtype=torch.bool)
        for image in row:
            low, canvas = image.views
            assert (low.name, canvas.name) == ("global", "canvas") and image.grid is canvas
            for view, (rows, cols, box) in zip(image.views, expected_views(SIZES[picture])):
                assert (view.rows, view.cols) == (rows, cols)
                assert view.box == pytest.approx(box)
            start, end = int(low.positions[0]) - 1, int(canvas.positions[-1]) + 2
            assert int(ids[b, start]) == LOW_RES_START and int(ids[b, end]) == VISION_END
            # <im_col> after each row of the canvas (and of the global view, where set)
            for view, columns in ((low, global_columns), (canvas, True)):
                after = view.positions.reshape(view.rows, view.cols)[:, -1] + 1
                assert bool((ids[b, after] == COLUMN).all()) == columns
            between = int(low.positions[-1]) + 1 + global_columns
            assert ids[b, between:between + 2].tolist() == [VISION_END, VISION_START]
            markers = 4 + canvas.rows + global_columns * low.rows
            assert end + 1 - start == len(image.positions) + markers
            block[start:end + 1] = True
            picture += 1
        # the image block, markers included, is what the processor types as the picture's
        assert torch.equal(typed[b].bool(), block)
    assert picture == len(SIZES)
    assert_every_image_token_placed(images, ids, IMAGE_TOKEN)


@pytest.mark.parametrize("tiling", [(2, 2), (1, 3), (3, 1)])
def test_tiny_prompts_are_the_processors(model, processor, tiling):
    """``image_prompt``'s pictures of ``tiling`` crops (the contract's prompts) are the
    processor's for pictures it cuts so: tokens, markers, image block, grids, crops and
    pooled indices (shifted past the earlier picture's patches in a batch)."""
    window = TINY_CROP - TINY_PATCH * sum(TINY_MARGINS)  # a crop less its margins
    margin = TINY_PATCH * sum(TINY_MARGINS)
    size = (tiling[0] * window + margin, tiling[1] * window + margin)
    ours = image_prompt(model, grids=((1, 1), tiling), text_before=(2, 2), text_after=(1, 1))
    theirs = run_processor(processor, ((20, 20), size), (1, 1))
    for key in ("image_token_pooling", "image_grids", "image_num_crops"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["pixel_values"].shape == theirs["pixel_values"].shape
    for b in range(2):
        mine, real = (x["input_ids"][b][x["mm_token_type_ids"][b].bool()] for x in (ours, theirs))
        assert torch.equal(mine, real)


def token_colours(processor, inputs) -> torch.Tensor:
    """(image tokens, pixels): the quarter colour (``nearest_colour``) of each pixel of the
    patches each image token pools (``image_token_pooling``'s indices into every crop's
    patches; each patch's pixels row-major, channels last, as the image processor flattens
    them), in the order of the image tokens of ``input_ids`` (a padding slot reads the
    token's first patch again)."""
    pooled = inputs["image_token_pooling"]
    pooled = torch.where(pooled >= 0, pooled, pooled[:, :1])
    patches = inputs["pixel_values"].reshape(-1, TINY_PATCH * TINY_PATCH, 3)
    return nearest_colour(processor, patches[pooled].reshape(len(pooled), -1, 3))


def colours_at(processor, inputs, b: int, positions: torch.Tensor) -> torch.Tensor:
    """The colours (``token_colours``) of the image tokens at ``positions`` of row ``b``."""
    order = (inputs["input_ids"] == IMAGE_TOKEN).nonzero().tolist()
    at = {tuple(p): i for i, p in enumerate(order)}
    return token_colours(processor, inputs)[[at[(b, int(p))] for p in positions]]


@pytest.mark.parametrize("size", SIZES)
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    assert_quarter_colours(image.boxes, colours_at(processor, inputs, 0, image.positions))


def test_grid_regions_give_each_quarter_one_region_in_both_views(model, processor):
    inputs = run_processor(processor, ((40, 40), (30, 60), (60, 20)), (1, 1, 1))
    tr = assert_quarters_are_regions(model, inputs, lambda b, image: colours_at(
        processor, inputs, b, image.positions))
    assert {v.name for (image,) in tr.images for v in image.views} == {"global", "canvas"}


def test_missing_or_inconsistent_pooling_raises(model, processor):
    family = family_of(model)
    inputs = run_processor(processor, ((30, 60),), (1,))
    # plain generate does not hand the forward image_grids: tr.generate does
    with torch.no_grad(), Tracer(model, regions=2, vas=False) as tr:
        with pytest.raises(ValueError, match=r"need the image_grids .* tr\.generate"):
            model.generate(**inputs, max_new_tokens=1)
        assert len(list(tr.generate(**inputs, max_new_tokens=1))) == 1
    with pytest.raises(ValueError, match="video prompt"):
        family.images(model.config, dict(inputs, video_grids=torch.tensor([[2, 3, 6]])))
    for key in ("image_grids", "image_token_pooling"):
        with pytest.raises(ValueError, match=f"need the {key} .* tr.generate"):
            family.images(model.config, dict(inputs, **{key: None}))
    pooled = inputs["image_token_pooling"]
    with pytest.raises(ValueError, match="image_grids give 33 image tokens but "
                                         "image_token_pooling pools 32"):
        family.images(model.config, dict(inputs, image_token_pooling=pooled[:-1]))
    with pytest.raises(ValueError, match="do not pool a picture's global crop"):
        family.images(model.config, dict(inputs, image_token_pooling=pooled.flip(1)))
    doubled = pooled.clone()
    doubled[-1] = doubled[-2]  # a canvas patch pooled twice, another never
    with pytest.raises(ValueError, match="do not cover one grid of patches, each once"):
        family.images(model.config, dict(inputs, image_token_pooling=doubled))


def test_pictures_quarters_reach_the_crops(processor):
    """The check's premise: the global crop and the canvas's crops hold the picture's
    quarter colours where the layout puts them (a 40 x 40 picture: the global crop's
    top-left patch red, the canvas's last crop's bottom-right patch yellow)."""
    inputs = run_processor(processor, ((40, 40),), (1,))
    patches = inputs["pixel_values"].reshape(len(inputs["pixel_values"]), -1,
                                             TINY_PATCH * TINY_PATCH, 3)
    colours = nearest_colour(processor, patches[[0, -1], :, :, :].reshape(2, -1, 3))
    colours = colours.reshape(2, -1, TINY_PATCH * TINY_PATCH)
    assert bool((colours[0, 0] == 0).all()) and bool((colours[1, -1] == 3).all())
