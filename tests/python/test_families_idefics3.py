"""Idefics3 and SmolVLM geometry: the rows x cols tiles and the global image that the
family reads back from input_ids, checked against the real transformers processors (a
tiny image processor and a word-level tokenizer holding the models' special tokens) on
several aspect ratios, and against the pixels each token carries into the model."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
from headscope.hf import Tracer, grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.families.idefics3 import tile_side  # noqa: E402
from headscope.hf.testing.families.idefics3 import (FAKE_TOKEN, GLOBAL_TOKEN,  # noqa: E402
                                                    NEWLINE, ROW_COL_BASE, TINY_TILE as TILE)
from headscope.hf.testing import (IMAGE_TOKEN, quarters, tiny_model, tiny_processor,  # noqa: E402
                                  tiny_tokenizer)

TYPES = ("idefics3", "smolvlm")
# TILE (pixels): 4 x 4 patches of 4, 2 x 2 tokens a tile
# (width, height) -> (rows, cols) of tiles: the longest side goes to 48 = 3 tiles, the
# other to a multiple of 16 (the image processor's resize rules)
PICTURES = {(40, 40): (3, 3), (64, 32): (2, 3), (20, 60): (3, 1), (96, 32): (1, 3)}
# the quarters' colours: top left, top right, bottom left, bottom right
COLOURS = ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255))


def processor(model_type: str, monkeypatch):
    """The real processor with the tiny vocabulary's tokens (headscope.hf.testing.checkpoint), left
    padding."""
    import transformers as tf
    if model_type == "idefics3":
        proc = tiny_processor("idefics3")
    else:
        # SmolVLMProcessor insists on num2words, which only its video prompts use
        from transformers.models.smolvlm import processing_smolvlm
        monkeypatch.setattr(processing_smolvlm, "num2words", str)
        sizes = dict(size={"longest_edge": 3 * TILE}, max_image_size={"longest_edge": TILE})
        proc = tf.SmolVLMProcessor(tf.SmolVLMImageProcessor(**sizes), tiny_tokenizer("smolvlm"),
                                   tf.SmolVLMVideoProcessor(), image_seq_len=4)
    proc.tokenizer.padding_side = "left"
    return proc


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    return tiny_model(request.param)


def _call(proc, texts, pictures, **kwargs):
    images = [[quarters(size[1], size[0], COLOURS) for size in row] for row in pictures]
    inputs = proc(text=texts, images=images, return_tensors="pt", padding=True, **kwargs)
    # the rows and cols the processor used and dropped
    info = proc.image_processor(images, return_row_col_info=True, **kwargs)
    return dict(inputs), [rc for r, c in zip(info["rows"], info["cols"]) for rc in zip(r, c)]


def _batch(model, monkeypatch):
    """Three prompts, four pictures of every aspect ratio of PICTURES (two in one row),
    left-padded."""
    proc = processor(model.config.model_type, monkeypatch)
    sizes = list(PICTURES)
    pictures = [[sizes[0]], [sizes[1], sizes[2]], [sizes[3]]]
    texts = ["describe the <image> picture", "<image> left <image> right", "a <image>"]
    return _call(proc, texts, pictures) + (proc,)


def test_tiles_and_global_image_match_the_processor(model, monkeypatch):
    inputs, grids, _ = _batch(model, monkeypatch)
    assert grids == list(PICTURES.values())
    family = family_of(model)
    images = family.images(model.config, inputs)
    side = tile_side(model.config)
    ids = inputs["input_ids"]
    got = [(b, image) for b, row in enumerate(images) for image in row]
    assert [len(row) for row in images] == [1, 2, 1]
    for (b, image), (R, C) in zip(got, grids):
        names = [v.name for v in image.views]
        assert names == ["tile"] * (R * C) + ["global"]
        for k, view in enumerate(image.views[:-1]):
            i, j = divmod(k, C)
            assert (view.rows, view.cols) == (side, side)
            assert view.box == pytest.approx((j / C, i / R, (j + 1) / C, (i + 1) / R))
            # the tile's marker sits right before its tokens
            first = int(view.positions[0])
            assert int(ids[b, first - 1]) == ROW_COL_BASE + 6 * i + j
            assert int(ids[b, first - 2]) == FAKE_TOKEN
        whole = image.views[-1]
        assert (whole.rows, whole.cols, whole.box) == (side, side, (0.0, 0.0, 1.0, 1.0))
        assert image.grid.name == "tiles" and (image.grid.rows, image.grid.cols) == \
            (R * side, C * side)
        # the stitched grid holds exactly the tiles' tokens
        tiles = torch.cat([v.positions for v in image.views[:-1]])
        assert sorted(image.grid.positions.tolist()) == sorted(tiles.tolist())
    for b, row in enumerate(images):
        # every image token in exactly one view; no marker in any
        positions = torch.cat([image.positions for image in row]).tolist()
        assert len(positions) == len(set(positions))
        assert sorted(positions) == (ids[b] == IMAGE_TOKEN).nonzero().flatten().tolist()
        assert sum(len(v.positions) for image in row for v in image.views) == \
            len(positions)
    # one picture per processor image, all its tiles and its global image in pixel_values
    real = (inputs["pixel_attention_mask"].flatten(2).sum(-1) > 0).sum(1).tolist()
    assert real == [sum(len(image.views) for image in row) for row in images]
    # markers are text tokens: region -1 in a real forward
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
    rid = tr.region_ids
    markers = torch.isin(ids, torch.tensor([FAKE_TOKEN, GLOBAL_TOKEN, NEWLINE,
                                            *range(ROW_COL_BASE, ROW_COL_BASE + 36)]))
    assert int(markers.sum()) > 0 and bool((rid[markers] == -1).all())
    assert bool((rid[ids != IMAGE_TOKEN] == -1).all())
    assert bool((rid[ids == IMAGE_TOKEN] >= 0).all())


def test_picture_not_split_is_its_global_image(model, monkeypatch):
    proc = processor(model.config.model_type, monkeypatch)
    inputs, grids = _call(proc, ["a <image> b"], [[(64, 32)]], do_image_splitting=False)
    assert grids == [(0, 0)]
    (image,), = family_of(model).images(model.config, inputs)
    side = tile_side(model.config)
    assert [v.name for v in image.views] == ["global"] and image.grid is image.views[0]
    assert (image.rows, image.cols) == (side, side)
    assert image.positions.tolist() == \
        (inputs["input_ids"][0] == IMAGE_TOKEN).nonzero().flatten().tolist()


def _token_colours(model, inputs, proc) -> torch.Tensor:
    """The quarter colour (index in COLOURS) most of each image token's pixels carry, in
    the order of the image tokens in input_ids: the tiles that are not all zero (as
    get_image_features keeps them), cut into the vision tower's patches row-major, the
    patches' colour counts pixel-shuffled by the model's own connector."""
    config = model.config
    P, s = config.vision_config.patch_size, config.scale_factor
    tiles = inputs["pixel_values"].flatten(0, 1)
    tiles = tiles[(tiles == 0).flatten(1).sum(1) != tiles[0].numel()]
    ip = proc.image_processor
    colours = (torch.tensor(COLOURS, dtype=torch.float64) * ip.rescale_factor
               - torch.tensor(ip.image_mean)) / torch.tensor(ip.image_std)  # (4, 3)
    dist = ((tiles.double()[:, None] - colours[None, :, :, None, None]) ** 2).sum(2)
    onehot = torch.nn.functional.one_hot(dist.argmin(1), 4).double()  # (n, S, S, 4)
    n, S = onehot.shape[:2]
    per_patch = onehot.reshape(n, S // P, P, S // P, P, 4).sum((2, 4)).reshape(n, -1, 4)
    shuffled = model.model.connector.pixel_shuffle(per_patch, s)  # (n, L, s * s * 4)
    counts = shuffled.reshape(n, shuffled.shape[1], s * s, 4).sum(2).reshape(-1, 4)
    # each token lies inside one quarter: nearly all its pixels have that colour
    assert bool((counts.max(1).values >= 0.9 * counts.sum(1)).all())
    return counts.argmax(1)


def test_each_token_lies_in_the_quarter_its_pixels_show(model, monkeypatch):
    inputs, _, proc = _batch(model, monkeypatch)
    colour = _token_colours(model, inputs, proc)
    ids = inputs["input_ids"]
    positions = (ids == IMAGE_TOKEN).nonzero()  # (tokens, 2) in the order features fill
    colour_at = {(int(b), int(t)): int(c) for (b, t), c in zip(positions, colour)}
    assert sorted(set(colour_at.values())) == [0, 1, 2, 3]
    images = family_of(model).images(model.config, inputs)
    quarter = grid_regions(2, 2)
    for b, row in enumerate(images):
        for image in row:
            for view in image.views:
                want = [colour_at[(b, p)] for p in view.positions.tolist()]
                assert quarter.of_boxes(view.boxes).tolist() == want, view
            # the stitched grid puts each tile's tokens in their place on the picture
            want = [colour_at[(b, p)] for p in image.grid.positions.tolist()]
            assert quarter.of_boxes(image.grid.boxes).tolist() == want


@pytest.mark.parametrize("how", ["grid_regions", "labels on the grid"])
def test_quarters_are_one_region_in_every_view(model, monkeypatch, how):
    """grid_regions(2, 2) by box centre, and the same labels given on the stitched grid
    (the global image's tokens joining by overlap): each quarter's tokens of every view
    are one region, the one of the colour they carry."""
    inputs, _, proc = _batch(model, monkeypatch)
    colour = _token_colours(model, inputs, proc)
    regions = grid_regions(2, 2) if how == "grid_regions" else \
        (lambda features, grid: grid_regions(2, 2)(features, grid))
    with torch.no_grad(), Tracer(model, regions=regions, vas=False) as tr:
        model(**inputs)
    ids = inputs["input_ids"]
    rid = tr.region_ids[ids == IMAGE_TOKEN]
    # each picture's regions are numbered after the previous pictures' of its row
    offset = torch.cat([torch.arange(len(row)).repeat_interleave(
        torch.tensor([len(image.positions) for image in row])) * 4 for row in tr.images])
    assert torch.equal(rid - offset, colour)
    assert tr.num_regions == [4 * len(row) for row in tr.images]


def test_plain_generate_needs_no_other_input(model, monkeypatch):
    """The layout comes from input_ids alone: plain model.generate (which hands the
    decoder no pixel inputs after the prompt) gives the same regions as a forward."""
    inputs, _, _ = _batch(model, monkeypatch)
    with torch.no_grad():
        with Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
            model(**inputs)
        with Tracer(model, regions=grid_regions(2, 2), vas=False) as by_generate:
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2
    assert by_generate.region_ids is not None
    assert torch.equal(by_generate.region_ids, tr.region_ids)


def _layout(rows: int, cols: int, newline=(NEWLINE,)):
    seq = [IMAGE_TOKEN] * 4
    ids = [7]
    for i in range(rows):
        for j in range(cols):
            ids += [FAKE_TOKEN, ROW_COL_BASE + 6 * i + j] + seq
        ids += list(newline)
    ids += list(newline) + [FAKE_TOKEN, GLOBAL_TOKEN] + seq + [FAKE_TOKEN, 9]
    return torch.tensor([ids])


def test_layouts_that_do_not_fit_raise(model):
    family = family_of(model)
    images = family.images(model.config, {"input_ids": _layout(2, 3)})
    assert [(v.name, v.box[:2]) for v in images[0][0].views][:4] == \
        [("tile", (0, 0)), ("tile", (1 / 3, 0)), ("tile", (2 / 3, 0)), ("tile", (0, 0.5))]
    with pytest.raises(ValueError, match="no newline token"):
        family.images(model.config, {"input_ids": _layout(2, 3, newline=())})
    cut = _layout(2, 2)[:, :-4]  # the global image's tokens cut short
    with pytest.raises(ValueError, match="each tile and global image of this model is 4"):
        family.images(model.config, {"input_ids": cut})
    ragged = torch.cat([_layout(2, 2)[:, :14], _layout(1, 1)[:, 1:]], 1)
    with pytest.raises(ValueError, match="do not form a grid"):
        family.images(model.config, {"input_ids": ragged})
