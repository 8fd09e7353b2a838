"""LLaVA-NeXT's geometry against its real processor and model code: the inputs come from
transformers' LlavaNextProcessor (a tiny image processor and tokenizer, built offline),
and which features sit at which positions of the sequence comes from the model's own
``pack_image_features`` run on features that name each token's tile, row and column (or
its pixels' colour), with a sentinel for the newline feature."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")  # the LLaVA-NeXT image processor needs it
from headscope.hf import Tracer, grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing import IMAGE_TOKEN, tiny_model, tiny_processor  # noqa: E402

# (height, width) of pictures: square, 2:1 wide, 1:3 tall, and three whose canvases leave
# padding that unpadding removes (rows; columns; columns, cutting into the picture unevenly)
SIZES = [(64, 64), (40, 80), (96, 32), (60, 100), (72, 40), (110, 24)]
NEWLINE = -1000.0  # the sentinel newline feature
# quarter colours, row-major: top left, top right, bottom left, bottom right
COLOURS = torch.tensor([[230, 20, 20], [20, 230, 20], [20, 20, 230], [230, 230, 20]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llava_next")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("llava_next")


def _picture(height, width, quarters=True):
    import numpy as np
    from PIL import Image
    pixels = np.zeros((height, width, 3), np.uint8)
    h, w = height // 2, width // 2
    for q, (ys, xs) in enumerate(((slice(0, h), slice(0, w)), (slice(0, h), slice(w, None)),
                                  (slice(h, None), slice(0, w)), (slice(h, None), slice(w, None)))):
        pixels[ys, xs] = COLOURS[q].numpy() if quarters else 128
    return Image.fromarray(pixels)


def _inputs(processor, size):
    out = processor(images=_picture(*size), text="describe <image> the picture .",
                    return_tensors="pt")
    return dict(out)


def _packed(model, inputs, per_token):
    """What the model puts at each image-token position: ``per_token`` (tiles, tokens,
    D), the features of each tile's tokens in the vision tower's row-major order, packed
    by the model's own ``pack_image_features`` (newlines: NEWLINE)."""
    D = per_token.shape[-1]
    packed, _ = model.model.pack_image_features(
        [per_token], inputs["image_sizes"], vision_feature_select_strategy="default",
        image_newline=torch.full((D,), NEWLINE))
    return packed[0]


def _tile_tokens(model, inputs):
    """(tiles, tokens, 3, p * p): each token's pixels, as the tower's patch embedding reads
    them from ``pixel_values`` (base first, then the canvas's tiles row-major)."""
    p = model.config.vision_config.patch_size
    tiles = inputs["pixel_values"][0]  # one picture: no padding tiles
    x = tiles.unfold(2, p, p).unfold(3, p, p)  # (tiles, 3, s, s, p, p)
    n, c, s = x.shape[:3]
    return x.permute(0, 2, 3, 1, 4, 5).reshape(n, s * s, c, p * p)


