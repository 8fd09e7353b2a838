"""InternVL's layout (headscope.hf.families.internvl) against its real processor
(InternVLProcessor with a tiny GotOcr2ImageProcessor and tokenizer, built offline): the
canvas read back from pixel_values' tiles equals the processor's own choice
(get_optimal_tiled_canvas) on several aspect ratios, views and boxes follow it, a
four-coloured picture's tokens (tiles and thumbnail) read the colour of their box's
quarter, and grid_regions(2, 2) gives each quarter one region in every view."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")

from conftest import (assert_canvas_views, assert_every_image_token_placed,  # noqa: E402
                      assert_tile_quarters_are_regions, assert_tiles_need_pixel_values,
                      patch_pixels, tile_colours)
from headscope.hf import Tracer  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing.families.internvl import IMAGE_END, IMAGE_START  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, assert_quarter_colours, quarters,  # noqa: E402
                                  tiny_model, tiny_processor)

TILE = 16  # the tiny processor's tile side in pixels
MAX_TILES = 6
# (height, width): one tile, square, 2:1 wide, 1:2 tall, 1:3 tall, 5:1 wide, odd sizes
SIZES = ((16, 16), (40, 40), (30, 60), (60, 30), (60, 20), (20, 100), (50, 70))
COLOURS = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0]], np.uint8)


@pytest.fixture(scope="module")
def model():
    return tiny_model("internvl")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("internvl", max_tiles=MAX_TILES)


def run_processor(processor, sizes, per_row):
    texts = ["describe " + " and ".join(["<IMG_CONTEXT>"] * n) + " the image ." for n in per_row]
    return processor(text=texts, images=[quarters(*s, COLOURS) for s in sizes],
                     return_tensors="pt", padding=True)


def processor_canvas(size) -> tuple:
    """(rows, cols) the image processor tiles a picture of ``size`` on."""
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas
    cols, rows = get_optimal_tiled_canvas(size, (TILE, TILE), 1, MAX_TILES)
    return rows, cols


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (2, 1, 4)])
def test_canvas_and_views_follow_the_processor(model, processor, per_row):
    config = model.config
    inputs = run_processor(processor, SIZES, per_row)
    images = family_of(model).images(config, inputs)
    ids = inputs["input_ids"]
    want_tokens = processor._get_num_multimodal_tokens(image_sizes=list(SIZES)).num_image_tokens
    picture = 0
    assert [len(row) for row in images] == list(per_row)
    for b, row in enumerate(images):
        for image in row:
            assert_canvas_views(image, *processor_canvas(SIZES[picture]))
            # the processor's own count: the picture's tokens and its two markers
            assert len(image.positions) + 2 == want_tokens[picture]
            p = image.positions
            assert int(ids[b, p.min() - 1]) == IMAGE_START
            assert int(ids[b, p.max() + 1]) == IMAGE_END
            picture += 1
    assert picture == len(SIZES)
    assert_every_image_token_placed(images, ids, IMAGE_TOKEN)


def test_tiles_without_pixel_values_raise(model, processor):
    inputs = run_processor(processor, ((30, 60),), (1,))
    assert_tiles_need_pixel_values(model, inputs)


def token_pixels(model, tile: torch.Tensor) -> torch.Tensor:
    """(tokens, pixels, channels) of one tile (C, S, S), in the model's token order: the
    vision tower's patch convolution (patches row-major, checked against the convolution)
    and the model's pixel shuffle of the patch grid."""
    conv = model.model.vision_tower.embeddings.patch_embeddings.projection
    patches = patch_pixels(conv, tile)
    p, S = conv.kernel_size[0], tile.shape[-1]
    side = S // p
    index = torch.arange(side * side, dtype=torch.float64).reshape(1, side, side, 1)
    shuffled = model.model.pixel_shuffle(index, scale_factor=model.config.downsample_ratio)
    which = shuffled.reshape(-1, shuffled.shape[-1]).round().to(torch.int64)  # (tokens, 4)
    return patches[which].reshape(which.shape[0], -1, tile.shape[0])


def colours_at(model, processor, inputs, b: int, first_tile: int, positions) -> torch.Tensor:
    """(len(positions), pixels): the colour index of each pixel read by the tokens at
    ``positions`` of row ``b``, whose picture's tiles start at ``first_tile``."""
    return tile_colours(processor, inputs, b, first_tile, positions,
                        lambda tile: token_pixels(model, tile), IMAGE_TOKEN)


@pytest.mark.parametrize("size", SIZES)
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    colours = colours_at(model, processor, inputs, 0, 0, image.positions)
    assert_quarter_colours(image.boxes, colours)


def test_grid_regions_give_each_quarter_one_region_in_every_view(model, processor):
    inputs = run_processor(processor, ((40, 40), (30, 60), (60, 20)), (1, 1, 1))
    assert_tile_quarters_are_regions(model, inputs, lambda b, first_tile, positions: colours_at(
        model, processor, inputs, b, first_tile, positions))


def test_ward_regions_cluster_on_the_stitched_tiles(model, processor):
    """Ward regions are found on the tiles stitched into one grid; the thumbnail's tokens
    join the region covering most of their box."""
    inputs = run_processor(processor, ((60, 20),), (1,))
    seen = []

    def labels(features, grid):
        seen.append(grid)
        return (torch.arange(grid[0] * grid[1]) // grid[1] >= grid[0] // 2).to(torch.int64)

    with torch.no_grad(), Tracer(model, regions=labels, vas=False) as tr:
        model(**inputs)
    (image,) = tr.images[0]
    assert seen == [(6, 2)]  # 3 x 1 tiles of 2 x 2 tokens
    rid = tr.region_ids[0, image.positions]
    top = (image.boxes[:, 1] + image.boxes[:, 3]) / 2 < 0.5
    assert torch.equal(rid, (~top).to(torch.int64))  # tiles and thumbnail alike
