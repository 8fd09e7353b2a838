"""Qwen-VL's layout, one grid of merged patches per picture, against the real processors
(tiny image processors and tokenizer, built offline) of the model types whose geometry it
checks: Qwen3.5 and Qwen3.5-MoE (headscope.hf.families.qwen_vl; Qwen3VLProcessor, their
hybrid decoders traced on their softmax layers), GLM-4.1V, GLM-4.5V and GLM-4.6V
(headscope.hf.families.glm4v; Glm4vProcessor, Glm46VProcessor), Cosmos 3 Edge
(headscope.hf.families.cosmos3; Cosmos3EdgeProcessor) and ERNIE 4.5-VL
(headscope.hf.families.ernie4_5_vl; Ernie4_5_VLMoeProcessor): each picture's grid and
markers for several aspect ratios, a four-coloured picture whose tokens' pixels must lie where
their boxes say, and grid_regions on it through the tiny models."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

from conftest import (assert_every_image_token_placed,  # noqa: E402
                      assert_generation_keeps_regions, assert_grids_are_checked,
                      nearest_colour, quarter_prompts)
from headscope.hf import Tracer, grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing import (IMAGE_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, assert_quarters_are_regions,
                                  tiny_model, tiny_processor)

# a picture in the prompt text, by family
IMAGE = {"qwen_vl": "<|vision_start|><|image_pad|><|vision_end|>",
         "glm4v": "<|begin_of_image|><|image|><|end_of_image|>",
         "cosmos3": "<|vision_start|><|image_pad|><|vision_end|>",
         "ernie4_5_vl": "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"}
HYBRID = ("qwen3_5", "qwen3_5_moe")
# (height, width): square, 1:2 wide, 3:1 tall, larger than max_pixels (scaled down),
# thin, and odd sizes
SIZES = ((32, 32), (24, 48), (60, 20), (200, 100), (16, 40), (30, 50))


@pytest.fixture(scope="module", params=[*HYBRID, "glm4v", "glm4v_moe", "glm46v",
                                                     "cosmos3_edge", "ernie4_5_vl_moe"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def processor(model):
    processor = tiny_processor(model.config.model_type)
    processor.picture = IMAGE[family_of(model).name]
    return processor


def run_processor(processor, sizes, per_row):
    return quarter_prompts(processor, sizes, per_row, processor.picture)


def test_a_hybrid_decoder_is_traced_on_its_softmax_layers_only(model, processor):
    """Qwen3.5's gated delta nets are not traced; every layer of the others is."""
    inputs = run_processor(processor, ((24, 48),), (1,))
    text = model.config.text_config
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=True) as tr:
        model(**inputs)
        layers = tr.layers
    assert layers == [i for i, t in enumerate(types) if t == "full_attention"]
    if model.config.model_type in HYBRID:
        assert 0 < len(layers) < text.num_hidden_layers


