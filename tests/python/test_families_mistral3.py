"""Mistral 3's layout (headscope.hf.families.mistral3) against its real processor
(PixtralProcessor with a tiny image processor and tokenizer, built offline): the views
and boxes of pictures of several aspect ratios, a four-coloured picture whose tokens'
pixels must lie where their boxes say, and grid_regions on it through the tiny model."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

from conftest import nearest_colour, quarter_prompts  # noqa: E402
from headscope.hf import Tracer, grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.regions import region_ids  # noqa: E402
from headscope.hf.testing.families.mistral3 import IMAGE_BREAK, IMAGE_END  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, assert_quarter_colours,  # noqa: E402
                                  assert_quarters_are_regions, tiny_model,
                                  tiny_processor)

# (height, width) of the pictures given to the processor: square, 2:1 wide, 1:3 tall
# (rounded up to multiples of 8 pixels: 8 x 3 tokens), larger than the longest edge (scaled
# down), and odd sizes
SIZES = ((64, 64), (32, 64), (60, 20), (200, 100), (40, 40), (30, 50))


@pytest.fixture(scope="module")
def model():
    return tiny_model("mistral3")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("mistral3")


def run_processor(processor, sizes, per_row):
    return quarter_prompts(processor, sizes, per_row, "[IMG]")


def rows_in_ids(ids: torch.Tensor) -> list:
    """Each picture's (rows, cols) read off the marker tokens of one row of input_ids:
    a run of image tokens ended by [IMG_BREAK] is a row, by [IMG_END] the last row."""
    grids, rows, run = [], [], 0
    for t in ids.tolist():
        if t == IMAGE_TOKEN:
            run += 1
        elif t in (IMAGE_BREAK, IMAGE_END):
            rows.append(run)
            run = 0
            if t == IMAGE_END:
                assert len(set(rows)) == 1
                grids.append((len(rows), rows[0]))
                rows = []
    assert run == 0 and rows == []
    return grids


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (2, 1, 3)])
def test_views_follow_the_processors_layout(model, processor, per_row):
    config = model.config
    family = family_of(model)
    inputs = run_processor(processor, SIZES, per_row)
    images = family.images(config, inputs)
    ids = inputs["input_ids"]
    assert [len(row) for row in images] == list(per_row)
    want_tokens = processor._get_num_multimodal_tokens(
        image_sizes=[(s[0], s[1]) for s in SIZES]).num_image_tokens
    rid, counts = region_ids(grid_regions(1, 1), images, torch.zeros(*ids.shape, 1))
    picture = 0
    for b, row in enumerate(images):
        assert [(im.rows, im.cols) for im in row] == rows_in_ids(ids[b])
        for image in row:
            h, w = inputs["image_sizes"][picture].tolist()
            (view,) = image.views
            assert view.name == "base" and image.grid is view and view.box == (0, 0, 1, 1)
            assert (view.rows, view.cols) == (h // 8, w // 8)
            # the processor's own count: each row's image tokens and one marker
            assert view.rows * (view.cols + 1) == want_tokens[picture]
            assert bool((ids[b, view.positions] == IMAGE_TOKEN).all())
            picture += 1
        # every image token in exactly one view; markers and text in none (region -1)
        positions = torch.cat([im.positions for im in row])
        assert len(set(positions.tolist())) == len(positions)
        assert torch.equal(positions.sort().values, (ids[b] == IMAGE_TOKEN).nonzero().flatten())
        assert bool((rid[b][ids[b] != IMAGE_TOKEN] == -1).all())
        assert bool((rid[b][ids[b] == IMAGE_TOKEN] >= 0).all())
        assert bool((rid[b][torch.isin(ids[b], torch.tensor([IMAGE_BREAK, IMAGE_END]))]
                     == -1).all())
        assert counts[b] == len(row)
    assert picture == len(SIZES)


def test_a_layout_that_does_not_match_image_sizes_raises(model, processor):
    inputs = run_processor(processor, ((32, 64),), (1,))
    family = family_of(model)
    wrong = dict(inputs, image_sizes=inputs["image_sizes"].flip(-1))  # 8 x 4, not 4 x 8
    with pytest.raises(ValueError, match="not laid out as 8 rows of 4 image tokens"):
        family.images(model.config, wrong)
    with pytest.raises(ValueError, match="need the image_sizes"):
        family.images(model.config, dict(inputs, image_sizes=None))


def token_pixels(model, pixel_values: torch.Tensor, size) -> torch.Tensor:
    """(tokens, pixels, channels): the pixels each merged token reads, in the model's token
    order, found with the model's own modules: the patches are those of the vision tower's
    patch convolution (checked: the convolution equals a product with these pixels), and
    the patch merger, its learned layer swapped for the identity, gathers each token's
    patch indices."""
    config = model.config
    p = config.vision_config.patch_size
    h, w = size
    picture = pixel_values[:, :h, :w]
    C = picture.shape[0]
    patches = picture.reshape(C, h // p, p, w // p, p).permute(1, 3, 2, 4, 0)  # (hp, wp, p, p, C)
    patches = patches.reshape((h // p) * (w // p), p * p * C)
    conv = model.model.vision_tower.patch_conv
    with torch.no_grad():
        embeds = conv(pixel_values[None])[0, :, :h // p, :w // p].flatten(1).t()
    weight = conv.weight.permute(0, 2, 3, 1).reshape(conv.weight.shape[0], -1)
    torch.testing.assert_close(embeds, patches @ weight.t(), atol=1e-5, rtol=1e-5)
    merger = model.model.multi_modal_projector.patch_merger
    learned, merger.merging_layer = merger.merging_layer, torch.nn.Identity()
    try:
        index = torch.arange(len(patches), dtype=torch.float64)[:, None]
        which = merger(index, torch.tensor([[h, w]])).round().to(torch.int64)  # (tokens, m*m)
    finally:
        merger.merging_layer = learned
    return patches[which].reshape(which.shape[0], -1, C)


def colours_at(model, processor, inputs, b: int, picture: int, positions: torch.Tensor
               ) -> torch.Tensor:
    """(len(positions), pixels): the colour index of each pixel read by the tokens at the
    sequence ``positions`` of row ``b``, which holds picture ``picture`` only: the model
    scatters a picture's tokens over its image tokens in sequence order."""
    h, w = inputs["image_sizes"][picture].tolist()
    pixels = token_pixels(model, inputs["pixel_values"][picture], (h, w))
    colours = nearest_colour(processor, pixels)
    order = (inputs["input_ids"][b] == IMAGE_TOKEN).nonzero().flatten()
    assert len(order) == len(colours)
    at = {p: i for i, p in enumerate(order.tolist())}
    return colours[[at[p] for p in positions.tolist()]]


