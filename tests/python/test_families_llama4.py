"""Llama 4's layout (headscope.hf.families.llama4) against its real processor
(Llama4Processor with a tiny image processor and tokenizer, built offline): the tiles of
the canvas each picture is fitted into, its padding, and the global image, for pictures of
several aspect ratios; four-coloured pictures whose tokens' pixels must lie where their
boxes say; grid_regions giving each quarter's tokens of every view one region.

The tracing contract (tests/python/test_hf.py) is expected to fail for llama4 for now: in
transformers 5.24 Llama4ForConditionalGeneration.forward itself raises (it reads
image_outputs off its language model's output). Its text decoder's chunked and NoPE layers
meet the contract behind LLaVA (test_families_patterns.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
np = pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

from headscope.hf import grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.families.llama4 import tile_side  # noqa: E402
from headscope.hf.testing.families.llama4 import (GLOBAL_MARKER,  # noqa: E402
                                                  TILE_X_SEPARATOR, TILE_Y_SEPARATOR,
                                                  TINY_TILE as TILE)
from headscope.hf.regions import region_ids  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, quarters, tiny_model,
                                  tiny_processor)

# (height, width): one tile, 2 x 2 tiles, 2:1 wide (padding below), 3:1 tall, downscaled
# to fit 6 tiles, and odd sizes whose padding cuts through tokens
SIZES = ((16, 16), (32, 32), (24, 48), (60, 20), (40, 40), (30, 50), (20, 36))
COLOURS = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0]], np.uint8)
BLACK = 4  # the padding's colour index in colour_of


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama4")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("llama4")


def run_processor(processor, sizes, per_row):
    pictures = [quarters(*s, COLOURS) for s in sizes]
    texts = ["describe " + " and ".join(["<|image|>"] * n) + " the image ." for n in per_row]
    return processor(text=texts, images=pictures, return_tensors="pt", padding=True)


def canvas_and_content(processor, height: int, width: int):
    """(rows, cols) of tiles and the picture's (height, width) on them, by the image
    processor's own rules (its best-fit canvas, upscaling to at most one tile, resizing
    without distortion)."""
    from transformers.image_utils import SizeDict
    from transformers.models.llama4.image_processing_llama4 import (
        find_supported_resolutions, get_best_fit, get_max_res_without_distortion)
    ip = processor.image_processor
    size = SizeDict(height=TILE, width=TILE)
    possible = torch.tensor(find_supported_resolutions(max_num_chunks=ip.max_patches,
                                                       patch_size=size))
    canvas = get_best_fit((height, width), possible, resize_to_max_canvas=False)
    limit = (min(max(height, TILE), int(canvas[0])), min(max(width, TILE), int(canvas[1])))
    content = get_max_res_without_distortion((height, width), limit)
    return (int(canvas[0]) // TILE, int(canvas[1]) // TILE), tuple(int(v) for v in content)


def test_pixel_shuffle_keeps_tokens_row_major():
    """What the layout assumes of the model: its pixel shuffle makes each token of a
    patches' grid from one 2 x 2 block of patches, the tokens in row-major order."""
    from transformers.models.llama4.modeling_llama4 import pixel_shuffle
    side = 4
    index = torch.arange(side * side, dtype=torch.float32)[None, :, None].repeat(1, 1, 4)
    tokens = pixel_shuffle(index, 0.5)[0]  # (4, 16): each token's patches' indices
    for k in range(4):
        r, c = divmod(k, 2)
        want = {(2 * r + i) * side + 2 * c + j for i in range(2) for j in range(2)}
        assert set(tokens[k].long().tolist()) == want


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (3, 1, 3)])
def test_views_follow_the_processors_layout(model, processor, per_row):
    inputs = run_processor(processor, SIZES, per_row)
    ids = inputs["input_ids"]
    images = family_of(model).images(model.config, inputs)
    assert [len(row) for row in images] == list(per_row)
    side = tile_side(model.config)
    cell = TILE / side
    ratios = processor.image_processor([quarters(*s, COLOURS) for s in SIZES])["aspect_ratios"]
    rid, counts = region_ids(grid_regions(1, 1), images, torch.zeros(*ids.shape, 1))
    picture = 0
    for b, row in enumerate(images):
        for image in row:
            (R, C), (h, w) = canvas_and_content(processor, *SIZES[picture])
            assert (R, C) == tuple(ratios[picture].tolist())
            token_rows, token_cols = -(-h // cell), -(-w // cell)
            names = [v.name for v in image.views]
            if R * C == 1:
                assert names == ["global"] and image.grid is image.views[0]
            else:
                tiles = image.views[:-1]
                assert names[-1] == "global" and set(names[:-1]) == {"tile"}
                assert (image.views[-1].rows, image.views[-1].cols) == (side, side)
                assert (image.grid.rows, image.grid.cols) == (token_rows, token_cols)
                for view in tiles:
                    x0, y0, x1, y1 = view.box
                    i, j = round(y0 * h / TILE), round(x0 * w / TILE)  # the tile's place
                    assert (x0, y0) == pytest.approx((j * TILE / w, i * TILE / h))
                    assert view.rows == min(token_rows - i * side, side)
                    assert view.cols == min(token_cols - j * side, side)
                    assert (x1, y1) == pytest.approx(
                        (min((j * TILE + view.cols * cell) / w, 1),
                         min((i * TILE + view.rows * cell) / h, 1)))
                # every tile token is in a tile view or a marker (padding)
                assert sum(v.rows * v.cols for v in tiles) + len(image.markers) == R * C * side ** 2
            # the markers around the picture
            first = int(image.positions.min())
            last = int(torch.cat([image.positions, image.markers]).max())
            assert int(ids[b, last + 1]) == VISION_END
            start = first - 1 if R * C > 1 else first - 2
            assert int(ids[b, start]) == VISION_START
            if R * C > 1:
                assert int(ids[b, first + side * side]) in (TILE_X_SEPARATOR, TILE_Y_SEPARATOR)
                assert int(ids[b, int(image.views[-1].positions[0]) - 1]) == GLOBAL_MARKER
            picture += 1
        positions = torch.cat([im.positions for im in row] + [im.markers for im in row])
        assert torch.equal(positions.sort().values, (ids[b] == IMAGE_TOKEN).nonzero().flatten())
        assert len(set(positions.tolist())) == len(positions)
        assert bool((rid[b][ids[b] != IMAGE_TOKEN] == -1).all())
        assert bool((rid[b][torch.cat([im.markers for im in row])] == -1).all())
        assert counts[b] == len(row)
    assert picture == len(SIZES)


def test_a_layout_that_does_not_match_pixel_values_raises(model, processor):
    inputs = run_processor(processor, ((32, 32), (24, 48)), (2,))
    family = family_of(model)
    with pytest.raises(ValueError, match="more tiles than pixel_values"):
        family.images(model.config, dict(inputs, pixel_values=inputs["pixel_values"][:-1]))
    extra = torch.cat([inputs["pixel_values"], inputs["pixel_values"][:1]])
    with pytest.raises(ValueError, match="more than input_ids lay out"):
        family.images(model.config, dict(inputs, pixel_values=extra))
    with pytest.raises(ValueError, match="need the pixel_values"):
        family.images(model.config, dict(inputs, pixel_values=None))
    ids = inputs["input_ids"].clone()
    second_row = (ids[0] == TILE_X_SEPARATOR).nonzero().flatten()[1]  # the 2 x 2 tiles'
    ids[0, second_row] = TILE_Y_SEPARATOR  # rows of 2, 1 and 1 tiles
    with pytest.raises(ValueError, match="do not form a grid of rows x cols"):
        family.images(model.config, dict(inputs, input_ids=ids))


def colour_of(processor, pixels: torch.Tensor) -> torch.Tensor:
    """(..., C) normalised pixels -> (...) index of the nearest of COLOURS, or BLACK."""
    ip = processor.image_processor
    mean, std = torch.tensor(ip.image_mean), torch.tensor(ip.image_std)
    refs = np.concatenate([COLOURS, [[0, 0, 0]]])
    refs = (torch.from_numpy(refs).float() / 255 - mean) / std
    return ((pixels.float()[..., None, :] - refs) ** 2).sum(-1).argmin(-1)


def token_colours(model, processor, inputs, b: int) -> dict:
    """Sequence position -> the colour index of each pixel its token reads, for row ``b``:
    the model gives the k-th image token of the batch the k-th token of pixel_values'
    tiles, each tile's tokens its row-major blocks of pixels."""
    side = tile_side(model.config)
    cell = TILE // side
    tiles = inputs["pixel_values"]  # (N, C, T, T)
    blocks = tiles.reshape(len(tiles), -1, side, cell, side, cell).permute(0, 2, 4, 3, 5, 1)
    blocks = blocks.reshape(len(tiles) * side * side, cell * cell, -1)
    is_image = inputs["input_ids"] == IMAGE_TOKEN
    before = int(is_image[:b].sum())
    colours = colour_of(processor, blocks[before:before + int(is_image[b].sum())])
    return dict(zip(is_image[b].nonzero().flatten().tolist(), colours))


@pytest.mark.parametrize("size", SIZES)
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    at = token_colours(model, processor, inputs, 0)
    colours = torch.stack([at[p] for p in image.positions.tolist()])
    # padding tokens read black only; every token of a view reads some of the picture
    for p in image.markers.tolist():
        assert bool((at[p] == BLACK).all())
    assert bool((colours != BLACK).any(1).all())
    # a token at the padding's edge reads some black too
    assert_quarter_colours(image.boxes, colours, ignore=BLACK)


def test_grid_regions_give_each_quarter_one_region_in_every_view(model, processor):
    inputs = run_processor(processor, SIZES, (3, 1, 3))
    ids = inputs["input_ids"]
    images = family_of(model).images(model.config, inputs)
    rid, counts = region_ids(grid_regions(2, 2), images, torch.zeros(*ids.shape, 1))
    for b, row in enumerate(images):
        at = token_colours(model, processor, inputs, b)
        base = 0
        for image in row:
            by_colour = {}
            for view in image.views:
                for p in view.positions.tolist():
                    seen = at[p][at[p] != BLACK]
                    if len(seen) and bool((seen == seen[0]).all()):  # one colour only
                        region = int(rid[b, p]) - base
                        assert by_colour.setdefault(int(seen[0]), region) == region
            assert by_colour == {0: 0, 1: 1, 2: 2, 3: 3}
            base += 4
        assert counts[b] == 4 * len(row)
