"""Gemma 4's layout (headscope.hf.families.gemma4) against its real processor
(Gemma4Processor with a tiny image processor and tokenizer, built offline): each picture's
grid as the image processor resizes it, on several aspect ratios; the vision tower's
pooler keeps the tokens row-major (run on an index grid); a four-coloured picture whose
tokens' pixels must lie where their boxes say; grid_regions through the model; and the
Tracer on prompts whose pictures are longer than the sliding window (the sliding layers
see a picture's tokens both ways, the full layers causally)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

import headscope  # noqa: E402
from conftest import (assert_every_image_token_placed,  # noqa: E402
                      assert_generation_keeps_regions, nearest_colour, quarter_prompts)
from headscope.hf import Tracer, grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, assert_quarters_are_regions,
                                  eager_reference, tiny_model, tiny_processor)

# (height, width) of the pictures given to the processor: square, 1:2 wide, 3:1 tall,
# larger than the budget (scaled down), 5:2 and 45:8 wide, odd sizes, and one so thin
# that it is one token tall
SIZES = ((64, 64), (32, 64), (60, 20), (200, 100), (20, 50), (16, 90), (30, 50), (6, 200))
# their token grids: each side scaled by sqrt(budget / area), budget 70 tokens of 8 x 8
# pixels, then cut down to a multiple of 8 pixels (64 x 64: 8 x 8; 32 x 64: 40 x 88 pixels)
GRIDS = ((8, 8), (5, 11), (14, 4), (11, 5), (5, 13), (3, 19), (6, 10), (1, 48))
MARKER = "<|image|>"


@pytest.fixture(scope="module")
def model():
    return tiny_model("gemma4")


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("gemma4")


def run_processor(processor, sizes, per_row):
    return quarter_prompts(processor, sizes, per_row, MARKER, nested=True)


def resized_grid(processor, size):
    """(rows, cols) of a picture of ``size`` by the image processor's own resize rule
    (transformers' ``get_aspect_ratio_preserving_size``)."""
    from transformers.models.gemma4.image_processing_gemma4 import \
        get_aspect_ratio_preserving_size
    ip = processor.image_processor
    k, p = ip.pooling_kernel_size, ip.patch_size
    height, width = get_aspect_ratio_preserving_size(
        *size, patch_size=p, max_patches=ip.max_soft_tokens * k * k, pooling_kernel_size=k)
    return height // (p * k), width // (p * k)


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (3, 1, 4)])
def test_views_follow_the_processors_layout(model, processor, per_row):
    inputs = run_processor(processor, SIZES, per_row)
    images = family_of(model).images(model.config, inputs)
    ids = inputs["input_ids"]
    assert [len(row) for row in images] == list(per_row)
    counts = processor._get_num_multimodal_tokens(image_sizes=SIZES).num_image_tokens
    pictures = [image for row in images for image in row]
    grids = [(im.rows, im.cols) for im in pictures]
    assert grids == [resized_grid(processor, s) for s in SIZES]
    assert [r * c for r, c in grids] == counts
    assert grids == list(GRIDS)
    for image in pictures:
        (view,) = image.views
        assert view.name == "base" and image.grid is view and view.box == (0, 0, 1, 1)
    for b, row in enumerate(images):
        for image in row:  # one run between the begin and end markers
            first, last = int(image.positions[0]), int(image.positions[-1])
            assert torch.equal(image.positions, torch.arange(first, last + 1))
            assert int(ids[b, first - 1]) == VISION_START and int(ids[b, last + 1]) == VISION_END
    assert_every_image_token_placed(images, ids, IMAGE_TOKEN)
    # the bidirectional blocks are the image tokens: what the prompt types give them
    is_image = ids == IMAGE_TOKEN
    assert torch.equal(inputs["mm_token_type_ids"].bool(), is_image)
    assert torch.equal(family_of(model).prompt_types(model, is_image)["mm_token_type_ids"]
                       .long(), inputs["mm_token_type_ids"].long())