@pytest.mark.parametrize("per_row", [(1,) * len(SIZES), (2, 1, 3)])
def test_views_follow_the_processors_layout(model, processor, per_row):
    inputs = run_processor(processor, SIZES, per_row)
    images = family_of(model).images(model.config, inputs)
    ids = inputs["input_ids"]
    assert [len(row) for row in images] == list(per_row)
    want_tokens = processor._get_num_multimodal_tokens(image_sizes=SIZES).num_image_tokens
    picture = 0
    for b, row in enumerate(images):
        for image in row:
            t, h, w = inputs["image_grid_thw"][picture].tolist()
            (view,) = image.views
            assert view.name == "base" and image.grid is view and view.box == (0, 0, 1, 1)
            assert (view.rows, view.cols) == (h // 2, w // 2) and t == 1
            assert view.rows * view.cols == want_tokens[picture]
            # one run of image tokens between the begin and end markers
            first, last = int(view.positions[0]), int(view.positions[-1])
            assert torch.equal(view.positions, torch.arange(first, last + 1))
            assert int(ids[b, first - 1]) == VISION_START and int(ids[b, last + 1]) == VISION_END
            picture += 1
    assert picture == len(SIZES)
    assert_every_image_token_placed(images, ids, IMAGE_TOKEN)


def test_a_grid_that_does_not_match_input_ids_raises(model, processor):
    assert_grids_are_checked(model, run_processor(processor, ((24, 48),), (1,)))


def patch_pixels(model, patches: torch.Tensor) -> torch.Tensor:
    """``(patches, p * p, channels)``: the pixels of each patch row of ``pixel_values``,
    which holds channels x time x p x p (Qwen-VL's, GLM-4V's; ERNIE 4.5-VL's of one frame),
    or p x p x channels of one frame (Cosmos 3 Edge's, which its patch embedding reads as
    one linear layer)."""
    vc = model.config.vision_config
    if model.config.model_type == "cosmos3_edge":
        return patches.reshape(len(patches), -1, vc.num_channels)
    p, T = vc.patch_size, getattr(vc, "temporal_patch_size", 1)
    return patches.reshape(len(patches), vc.in_channels, T, p * p)[:, :, 0].transpose(1, 2)


def token_colours(model, processor, inputs, picture: int) -> torch.Tensor:
    """(tokens, pixels): the index of the nearest quarter colour for each pixel each token of
    ``picture`` reads, in the model's token order. The vision tower merges each run of
    ``merge ** 2`` consecutive patches into one token (GLM-4V's downsampling convolution
    over ``view(-1, merge, merge, hidden)``, Qwen3.5's patch merger, Cosmos 3 Edge's
    projector and ERNIE 4.5-VL's resampler over ``view(-1, hidden * merge ** 2)``)."""
    m = model.config.vision_config.spatial_merge_size
    sizes = inputs["image_grid_thw"].prod(-1).tolist()
    start = sum(sizes[:picture])
    pixels = patch_pixels(model, inputs["pixel_values"][start:start + sizes[picture]])
    return nearest_colour(processor, pixels.reshape(len(pixels) // (m * m), -1,
                                                    pixels.shape[-1]))


def test_patches_merge_into_the_processors_token_order(model, processor):
    """What token_colours assumes, through the model's own vision tower: its downsampling
    convolution (GLM-4V) or its patch merger's first linear layer (Qwen3.5; Cosmos 3
    Edge's projector and ERNIE 4.5-VL's resampler, outside the tower) receives the patches
    in runs of merge ** 2 (one token each)."""
    inputs = run_processor(processor, ((24, 48),), (1,))
    if hasattr(model.model, "resampler_model"):  # ERNIE 4.5-VL
        visual, convolution = model.model.vision_tower, False
        merging = model.model.resampler_model.spatial_linear.fc1
    else:
        visual = model.model.visual
        convolution = hasattr(visual, "downsample")
        merger = visual.merger if hasattr(visual, "merger") else model.model.projector
        merging = visual.downsample if convolution else merger.linear_fc1
    got = []
    hook = merging.register_forward_pre_hook(lambda module, args: got.append(args[0].shape))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    m, hidden = model.config.vision_config.spatial_merge_size, visual.config.hidden_size
    tokens = len(inputs["pixel_values"]) // (m * m)
    want = (tokens, hidden, m, m) if convolution else (tokens, hidden * m * m)
    assert got == [torch.Size(want)]


@pytest.mark.parametrize("size", SIZES)
def test_each_tokens_pixels_carry_the_colour_of_its_boxes_quarter(model, processor, size):
    inputs = run_processor(processor, (size,), (1,))
    (image,), = family_of(model).images(model.config, inputs)
    colours = token_colours(model, processor, inputs, 0)
    assert_quarter_colours(image.boxes, colours)


def test_grid_regions_give_each_quarter_one_region_through_the_model(model, processor):
    inputs = run_processor(processor, ((32, 32), (24, 48), (60, 20)), (1, 1, 1))
    assert_quarters_are_regions(
        model, inputs, lambda b, image: token_colours(model, processor, inputs, b))


def test_generation_keeps_the_prompts_regions(model, processor):
    """tr.generate hands image_grid_thw to the forward; plain model.generate does not, and
    the Tracer says so rather than guess the grids."""
    inputs = run_processor(processor, ((24, 48), (60, 20), (32, 32)), (2, 1))
    assert_generation_keeps_regions(model, inputs, "image_grid_thw")
