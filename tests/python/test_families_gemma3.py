"""Gemma 3's pan-and-scan layout (headscope.hf.families.gemma3) against its real processor
(Gemma3Processor with a tiny image processor and tokenizer, built offline): which grid is
the whole picture and which the crops, each crop's box where the image processor cut it,
on several aspect ratios; a four-coloured picture whose tokens' pixels must lie where
their boxes say; grid_regions through the model; and the Tracer's contract on a
pan-and-scan prompt."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
np = pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

import headscope  # noqa: E402
from headscope.hf import Tracer, grid_regions, region_effects  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.families.gemma3 import pan_and_scan_inputs  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, assert_quarters_are_regions,
                                  eager_reference, quarters, tiny_model, tiny_processor)

# the processor's pan-and-scan settings, its crops' least side cut to the tiny pictures'
PAN_AND_SCAN = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8,
                    pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
# (height, width), as width:height: 5:2 wide (3 crops of 17, 17, 16 pixels), 1:3 tall (3
# of 20), square and 7:6 (below the ratio that cuts: none), 45:8 wide (4 crops of 23, 23,
# 23, 21: the uneven last crop moves every edge off the quarters of the picture), 9:20
# tall (2 of 20), 25:17 wide (2 of 25); even sides, so that the quarters meet at the middle
SIZES = ((20, 50), (60, 20), (30, 30), (24, 28), (16, 90), (40, 18), (34, 50))
CROPS = (3, 3, 0, 0, 4, 2, 2)
COLOURS = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0]], np.uint8)
IMAGE = "<start_of_image>"


@pytest.fixture(scope="module")
def model():
    return tiny_model("gemma3")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("gemma3")


def run_processor(processor, sizes, per_row):
    """The pan-and-scan inputs for prompts of ``per_row`` pictures each (left padding)."""
    pictures = [quarters(*s, COLOURS) for s in sizes]
    nested, i = [], 0
    for count in per_row:
        nested.append(pictures[i:i + count])
        i += count
    texts = ["describe " + " and ".join([IMAGE] * count) + " the image ." for count in per_row]
    processor.tokenizer.padding_side = "left"
    return pan_and_scan_inputs(processor, nested, texts, return_tensors="pt", padding=True,
                               **PAN_AND_SCAN)


def colours_by_picture(processor, inputs, images):
    """Per batch row, per picture: the ``(tokens, pixels)`` index of the nearest of COLOURS
    for each pixel each token reads, in the order of its positions. Each grid is one entry
    of ``pixel_values`` (the pictures' grids in sequence order); the tower's patches are
    average-pooled row-major into the grid's tokens, each token reading a square of
    pixels."""
    ip = processor.image_processor
    mean = torch.tensor(ip.image_mean)[:, None]
    std = torch.tensor(ip.image_std)[:, None]
    refs = (torch.from_numpy(COLOURS).float().T / 255 - mean) / std  # (C, 4)
    pixels = inputs["pixel_values"]
    grids = iter(range(len(pixels)))
    out = []
    for row in images:
        out.append([])
        for image in row:
            per_view = []
            for view in image.views:
                p = pixels[next(grids)]  # (C, S, S)
                cell = p.shape[-1] // view.cols
                cells = p.reshape(p.shape[0], view.rows, cell, view.cols, cell)
                cells = cells.permute(1, 3, 0, 2, 4).reshape(view.rows * view.cols,
                                                             p.shape[0], -1)  # (M, C, P)
                per_view.append(((cells[..., None] - refs[None, :, None]) ** 2)
                                .sum(1).argmin(-1))
            out[-1].append(torch.cat(per_view))
    assert next(grids, None) is None, "grids left over"
    return out


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (3, 1, 3)])
def test_views_follow_the_processors_layout(model, processor, per_row):
    inputs = run_processor(processor, SIZES, per_row)
    assert inputs["num_crops"].tolist() == list(CROPS)
    assert inputs["image_sizes"].tolist() == [list(s) for s in SIZES]
    images = family_of(model).images(model.config, inputs)
    ids = inputs["input_ids"]
    assert [len(row) for row in images] == list(per_row)
    pictures = [image for row in images for image in row]
    for image, crops, (height, width) in zip(pictures, CROPS, SIZES):
        assert [v.name for v in image.views] == ["global"] + ["crop"] * crops
        assert image.grid is image.views[0] and image.views[0].box == (0, 0, 1, 1)
        boxes = [v.box for v in image.views[1:]]
        if crops:  # side by side along the longer side, covering the picture once
            along = (0, 2) if width >= height else (1, 3)
            across = (1, 3) if width >= height else (0, 2)
            assert [(b[across[0]], b[across[1]]) for b in boxes] == [(0.0, 1.0)] * crops
            edges = [b[along[0]] for b in boxes] + [boxes[-1][along[1]]]
            assert edges[0] == 0.0 and edges[-1] == 1.0 and edges == sorted(set(edges))
            assert all(b[along[0]] == a[along[1]] for a, b in zip(boxes, boxes[1:]))
    assert sum(len(im.views) for im in pictures) == len(inputs["pixel_values"])
    for b, row in enumerate(images):
        for image in row:
            for view in image.views:  # one run between the begin and end markers
                assert (view.rows, view.cols) == (4, 4)
                first, last = int(view.positions[0]), int(view.positions[-1])
                assert torch.equal(view.positions, torch.arange(first, last + 1))
                assert int(ids[b, first - 1]) == VISION_START
                assert int(ids[b, last + 1]) == VISION_END
        positions = torch.cat([im.positions for im in row])
        assert torch.equal(positions.sort().values, (ids[b] == IMAGE_TOKEN).nonzero().flatten())


@pytest.mark.parametrize("size", SIZES)
def test_crop_boxes_are_where_the_image_processor_cuts(model, processor, size):
    """Each crop's box, in pixels, is the slice of the picture the image processor's own
    pan_and_scan_batched returns, and its pixels are those of the crop it resized."""
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    height, width = size
    picture = torch.from_numpy(np.array(quarters(*size, COLOURS))).permute(2, 0, 1)
    cuts = processor.image_processor.pan_and_scan_batched(
        picture, **{k: v for k, v in PAN_AND_SCAN.items() if k != "do_pan_and_scan"})
    assert len(cuts) == len(image.views) - 1
    x = torch.arange(width)[None, :].expand(height, -1)
    y = torch.arange(height)[:, None].expand(-1, width)
    for view, cut in zip(image.views[1:], cuts):
        x0, y0, x1, y1 = view.box
        inside = (x >= x0 * width) & (x < x1 * width) & (y >= y0 * height) & (y < y1 * height)
        rows, cols = inside.any(1).nonzero(), inside.any(0).nonzero()
        assert tuple(cut.shape[-2:]) == (len(rows), len(cols))
        assert torch.equal(picture[:, int(rows[0]):int(rows[-1]) + 1,
                                   int(cols[0]):int(cols[-1]) + 1], cut)


@pytest.mark.parametrize("size", SIZES)
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    images = family_of(model).images(model.config, inputs)
    (image,), = images
    (colours,), = colours_by_picture(processor, inputs, images)
    assert_quarter_colours(image.boxes, colours)


def test_grid_regions_give_each_quarter_one_region_in_every_view(model, processor):
    inputs = run_processor(processor, ((20, 50), (60, 20), (30, 30), (16, 90)), (1, 1, 1, 1))
    colours = colours_by_picture(processor, inputs,
                                 family_of(model).images(model.config, inputs))
    tr = assert_quarters_are_regions(model, inputs, lambda b, image: colours[b][0])
    assert [[v.name for v in im.views] for (im,) in tr.images] == \
        [["global"] + ["crop"] * n for n in (3, 3, 0, 4)]


def test_tracer_contract_on_a_pan_and_scan_prompt(model, processor):
    """Logits bitwise; greedy tokens those of plain generate; span features the region
    pooling of the eager attentions of the teacher-forced sequence; VAS of the final
    sequence the reference on eager attentions and head writes; region_effects reads the
    same inputs."""
    inputs = run_processor(processor, ((20, 50), (30, 30), (60, 20)), (2, 1))
    plain_inputs = family_of(model).model_inputs(inputs)
    assert set(inputs) - set(plain_inputs) == {"num_crops", "image_sizes"}
    N = 5
    with torch.no_grad():
        plain = model.generate(**plain_inputs, max_new_tokens=N, do_sample=False,
                               eos_token_id=None)
    every2 = lambda ids: len(ids) % 2 == 0  # noqa: E731
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=True,
                                 splitter=every2) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=N, do_sample=False,
                                 eos_token_id=None))
        rid, K = tr.region_ids, tr.num_regions
        final_vas = tr.vas_features()
    assert torch.equal(tr.sequences, plain)
    assert K == [8, 4]  # row 0: two pictures of 4 quarters each, crops included
    P = inputs["input_ids"].shape[1]
    full = dict(plain_inputs, input_ids=plain,
                attention_mask=torch.nn.functional.pad(inputs["attention_mask"], (0, N),
                                                       value=1),
                token_type_ids=torch.nn.functional.pad(inputs["token_type_ids"], (0, N)))
    eager = tiny_model("gemma3", attn_implementation="eager")
    _, attns, writes = eager_reference(eager, full)
    rid = torch.nn.functional.pad(rid, (0, N), value=-1)
    assert len(spans) == 6
    for s in spans:
        w = torch.zeros(2, P + N)
        w[:, P + s.start - 1:P + s.end - 1] = 1.0  # rows that predicted the span's tokens
        want = headscope.stack_layers(
            [headscope.region_pool(a.float(), w, rid, max(K)) for a in attns])
        torch.testing.assert_close(s.features, want[s.batch_index, :K[s.batch_index]],
                                   atol=1e-5, rtol=1e-5)
    want_vas, _ = headscope.vas_features(attns, writes, full["attention_mask"],
                                         left_padding=True)
    torch.testing.assert_close(final_vas, want_vas, atol=1e-4, rtol=1e-4)
    # region_effects takes the pan-and-scan inputs as they are (it leaves the layout keys)
    one = run_processor(processor, ((20, 50),), (1,))
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        out = tr.generate_with(lambda span: None, **one, max_new_tokens=2, do_sample=False)
    got = region_effects(model, one, out, [(0, 2)], tr.region_ids, progress=False)
    want = region_effects(model, family_of(model).model_inputs(one), out, [(0, 2)],
                          tr.region_ids, progress=False)
    assert got.shape == (1, 4) and torch.equal(got, want)


def test_plain_generate_refuses_the_layout_inputs(model, processor):
    """The layout inputs are headscope's: transformers' generate refuses inputs its model
    does not use, so a pan-and-scan prompt is generated from with tr.generate."""
    inputs = run_processor(processor, ((20, 50),), (1,))
    with pytest.raises(ValueError, match="num_crops"):
        model.generate(**inputs, max_new_tokens=1)


def test_layouts_that_do_not_match_the_prompt_raise(model, processor):
    inputs = run_processor(processor, ((20, 50), (60, 20)), (1, 1))
    family = family_of(model)
    with pytest.raises(ValueError, match="num_crops without image_sizes"):
        family.images(model.config, dict(inputs, image_sizes=None))
    with pytest.raises(ValueError, match=r"image_sizes must be \(2, 2\)"):
        family.images(model.config, dict(inputs, image_sizes=inputs["image_sizes"][:1]))
    with pytest.raises(ValueError, match="more image tokens|do not split|pictures in the"):
        family.images(model.config, dict(inputs, num_crops=torch.tensor([2, 3])))
    with pytest.raises(ValueError, match="leave crop 2 empty"):  # 3 crops of 2 pixels
        family.images(model.config, dict(inputs, image_sizes=torch.tensor([[1, 4], [60, 20]])))
    # without num_crops every grid is read as a picture of its own
    alone = family.images(model.config, family.model_inputs(inputs))
    assert [len(row) for row in alone] == [4, 4]
    assert all(v.name == "base" for row in alone for im in row for v in im.views)
