"""LLaVA-NeXT's and LLaVA-OneVision's geometry against their real processors and model
code: the inputs come from transformers' LlavaNextProcessor / LlavaOnevisionProcessor (tiny
image processors and tokenizer, built offline), and which features sit at which positions
of the sequence comes from the model's own ``pack_image_features`` run on features that
name each token's place (or its pixels' colour), with a sentinel for the newline feature."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")  # the LLaVA-NeXT and OneVision image processors need it
from headscope.hf import Tracer, grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing import IMAGE_TOKEN, quarters, tiny_model, tiny_processor  # noqa: E402

FAMILIES = ("llava_next", "llava_onevision")
# (height, width) of pictures: square, 2:1 wide, 1:3 tall, and three whose canvases leave
# padding that unpadding removes (rows; columns; columns, cutting into the picture unevenly);
# OneVision's tiny models scale the tiles grids of the square and the 1:3 one down
SIZES = [(64, 64), (40, 80), (96, 32), (60, 100), (72, 40), (110, 24)]
NEWLINE = -1000.0  # the sentinel newline feature
# quarter colours, row-major: top left, top right, bottom left, bottom right
COLOURS = torch.tensor([[230, 20, 20], [20, 230, 20], [20, 20, 230], [230, 230, 20]])

@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return tiny_model(family)


@pytest.fixture(scope="module")
def processor(family):
    return tiny_processor(family)


def _inputs(processor, pictures, text="describe <image> the picture ."):
    """The processor's inputs for one prompt of ``pictures`` (PIL images)."""
    images = pictures[0] if len(pictures) == 1 else [list(pictures)]
    return dict(processor(images=images, text=text, return_tensors="pt"))


def _packed(model, inputs, per_token):
    """What the model puts at each image-token position: ``per_token`` (per picture its
    (tiles, tokens, D), the features of each tile's tokens in the vision tower's row-major
    order) packed by the model's own ``pack_image_features`` (newlines: NEWLINE)."""
    D = per_token[0].shape[-1]
    newline = torch.full((D,), NEWLINE)
    if model.config.model_type == "llava_next":
        packed, _ = model.model.pack_image_features(
            per_token, inputs["image_sizes"], vision_feature_select_strategy="default",
            image_newline=newline)
    else:
        packed, _ = model.model.pack_image_features(
            per_token, inputs["image_sizes"], image_newline=newline,
            vision_aspect_ratio=model.config.vision_aspect_ratio)
    return torch.cat(packed)


def _tile_tokens(model, inputs):
    """Per picture (tiles, tokens, 3, p * p): each token's pixels, as the tower's patch
    embedding reads them from ``pixel_values`` (base first, then the canvas's tiles
    row-major; the prompts here have no padding tiles)."""
    p = model.config.vision_config.patch_size
    out = []
    for tiles in inputs["pixel_values"]:
        x = tiles.unfold(2, p, p).unfold(3, p, p)  # (tiles, 3, s, s, p, p)
        n, c, s = x.shape[:3]
        out.append(x.permute(0, 2, 3, 1, 4, 5).reshape(n, s * s, c, p * p))
    return out


def _at(model, inputs, per_token):
    """{image-token position: its packed feature}."""
    image = (inputs["input_ids"][0] == IMAGE_TOKEN).nonzero().flatten()
    packed = _packed(model, inputs, per_token)
    assert len(packed) == len(image)  # the processor's count is the model's
    return dict(zip(image.tolist(), packed))