@pytest.mark.parametrize("size", SIZES)
def test_views_are_where_the_processor_and_model_put_them(model, processor, size):
    """Every image token of the processor's prompt is in exactly one view or is a newline
    feature; the base view is the tower's square grid and the tiles view a rectangle of
    the stitched canvas, both row-major, as pack_image_features lays them; newlines have
    region -1."""
    inputs = _inputs(processor, size)
    (picture,), = family_of(model).images(model.config, inputs)
    image = (inputs["input_ids"][0] == IMAGE_TOKEN).nonzero().flatten()
    side = model.config.vision_config.image_size // model.config.vision_config.patch_size
    n = inputs["pixel_values"].shape[1]
    # each token named by (tile, row, column) in its tile
    r, c = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    names = torch.stack([torch.arange(n)[:, None].expand(n, side * side).float(),
                         r.flatten().expand(n, -1).float(), c.flatten().expand(n, -1).float()], -1)
    packed = _packed(model, inputs, names)
    assert len(packed) == len(image)  # the processor's count is the model's
    at = {int(pos): feat for pos, feat in zip(image, packed)}
    newlines = {int(pos) for pos, feat in zip(image, packed) if feat[0] == NEWLINE}

    base, tiles = picture.views
    assert (base.name, base.rows, base.cols, base.box) == ("base", side, side, (0, 0, 1, 1))
    assert tiles.name == "tiles" and picture.grid is tiles
    got = torch.stack([at[int(p)] for p in base.positions])
    assert torch.equal(got, names[0])  # base: tile 0, row-major
    got = torch.stack([at[int(p)] for p in tiles.positions])
    assert bool((got[:, 0] >= 1).all())
    # canvas coordinates of each tiles-view token: a rows x cols rectangle, row-major
    per_row = _canvas(model, inputs)[1] // model.config.vision_config.image_size  # tiles
    tile = got[:, 0].long() - 1
    y = tile // per_row * side + got[:, 1].long()
    x = tile % per_row * side + got[:, 2].long()
    y, x = y.reshape(tiles.rows, tiles.cols), x.reshape(tiles.rows, tiles.cols)
    assert torch.equal(y - y[0, 0], torch.arange(tiles.rows)[:, None].expand_as(y))
    assert torch.equal(x - x[0, 0], torch.arange(tiles.cols)[None].expand_as(x))
    # one newline after each row of the tiles view, and nothing else outside the views
    in_views = picture.positions.tolist()
    assert len(set(in_views)) == len(in_views)
    assert sorted(in_views + sorted(newlines)) == image.tolist()
    assert picture.markers.tolist() == sorted(newlines)
    assert len(newlines) == tiles.rows
    assert sorted(newlines) == [int(tiles.positions[(i + 1) * tiles.cols - 1]) + 1
                                for i in range(tiles.rows)]
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
    rid = tr.region_ids[0]
    assert bool((rid[sorted(newlines)] == -1).all()) and bool((rid[in_views] >= 0).all())
    assert int((rid >= 0).sum()) == len(in_views)


def _canvas(model, inputs):
    from transformers.image_processing_utils import select_best_resolution
    return select_best_resolution(inputs["image_sizes"][0].tolist(),
                                  model.config.image_grid_pinpoints)


def _quarter_of_tokens(model, processor, inputs):
    """Per image-token position: the quarter whose colour all of that token's pixels
    carry (each pixel's nearest quarter colour), -1 where they mix colours or show
    padding, NEWLINE for newlines."""
    ip = processor.image_processor
    mean, std = torch.tensor(ip.image_mean), torch.tensor(ip.image_std)
    colours = (COLOURS / 255 - mean) / std  # as normalised in pixel_values
    pixels = _tile_tokens(model, inputs)  # (tiles, tokens, 3, p * p)
    # each pixel's nearest quarter colour (resizing blurs the edges a little); padding
    # (black) is near none of them
    off = (pixels[:, :, None] - colours[None, None, :, :, None]).abs().amax(-2)
    dist, nearest = off.min(2)  # (tiles, tokens, p * p)
    nearest = torch.where(dist < 1.0, nearest, -1)
    one = (nearest == nearest[..., :1]).all(-1) & (nearest[..., 0] >= 0)
    quarter = torch.where(one, nearest[..., 0], -1).float()
    return _packed(model, inputs, quarter[..., None])[:, 0]


