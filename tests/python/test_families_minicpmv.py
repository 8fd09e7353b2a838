"""MiniCPM-V 4.6's geometry ("minicpmv4_6", headscope.hf.families.minicpmv): each
picture's source view and rows x cols slices, read back from input_ids and target_sizes,
against the real MiniCPMV4_6Processor (a tiny image processor and the word-level tokenizer
with the models' markers, built offline) on several aspect ratios, with and without
picture numbers; the tokens' order through the model's own window-attention merger and
merger on an index grid; four-coloured pictures whose tokens' pixels must lie where their
boxes say, and grid_regions on them through the tiny model, whose hybrid decoder is
traced on its softmax layers only."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("PIL.Image")

from conftest import (assert_every_image_token_placed,  # noqa: E402
                      assert_generation_keeps_regions, nearest_colour, quarter_prompts)
from headscope.hf import Tracer, grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing.families.minicpmv import SLICE_END, SLICE_START  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, assert_quarters_are_regions,
                                  quarters, tiny_model, tiny_processor)

PICTURE = "<|image_pad|>"
# (height, width): unsliced square, 1:2 wide (1 x 2 slices), 1:3 tall (3 x 1), 2:1 tall
# and scaled (3 x 2), thin and unsliced, odd-sized (1 x 2), larger squares (2 x 2) and
# 3:2 tall (3 x 2), whose source views are 2 x 2 tokens
SIZES = ((32, 32), (24, 48), (60, 20), (200, 100), (16, 40), (30, 50), (64, 64), (96, 64))


@pytest.fixture(scope="module")
def model():
    return tiny_model("minicpmv4_6")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("minicpmv4_6")


def run_processor(processor, sizes, per_row):
    return quarter_prompts(processor, sizes, per_row, PICTURE)


def test_a_hybrid_decoder_is_traced_on_its_softmax_layers_only(model, processor):
    inputs = run_processor(processor, ((24, 48),), (1,))
    types = model.config.text_config.layer_types
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=True) as tr:
        model(**inputs)
        layers = tr.layers
    assert layers == [i for i, t in enumerate(types) if t == "full_attention"]
    assert 0 < len(layers) < len(types)


def assert_views(processor, inputs, images) -> None:
    """Each picture of ``images`` as the image processor cut it: its source view over the
    whole picture between <image> and </image>, then its slices (rows x cols by the image
    processor's own get_sliced_grid) between <slice> and </slice>, each over its cell of
    the picture, every view target_sizes // 4 tokens, and the slices stitched into the
    grid Ward regions cluster on."""
    ids, image_processor = inputs["input_ids"], processor.image_processor
    views = iter(inputs["target_sizes"].tolist())
    sizes = iter(SIZES)
    for b, row in enumerate(images):
        for image in row:
            R, C = image_processor.get_sliced_grid(
                next(sizes), image_processor.max_slice_nums,
                image_processor.scale_resolution) or (0, 0)
            assert [v.name for v in image.views] == ["base"] + ["slice"] * (R * C)
            for k, view in enumerate(image.views):
                h, w = next(views)
                assert (view.rows, view.cols) == (h // 4, w // 4)
                first, last = int(view.positions[0]), int(view.positions[-1])
                assert torch.equal(view.positions, torch.arange(first, last + 1))
                markers = (VISION_START, VISION_END) if k == 0 else (SLICE_START, SLICE_END)
                assert (int(ids[b, first - 1]), int(ids[b, last + 1])) == markers
                if k:
                    r, c = divmod(k - 1, C)
                    assert view.box == pytest.approx((c / C, r / R, (c + 1) / C, (r + 1) / R))
            assert image.views[0].box == (0, 0, 1, 1)
            if R * C == 0:
                assert image.grid is image.views[0]
                continue
            # the grid's token at each slice token's position covers that token's box
            at = {p: i for i, p in enumerate(image.grid.positions.tolist())}
            grid_boxes = image.grid.boxes
            for view in image.views[1:]:
                mine = grid_boxes[[at[p] for p in view.positions.tolist()]]
                torch.testing.assert_close(mine, view.boxes)
    assert next(views, None) is None


@pytest.mark.parametrize("numbered", [True, False])
@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (2, 1, 3, 2)])
def test_views_follow_the_processors_layout(model, processor, per_row, numbered,
                                            monkeypatch):
    monkeypatch.setattr(processor, "default_use_image_id", numbered)
    inputs = run_processor(processor, SIZES, per_row)
    images = family_of(model).images(model.config, inputs)
    assert [len(row) for row in images] == list(per_row)
    assert_views(processor, inputs, images)
    assert_every_image_token_placed(images, inputs["input_ids"], IMAGE_TOKEN)


def test_adjacent_pictures_without_numbers_are_told_apart(model, processor):
    """Without picture numbers a picture's <image> follows the last </slice> of the one
    before, as a slice's <slice> does: the opening marker tells them apart."""
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=[f"describe {PICTURE * len(SIZES)} ."],
                       images=[quarters(h, w, ((255, 0, 0),) * 4) for h, w in SIZES],
                       use_image_id=False, return_tensors="pt")
    images = family_of(model).images(model.config, inputs)
    assert len(images[0]) == len(SIZES)
    assert_views(processor, inputs, images)