@pytest.mark.parametrize("size", SIZES)
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    colours = colours_at(model, processor, inputs, 0, 0, image.positions)
    assert_quarter_colours(image.boxes, colours)


def test_grid_regions_give_each_quarter_one_region_through_the_model(model, processor):
    inputs = run_processor(processor, ((64, 64), (32, 64), (60, 20)), (1, 1, 1))
    assert_quarters_are_regions(model, inputs, lambda b, image: colours_at(
        model, processor, inputs, b, b, image.positions))


def test_plain_generate_reads_the_grids_off_input_ids(model, processor):
    """model.generate hands the model the vision output (per-picture token counts), not
    image_sizes: the grids then come from each picture's first run of image tokens, and
    equal image_sizes' (a picture one token wide or tall included)."""
    sizes = ((32, 64), (64, 64), (64, 8), (8, 64), (60, 20), (30, 50))
    inputs = run_processor(processor, sizes, (2, 1, 3))
    grids = lambda tr: [[(v.rows, v.cols) for im in row for v in im.views]  # noqa: E731
                        for row in tr.images]
    by_column = lambda features, grid: torch.arange(grid[0] * grid[1]) % grid[1]  # noqa: E731
    with torch.no_grad(), Tracer(model, regions=by_column, vas=False) as tr:
        model(**inputs)
        want, want_grids = tr.region_ids.clone(), grids(tr)
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        assert torch.equal(tr.region_ids, want) and grids(tr) == want_grids
    assert want_grids == [[(4, 8), (8, 8)], [(8, 1)], [(1, 8), (8, 3), (4, 7)]]


def test_a_sliding_window_text_model_is_traced_under_its_window():
    """MistralConfig's default has a sliding window (the Mistral 3 checkpoints have none):
    the Tracer pools under it. A window of 8, smaller than the prompts: greedy tokens equal
    and span features equal region pooling of the eager attentions."""
    import test_family_contract as contract
    window = dict(sliding_window=8)
    models = (tiny_model("mistral3", text_overrides=window),
              tiny_model("mistral3", text_overrides=window, attn_implementation="eager"))
    assert contract.prompt(models[0], batch=2)["input_ids"].shape[1] > 2 * 8
    contract.test_generate_same_tokens_and_span_features_equal_region_pool(models)