@pytest.mark.parametrize("size", SIZES)
def test_each_token_box_lies_in_the_quarter_its_pixels_show(model, processor, size):
    """A picture of four coloured quarters: each token whose pixels all carry one quarter's
    colour has its box's centre in that quarter, in both views; and grid_regions(2, 2)
    gives each quarter's tokens of every view that quarter's region."""
    inputs = _inputs(processor, size)
    (picture,), = family_of(model).images(model.config, inputs)
    image = (inputs["input_ids"][0] == IMAGE_TOKEN).nonzero().flatten()
    quarter_at = dict(zip(image.tolist(), _quarter_of_tokens(model, processor, inputs).tolist()))
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
    rid = tr.region_ids[0]
    region_of_quarter = {}
    for view in picture.views:
        quarters = torch.tensor([quarter_at[int(p)] for p in view.positions])
        assert not bool((quarters == NEWLINE).any())
        pure = quarters >= 0
        # many tokens lie inside one quarter (the tiles of a narrow picture may have no
        # column inside the left half), so the check is not vacuous
        assert int(pure.sum()) >= len(quarters) // 2
        boxes = view.boxes[pure]
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        where = (cy >= 0.5).long() * 2 + (cx >= 0.5).long()
        assert torch.equal(where, quarters[pure].long()), view.name
        for q, r in zip(quarters[pure].long().tolist(), rid[view.positions[pure]].tolist()):
            assert region_of_quarter.setdefault(q, r) == r, (view.name, q)
    assert sorted(region_of_quarter) == [0, 1, 2, 3]  # seen in some view
    assert sorted(region_of_quarter.values()) == [0, 1, 2, 3]


@pytest.mark.parametrize("size", SIZES)
def test_each_token_box_is_centred_on_its_pixels(model, processor, size):
    """A picture whose red channel is its x coordinate and green its y: the mean of a
    token's pixels is the centre of the part of the picture they show, and must be its
    box's centre, in both views (tokens that show some padding excepted). Unpadding works
    on whole tokens, so the tiles view may cover a little less or more than the picture:
    a box of (0, 0, 1, 1) would be off by up to a third of a token here."""
    import numpy as np
    from PIL import Image
    height, width = size
    ramp = np.zeros((height, width, 3), np.uint8)
    ramp[..., 0] = np.round(255 * (np.arange(width) + 0.5) / width)[None]
    ramp[..., 1] = np.round(255 * (np.arange(height) + 0.5) / height)[:, None]
    ramp[..., 2] = 255  # the padding is black
    inputs = dict(processor(images=Image.fromarray(ramp), text="describe <image> the picture .",
                            return_tensors="pt"))
    ip = processor.image_processor
    pixels = _tile_tokens(model, inputs)
    pixels = pixels * torch.tensor(ip.image_std)[:, None] + torch.tensor(ip.image_mean)[:, None]
    feats = torch.stack([pixels[:, :, 0].mean(-1), pixels[:, :, 1].mean(-1),
                         pixels[:, :, 2].amin(-1)], -1)
    image = (inputs["input_ids"][0] == IMAGE_TOKEN).nonzero().flatten()
    at = dict(zip(image.tolist(), _packed(model, inputs, feats)))
    (picture,), = family_of(model).images(model.config, inputs)
    for view in picture.views:
        f = torch.stack([at[int(p)] for p in view.positions]).double()
        inside = f[:, 2] > 0.9
        assert int(inside.sum()) >= len(f) // 2
        boxes = view.boxes[inside]
        centre = (boxes[:, :2] + boxes[:, 2:]) / 2
        torch.testing.assert_close(centre, f[inside, :2], atol=0.005, rtol=0)


def test_ward_regions_join_base_tokens_to_the_tiles_region_they_overlap(model, processor):
    """regions=K clusters the tiles view; each base token joins the region of the tiles
    tokens covering most of its box."""
    inputs = _inputs(processor, (60, 100))
    with torch.no_grad(), Tracer(model, regions=3, vas=False) as tr:
        model(**inputs)
    (picture,), = tr.images
    base, tiles = picture.views
    rid = tr.region_ids[0]
    tile_region = rid[tiles.positions]
    assert set(tile_region.tolist()) == {0, 1, 2}
    area = picture.overlap(base.boxes)  # (base tokens, tiles tokens)
    per_region = torch.stack([area[:, tile_region == k].sum(1) for k in range(3)], 1)
    assert torch.equal(rid[base.positions], per_region.argmax(1))


def test_images_need_image_sizes(model, processor):
    inputs = _inputs(processor, (64, 64))
    del inputs["image_sizes"]
    with pytest.raises(ValueError, match="need the image_sizes of its inputs"):
        family_of(model).images(model.config, inputs)
