"""Aya Vision's layout (headscope.hf.families.aya_vision) against its real processor
(AyaVisionProcessor with a tiny GotOcr2ImageProcessor and tokenizer, built offline): the
canvas read back from pixel_values' tiles equals the processor's own choice
(get_optimal_tiled_canvas) on several aspect ratios, views, markers and token counts follow
its prompt, a four-coloured picture's tokens (tiles and thumbnail) read the colour of their
box's quarter through the model's patches and pixel shuffle, and grid_regions(2, 2) gives
each quarter one region in every view."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

from conftest import (assert_canvas_views, assert_every_image_token_placed,  # noqa: E402
                      assert_tile_quarters_are_regions, assert_tiles_need_pixel_values,
                      patch_pixels, quarter_prompts, tile_colours)
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing.families.aya_vision import TILE, TILE_GLOBAL  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, tiny_model, tiny_processor)

TILE_PIXELS = 16  # the tiny processor's tile side in pixels
MAX_TILES = 6
# (height, width): one tile, square, 2:1 wide, 1:2 tall, 1:3 tall, 5:1 wide, odd sizes
SIZES = ((16, 16), (40, 40), (30, 60), (60, 30), (60, 20), (20, 100), (50, 70))


@pytest.fixture(scope="module")
def model():
    return tiny_model("aya_vision")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("aya_vision", max_tiles=MAX_TILES)


def run_processor(processor, sizes, per_row):
    return quarter_prompts(processor, sizes, per_row, "<image>")


def processor_canvas(size) -> tuple:
    """(rows, cols) the image processor tiles a picture of ``size`` on."""
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas
    cols, rows = get_optimal_tiled_canvas(size, (TILE_PIXELS, TILE_PIXELS), 1, MAX_TILES)
    return rows, cols


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (2, 1, 4)])
def test_canvas_and_views_follow_the_processor(model, processor, per_row):
    inputs = run_processor(processor, SIZES, per_row)
    images = family_of(model).images(model.config, inputs)
    ids = inputs["input_ids"]
    patches = processor._get_num_multimodal_tokens(image_sizes=list(SIZES)).num_image_patches
    assert [len(row) for row in images] == list(per_row)
    picture = 0
    for b, row in enumerate(images):
        for image in row:
            rows, cols = processor_canvas(SIZES[picture])
            assert_canvas_views(image, rows, cols)
            p = image.positions
            if rows * cols == 1:
                assert ids[b, p.min() - 2:p.min()].tolist() == [VISION_START, TILE_GLOBAL]
            else:
                # "TILE_k" before each tile: TILE and the word "_k"
                for view in image.views[:-1]:
                    assert int(ids[b, view.positions.min() - 2]) == TILE
                assert int(ids[b, image.views[-1].positions.min() - 1]) == TILE_GLOBAL
                assert int(ids[b, p.min() - 3]) == VISION_START
            # the processor's own count of tiles (the thumbnail among them), 4 tokens each
            assert len(p) == 4 * patches[picture]
            assert int(ids[b, p.max() + 1]) == VISION_END
            picture += 1
    assert picture == len(SIZES)
    assert_every_image_token_placed(images, ids, IMAGE_TOKEN)


def test_tiles_without_pixel_values_raise(model, processor):
    inputs = run_processor(processor, ((30, 60),), (1,))
    assert_tiles_need_pixel_values(model, inputs)
    family = family_of(model)
    cut = inputs["input_ids"].clone()
    cut[0, (cut[0] == IMAGE_TOKEN).nonzero()[0]] = 1  # a tile one token short
    with pytest.raises(ValueError, match="a run of 3 image tokens"):
        family.images(model.config, dict(inputs, input_ids=cut))


def token_pixels(model, tile: torch.Tensor) -> torch.Tensor:
    """(tokens, pixels, channels) of one tile (C, S, S), in the model's token order: the
    SigLIP patch convolution (patches row-major, checked against the convolution) and the
    projector's pixel shuffle of the patch grid."""
    conv = model.model.vision_tower.embeddings.patch_embedding
    patches = patch_pixels(conv, tile)
    p, S = conv.kernel_size[0], tile.shape[-1]
    index = torch.arange((S // p) ** 2, dtype=torch.float64).reshape(1, -1, 1)
    shuffled = model.model.multi_modal_projector.pixel_shuffle(index)
    which = shuffled.reshape(-1, shuffled.shape[-1]).round().to(torch.int64)  # (tokens, 4)
    return patches[which].reshape(which.shape[0], -1, tile.shape[0])


def colours_at(model, processor, inputs, b: int, first_tile: int, positions) -> torch.Tensor:
    """(len(positions), pixels): the colour index of each pixel read by the tokens at
    ``positions`` of row ``b``, whose picture's tiles start at ``first_tile``."""
    return tile_colours(processor, inputs, b, first_tile, positions,
                        lambda tile: token_pixels(model, tile), IMAGE_TOKEN)


def test_pixel_shuffle_keeps_tokens_row_major(model):
    """Token (i, j) of a tile's 2 x 2 grid holds the 2 x 2 patches at rows 2i, 2i + 1 and
    columns 2j, 2j + 1 of its 4 x 4 patch grid."""
    index = torch.arange(16, dtype=torch.float64).reshape(1, 16, 1)
    shuffled = model.model.multi_modal_projector.pixel_shuffle(index).reshape(4, 4)
    held = [sorted(int(v) for v in shuffled[token]) for token in range(4)]
    assert held == [[4 * (2 * i + di) + 2 * j + dj for di in (0, 1) for dj in (0, 1)]
                    for i in range(2) for j in range(2)]


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