def pooled_patches(model, positions: torch.Tensor) -> torch.Tensor:
    """``(tokens, k * k)``: the patches (indices into the picture's ``pixel_values``) each
    token of one picture averages, in the model's token order, found by running the vision
    tower's own pooler on an index grid (patch j's hidden state the unit vector e_j)."""
    pooler = model.model.vision_tower.pooler
    k = model.config.vision_config.pooling_kernel_size
    n = len(positions)
    padding = (positions == -1).all(-1)
    with torch.no_grad():
        pooled, kept = pooler(torch.eye(n)[None], positions[None], padding[None],
                              output_length=n // (k * k))
    pooled = pooled[kept]  # the picture's tokens, padding dropped as the tower drops it
    which = pooled.nonzero()
    assert torch.equal(which[:, 0], torch.arange(len(pooled)).repeat_interleave(k * k))
    return which[:, 1].reshape(len(pooled), k * k)


@pytest.mark.parametrize("size", [(32, 64), (60, 20), (6, 200)])
def test_the_pooler_keeps_the_tokens_row_major(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    k = model.config.vision_config.pooling_kernel_size
    positions = inputs["image_position_ids"][0]
    patches = pooled_patches(model, positions)
    assert len(patches) == image.rows * image.cols
    xy = positions[patches]  # (tokens, k * k, 2)
    rows, cols = torch.arange(len(patches)) // image.cols, torch.arange(len(patches)) % image.cols
    assert bool((xy[..., 1] // k == rows[:, None]).all())
    assert bool((xy[..., 0] // k == cols[:, None]).all())


def colours_at(model, processor, inputs, b: int, picture: int, positions: torch.Tensor
               ) -> torch.Tensor:
    """(len(positions), pixels): the colour index of each pixel read by the tokens at the
    sequence ``positions`` of row ``b``, which holds picture ``picture`` only: each token
    averages the patches the pooler gives it, and the model scatters a picture's tokens
    over its image tokens in sequence order."""
    patches = pooled_patches(model, inputs["image_position_ids"][picture])
    pixels = inputs["pixel_values"][picture][patches]  # (tokens, k * k, p * p * C)
    colours = nearest_colour(processor, pixels.reshape(len(patches), -1, 3))
    order = (inputs["input_ids"][b] == IMAGE_TOKEN).nonzero().flatten()
    assert len(order) == len(colours)
    at = {p: i for i, p in enumerate(order.tolist())}
    return colours[[at[p] for p in positions.tolist()]]


# (the last picture, one token tall, has every token astride the middle line)
@pytest.mark.parametrize("size", SIZES[:-1])
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    assert_quarter_colours(image.boxes, colours_at(model, processor, inputs, 0, 0,
                                                   image.positions))


def test_grid_regions_give_each_quarter_one_region_through_the_model(model, processor):
    inputs = run_processor(processor, ((64, 64), (32, 64), (60, 20)), (1, 1, 1))
    assert_quarters_are_regions(model, inputs, lambda b, image: colours_at(
        model, processor, inputs, b, b, image.positions))


def test_layouts_the_inputs_do_not_hold_raise(model, processor):
    inputs = run_processor(processor, ((32, 64), (60, 20)), (1, 1))
    family = family_of(model)
    with pytest.raises(ValueError, match=r"need the image_position_ids .* tr\.generate"):
        family.images(model.config, dict(inputs, image_position_ids=None))
    swapped = inputs["image_position_ids"].flip(0)  # each row's picture the other's grid
    with pytest.raises(ValueError, match="do not split into whole pictures|more image tokens"):
        family.images(model.config, dict(inputs, image_position_ids=swapped))
    holed = inputs["image_position_ids"].clone()
    holed[0, 5] = -1  # a patch missing from the grid
    with pytest.raises(ValueError, match="not whole"):
        family.images(model.config, dict(inputs, image_position_ids=holed))
    # plain generate hands the model the vision output, not image_position_ids
    assert_generation_keeps_regions(model, inputs, "image_position_ids")


def test_tracer_on_pictures_longer_than_the_sliding_window(model, processor):
    """On the processor's prompts (pictures of 65 and 64 tokens, the window 8): in the
    eager model's attentions a sliding layer's first image token sees its picture's last
    one and a full layer's does not; greedy tokens are plain generate's, span features
    the region pooling of those attentions over the teacher-forced sequence (1e-5), and
    the final sequence's VAS the reference on them (1e-4)."""
    inputs = run_processor(processor, ((20, 50), (64, 64)), (1, 1))
    config = model.config.text_config
    assert config.sliding_window == 8
    N = 5
    with torch.no_grad():
        plain = model.generate(**inputs, max_new_tokens=N, do_sample=False, eos_token_id=None)
    every2 = lambda ids: len(ids) % 2 == 0  # noqa: E731
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=True,
                                 splitter=every2) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=N, do_sample=False,
                                 eos_token_id=None))
        rid, K = tr.region_ids, tr.num_regions
        final_vas = tr.vas_features()
    assert torch.equal(tr.sequences, plain) and K == [4, 4]
    P = inputs["input_ids"].shape[1]
    full = dict(inputs, input_ids=plain,
                attention_mask=torch.nn.functional.pad(inputs["attention_mask"], (0, N),
                                                       value=1),
                mm_token_type_ids=torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, N)))
    eager = tiny_model("gemma4", attn_implementation="eager")
    _, attns, writes = eager_reference(eager, full)
    image = (inputs["input_ids"][0] == IMAGE_TOKEN).nonzero().flatten()
    first, last = int(image[0]), int(image[-1])
    assert last - first > 8
    for layer, kind in enumerate(config.layer_types):
        seen = attns[layer][0, :, first, last]
        assert bool((seen > 0).all()) if kind == "sliding_attention" else bool((seen == 0).all())
    rid = torch.nn.functional.pad(rid, (0, N), value=-1)
    assert len(spans) == 6
    for s in spans:
        w = torch.zeros(2, P + N)
        w[:, P + s.start - 1:P + s.end - 1] = 1.0  # rows that predicted the span's tokens
        want = headscope.stack_layers([headscope.region_pool(a.float(), w, rid, 4)
                                       for a in attns])
        torch.testing.assert_close(s.features, want[s.batch_index], atol=1e-5, rtol=1e-5)
    want_vas, _ = headscope.vas_features(attns, writes, full["attention_mask"],
                                         left_padding=True)
    torch.testing.assert_close(final_vas, want_vas, atol=1e-4, rtol=1e-4)


def test_vas_refuses_a_forward_whose_kv_shared_layers_skip_rows(model, processor):
    """Under an int logits_to_keep the KV-shared last layers run the kept rows only: VAS,
    which needs every row, raises naming it; without it the same forward is traced."""
    inputs = run_processor(processor, ((32, 64),), (1,))
    config = model.config.text_config
    assert config.kv_sharing_modes[-2:] == ["reuse", "reuse"]
    with torch.no_grad(), Tracer(model, vas=True) as tr:
        with pytest.raises(NotImplementedError, match=r"decoder layer 2 ran 1 of the "
                                                      r"sequence's \d+ query rows.*"
                                                      r"without logits_to_keep"):
            model(**inputs, logits_to_keep=1)
        model(**inputs)
        assert tr.vas_features().shape == (1, 36)