def test_inputs_that_do_not_match_input_ids_raise(model, processor):
    inputs = run_processor(processor, ((64, 64), (24, 48)), (2,))
    family, sizes = family_of(model), inputs["target_sizes"]
    with pytest.raises(ValueError, match="need the target_sizes"):
        family.images(model.config, dict(inputs, target_sizes=None))
    with pytest.raises(ValueError, match="target_sizes holds 7 views .* input_ids 8 runs"):
        family.images(model.config, dict(inputs, target_sizes=sizes[:-1]))
    wrong, ragged = sizes.clone(), sizes.clone()
    wrong[1] = sizes.new_tensor([8, 16])  # a slice of 2 x 4 tokens where 2 x 2 lie
    with pytest.raises(ValueError, match="no view of 2 x 4 tokens"):
        family.images(model.config, dict(inputs, target_sizes=wrong))
    ragged[1] = sizes.new_tensor([4, 16])  # a slice of as many tokens, 1 x 4
    with pytest.raises(ValueError, match="no rows x cols grid of equal slices"):
        family.images(model.config, dict(inputs, target_sizes=ragged))


def token_patches(model, rows: int, cols: int) -> torch.Tensor:
    """``(tokens, patches)``: the patches (row-major over a view of ``rows x cols``
    patches) each of the view's tokens joins, in the model's token order: the tower's
    window-attention merger's own window index, then the merger run on an index grid (each
    merged token's feature its index), its MLP's input read back."""
    window_index, _, per_window = model.model.vision_tower.vit_merger.get_window_index(
        torch.tensor([[rows, cols]], dtype=torch.int32))
    windows = window_index.reshape(-1, per_window)
    merger, got = model.model.merger, []
    hidden = model.config.vision_config.hidden_size
    index = torch.arange(len(windows), dtype=torch.float32)[None, :, None].expand(1, -1, hidden)
    hook = merger.mlp[0].register_forward_pre_hook(lambda module, args: got.append(args[0]))
    try:
        with torch.no_grad():
            merger(index, torch.tensor([[rows // 2, cols // 2]], dtype=torch.int32))
    finally:
        hook.remove()
    (joined,) = got
    merged = joined.reshape(len(joined), -1, hidden)[:, :, 0].long()
    return windows[merged].flatten(1)


@pytest.mark.parametrize("rows, cols", [(8, 8), (4, 12), (12, 4), (8, 16)])
def test_each_token_joins_a_row_major_block_of_4_x_4_patches(model, rows, cols):
    """What the family reads (each view's tokens row-major, a token per 4 x 4 patches),
    through the model's own merging order."""
    patches = token_patches(model, rows, cols)
    grid = torch.arange(rows * cols).reshape(rows // 4, 4, cols // 4, 4)
    want = grid.permute(0, 2, 1, 3).reshape(-1, 16)
    assert torch.equal(patches.sort(1).values, want.sort(1).values)


def token_colours(model, processor, inputs, image, first_view: int) -> torch.Tensor:
    """(tokens, pixels): the nearest quarter colour of each pixel each token of ``image``
    reads, in the order of ``image.positions``; its views' patches lie in ``pixel_values``
    from its ``first_view``-th view's on, each patch ``patch_size`` columns of
    (channels, p, p), as the patch convolution reads them."""
    p = model.config.vision_config.patch_size
    sizes = inputs["target_sizes"].tolist()
    start = sum(h * w for h, w in sizes[:first_view])
    pixels = inputs["pixel_values"][0]
    colours = []
    for k, view in enumerate(image.views):
        h, w = sizes[first_view + k]
        patches = pixels[:, :, start * p:(start + h * w) * p].reshape(-1, p, h * w, p)
        patches = patches.permute(2, 1, 3, 0).reshape(h * w, p * p, -1)
        colours.append(nearest_colour(processor, patches)[token_patches(model, h, w)]
                       .flatten(1))
        start += h * w
    return torch.cat(colours)


# every picture but the thin unsliced one, whose one row of tokens lies astride the middle
@pytest.mark.parametrize("size", [size for size in SIZES if size != (16, 40)])
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    assert_quarter_colours(image.boxes, token_colours(model, processor, inputs, image, 0))


def test_grid_regions_give_each_quarter_one_region_through_the_model(model, processor):
    inputs = run_processor(processor, ((32, 32), (64, 64), (96, 64)), (1, 1, 1))
    first = [0, 1, 6]  # the pictures' first views: 1, 1 + 2 x 2 and 1 + 3 x 2 views
    assert_quarters_are_regions(
        model, inputs, lambda b, image: token_colours(model, processor, inputs, image,
                                                      first[b]))


def test_generation_keeps_the_prompts_regions(model, processor):
    """tr.generate hands target_sizes to the forward; plain model.generate does not, and
    the Tracer says so rather than guess the views."""
    inputs = run_processor(processor, ((24, 48), (60, 20), (64, 64)), (2, 1))
    assert_generation_keeps_regions(model, inputs, "target_sizes")