@pytest.mark.parametrize("size", SIZES)
def test_views_are_where_the_processor_and_model_put_them(model, processor, size):
    """Every image token of the processor's prompt is in exactly one view or is a newline
    feature (``markers``, region -1); the base view is the tower's square grid of the first
    tile and the tiles view a row-major grid over the stitched canvas, as
    pack_image_features lays them (scaled down: still row-major, rows and columns in order)."""
    inputs = _inputs(processor, [quarters(*size, COLOURS)])
    (picture,), = family_of(model).images(model.config, inputs)
    image = (inputs["input_ids"][0] == IMAGE_TOKEN).nonzero().flatten()
    side = model.config.vision_config.image_size // model.config.vision_config.patch_size
    (tiles_px,) = inputs["pixel_values"]
    per_row = _canvas(model, inputs)[1] // model.config.vision_config.image_size
    # each token named by (tile, y, x): y and x within the tile for the base, on the
    # stitched canvas for the tiles (linear, so scaling down keeps them in order)
    r, c = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    k = torch.arange(len(tiles_px))[:, None]
    tile = (k - 1).clamp_min(0)
    y = torch.where(k > 0, tile // per_row * side, 0) + r.flatten()
    x = torch.where(k > 0, tile % per_row * side, 0) + c.flatten()
    names = torch.stack([k.expand_as(y), y, x], -1).float()
    at = _at(model, inputs, [names])
    newlines = sorted(p for p, f in at.items() if f[0] == NEWLINE)

    base, tiles = picture.views
    assert (base.name, base.rows, base.cols, base.box) == ("base", side, side, (0, 0, 1, 1))
    assert tiles.name == "tiles" and picture.grid is tiles
    got = torch.stack([at[int(p)] for p in base.positions])
    assert torch.equal(got, names[0])  # base: tile 0, row-major
    got = torch.stack([at[int(p)] for p in tiles.positions])
    assert bool((got[:, 0] > 1 - 1e-5).all())  # (scaled down: up to rounding)
    y, x = got[:, 1].reshape(tiles.rows, tiles.cols), got[:, 2].reshape(tiles.rows, tiles.cols)
    # (scaled down, bilinearly: equal up to rounding)
    torch.testing.assert_close(y, y[:, :1].expand_as(y), atol=1e-5, rtol=0)
    torch.testing.assert_close(x, x[:1].expand_as(x), atol=1e-5, rtol=0)
    assert bool((y[1:, 0] > y[:-1, 0]).all()) and bool((x[0, 1:] > x[0, :-1]).all())
    if bool((y == y.round()).all() & (x == x.round()).all()):  # not scaled: one token each
        assert torch.equal(y[1:, 0] - y[:-1, 0], torch.ones(tiles.rows - 1))
        assert torch.equal(x[0, 1:] - x[0, :-1], torch.ones(tiles.cols - 1))
    if model.config.model_type == "llava_onevision" and size in ((64, 64), (96, 32)):
        assert not bool((y == y.round()).all())  # the scaling down is exercised
    # one newline after each row of the tiles view, and nothing else outside the views
    in_views = picture.positions.tolist()
    assert len(set(in_views)) == len(in_views)
    assert sorted(in_views + newlines) == image.tolist()
    assert picture.markers.tolist() == newlines
    assert newlines == [int(tiles.positions[(i + 1) * tiles.cols - 1]) + 1
                        for i in range(tiles.rows)]
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
    rid = tr.region_ids[0]
    assert bool((rid[newlines] == -1).all()) and bool((rid[in_views] >= 0).all())
    assert int((rid >= 0).sum()) == len(in_views)


def _canvas(model, inputs):
    from transformers.image_processing_utils import select_best_resolution
    return select_best_resolution(inputs["image_sizes"][0].tolist(),
                                  model.config.image_grid_pinpoints)


def _quarter_of_tokens(model, processor, inputs):
    """{image-token position: the quarter whose colour all of that token's pixels carry
    (each pixel's nearest quarter colour), -1 where they mix colours or show padding,
    NEWLINE for newlines}. One-hot per token before packing, so that a token scaled down
    from several keeps a quarter only if all of them had it."""
    ip = processor.image_processor
    mean, std = torch.tensor(ip.image_mean), torch.tensor(ip.image_std)
    colours = (COLOURS / 255 - mean) / std  # as normalised in pixel_values
    one_hot = []
    for pixels in _tile_tokens(model, inputs):  # (tiles, tokens, 3, p * p)
        # resizing blurs the edges a little; padding (black) is near no quarter colour
        off = (pixels[:, :, None] - colours[None, None, :, :, None]).abs().amax(-2)
        dist, nearest = off.min(2)  # (tiles, tokens, p * p)
        nearest = torch.where(dist < 1.0, nearest, -1)
        one = (nearest == nearest[..., :1]).all(-1) & (nearest[..., 0] >= 0)
        one_hot.append(torch.nn.functional.one_hot(nearest[..., 0].clamp_min(0), 4).float()
                       * one[..., None])
    out = {}
    for pos, f in _at(model, inputs, one_hot).items():
        out[pos] = NEWLINE if f[0] == NEWLINE else \
            int(f.argmax()) if float(f.max()) > 1 - 1e-6 else -1
    return out


@pytest.mark.parametrize("size", SIZES)
def test_each_token_box_lies_in_the_quarter_its_pixels_show(model, processor, size):
    """A picture of four coloured quarters: each token whose pixels all carry one quarter's
    colour has its box's centre in that quarter, in both views; and grid_regions(2, 2)
    gives each quarter's tokens of every view that quarter's region."""
    inputs = _inputs(processor, [quarters(*size, COLOURS)])
    (picture,), = family_of(model).images(model.config, inputs)
    quarter_at = _quarter_of_tokens(model, processor, inputs)
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
    rid = tr.region_ids[0]
    region_of_quarter = {}
    for view in picture.views:
        shown = torch.tensor([quarter_at[int(p)] for p in view.positions])
        assert not bool((shown == NEWLINE).any())
        pure = shown >= 0
        # many tokens lie inside one quarter (the tiles of a narrow picture may have no
        # column inside the left half), so the check is not vacuous
        assert int(pure.sum()) >= len(shown) // 3
        boxes = view.boxes[pure]
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        where = (cy >= 0.5).long() * 2 + (cx >= 0.5).long()
        assert torch.equal(where, shown[pure].long()), view.name
        for q, r in zip(shown[pure].long().tolist(), rid[view.positions[pure]].tolist()):
            assert region_of_quarter.setdefault(q, r) == r, (view.name, q)
    assert sorted(region_of_quarter) == [0, 1, 2, 3]  # seen in some view
    assert sorted(region_of_quarter.values()) == [0, 1, 2, 3]


def _ramp(height, width):
    """A picture whose red channel is its x coordinate, green its y, blue full (padding:
    black or the processor's mean colour)."""
    import numpy as np
    from PIL import Image
    ramp = np.zeros((height, width, 3), np.uint8)
    ramp[..., 0] = np.round(255 * (np.arange(width) + 0.5) / width)[None]
    ramp[..., 1] = np.round(255 * (np.arange(height) + 0.5) / height)[:, None]
    ramp[..., 2] = 255
    return Image.fromarray(ramp)


def _check_centres(model, processor, inputs, pictures, atol=0.005):
    """Each token that shows only the picture has its box centred on its pixels' mean
    (x, y), read from the ramp's colours, to ``atol`` (of the picture's size)."""
    ip = processor.image_processor
    feats = []
    for pixels in _tile_tokens(model, inputs):
        pixels = pixels * torch.tensor(ip.image_std)[:, None] + torch.tensor(ip.image_mean)[:, None]
        feats.append(torch.stack([pixels[:, :, 0].mean(-1), pixels[:, :, 1].mean(-1),
                                  pixels[:, :, 2].amin(-1)], -1))
    at = _at(model, inputs, feats)
    for picture in pictures:
        for view in picture.views:
            f = torch.stack([at[int(p)] for p in view.positions]).double()
            inside = f[:, 2] > 0.9
            assert int(inside.sum()) >= len(f) // 3
            boxes = view.boxes[inside]
            centre = (boxes[:, :2] + boxes[:, 2:]) / 2
            torch.testing.assert_close(centre, f[inside, :2], atol=atol, rtol=0)


@pytest.mark.parametrize("size", SIZES)
def test_each_token_box_is_centred_on_its_pixels(model, processor, size):
    """The mean of a token's pixels is the centre of the part of the picture they show and
    must be its box's centre, in both views (tokens that show some padding excepted).
    Unpadding works on whole tokens, so the tiles view may cover a little less or more
    than the picture: a box of (0, 0, 1, 1) would be off by up to a third of a token."""
    inputs = _inputs(processor, [_ramp(*size)])
    _check_centres(model, processor, inputs, family_of(model).images(model.config, inputs)[0])


def test_onevision_pictures_of_a_prompt_with_several_are_base_views():
    """OneVision, two pictures in one prompt (batch_num_images 2): each is only the base
    view of the picture padded to a square, then one newline; its box reaches past the
    picture on the shorter side."""
    model, processor = tiny_model("llava_onevision"), tiny_processor("llava_onevision")
    inputs = _inputs(processor, [_ramp(40, 80), _ramp(60, 30)],
                     text="compare <image> and <image> .")
    assert inputs["batch_num_images"].tolist() == [2]
    first, second = family_of(model).images(model.config, inputs)[0]
    side = model.config.vision_config.image_size // model.config.vision_config.patch_size
    for picture, box in ((first, (0, -0.5, 1, 1.5)), (second, (-0.5, 0, 1.5, 1))):
        (base,) = picture.views
        assert (base.name, base.rows, base.cols, base.box) == ("base", side, side, box)
        assert picture.grid is base
        assert picture.markers.tolist() == [int(base.positions[-1]) + 1]
    # the base view shrinks the padded square 5 and 4 times: resizing blurs a few per cent
    # of the padding's colour into the tokens next to it (a box one pixel off: 0.025)
    _check_centres(model, processor, inputs, (first, second), atol=0.01)
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
    rid = tr.region_ids[0]
    for offset, picture in ((0, first), (4, second)):
        centre = (picture.boxes[:, :2] + picture.boxes[:, 2:]) / 2
        quarter = (centre[:, 1] >= 0.5).long() * 2 + (centre[:, 0] >= 0.5).long()
        assert torch.equal(rid[picture.positions], quarter + offset)
        assert int(rid[picture.markers]) == -1


def test_ward_regions_join_base_tokens_to_the_tiles_region_they_overlap(model, processor):
    """regions=K clusters the tiles view; each base token joins the region of the tiles
    tokens covering most of its box."""
    inputs = _inputs(processor, [quarters(60, 100, COLOURS)])
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


def test_regions_need_image_sizes(model, processor):
    """Plain generate hands the model the vision output, not image_sizes: an error that
    says to generate through the tracer, which works."""
    inputs = _inputs(processor, [quarters(64, 64, COLOURS)])
    with Tracer(model, regions=2, vas=False) as tr, torch.no_grad():
        with pytest.raises(ValueError, match=r"need the image_sizes of its inputs.*"
                                             r"generate with tr\.generate\(\*\*inputs"):
            model.generate(**inputs, max_new_tokens=2)
        assert len(list(tr.generate(**inputs, max_new_tokens=2))) >= 1
    del inputs["image_sizes"]
    with pytest.raises(ValueError, match="need the image_sizes of its inputs"):
        family_of(model).images(model.config, inputs)


def test_token_counts_match_the_processors_at_real_checkpoint_sizes(family):
    """At the real checkpoints' sizes (LLaVA-v1.6: CLIP 336 / 14 on 5 canvases; OneVision:
    SigLIP 384 / 14 on 36 canvases, anyres_max_9), the layout's token count equals the
    processor's for pictures of many sizes."""
    import random

    import transformers as tf

    from headscope.hf.testing import tiny_tokenizer
    from headscope.hf.families.llava_next import token_count
    tokenizer = tiny_tokenizer(family)
    if family == "llava_next":
        config = tf.LlavaNextConfig(vision_config=dict(model_type="clip_vision_model",
                                                       image_size=336, patch_size=14))
        processor = tf.LlavaNextProcessor(
            image_processor=tf.LlavaNextImageProcessor(
                size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                image_grid_pinpoints=config.image_grid_pinpoints),
            tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
            num_additional_image_tokens=1)
    else:
        config = tf.LlavaOnevisionConfig()
        side = config.vision_config.image_size // config.vision_config.patch_size
        processor = tf.LlavaOnevisionProcessor(
            image_processor=tf.LlavaOnevisionImageProcessor(
                image_grid_pinpoints=config.image_grid_pinpoints),
            tokenizer=tokenizer, video_processor=tf.LlavaOnevisionVideoProcessor(),
            num_image_tokens=side * side, vision_feature_select_strategy="full",
            vision_aspect_ratio=config.vision_aspect_ratio)
    rng = random.Random(0)
    sizes = [(rng.randint(20, 4000), rng.randint(20, 4000)) for _ in range(300)]
    want = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    layout = family_of(config)
    got = [token_count(layout.pieces(config, {}, 0, h, w)) for h, w in sizes]
    assert got == want
