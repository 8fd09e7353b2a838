"""Video layouts of Gemma 4, LLaVA-OneVision, Kimi K2.5 and MiniCPM-V 4.6 against their
real tiny processors: each token's frame and box. MiniCPM-V 4.6: new pixels in one frame
change exactly that frame's tokens (source view and slices). Kimi K2.5: every token of a chunk pools its block
in each of the chunk's frames, carrying that frame's colour of its box's quarter. Gemma 4: every token pools its k x k patches (video_position_ids)
of its own sampled frame (4 of 6, evenly), whose pixels carry that source frame's colour
of the token's box's quarter.
LLaVA-OneVision: new pixels in one frame change exactly that frame group's tokens'
decoder inputs (the model's own features), and the newline after the frames is a marker.
Both: a picture and a video in one prompt, in either order."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
np = pytest.importorskip("numpy")

from conftest import QUARTER_COLOURS, nearest_colour  # noqa: E402
from headscope.hf.capture import decoder_kwargs  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.testing import (assert_quarter_colours, quarters, tiny_model,  # noqa: E402
                                  tiny_processor, tiny_of)

FPS = 2.0


def turning_quarters(frames: int, height: int, width: int):
    """(frames, height, width, 3) uint8: frame f's quarter q coloured ``(q + f) % 4`` of the
    quarter colours, so a token's colours give both its frame and its quarter."""
    return np.stack([np.asarray(quarters(height, width, [QUARTER_COLOURS[(q + f) % 4]
                                                         for q in range(4)]))
                     for f in range(frames)])


def run_processor(model, video):
    spec = tiny_of(model).spec
    processor = tiny_processor(model.config.model_type)
    metadata = [dict(total_num_frames=len(video), fps=FPS, duration=len(video) / FPS,
                     frames_indices=list(range(len(video))))]
    inputs = processor(text=[f"describe {spec.video} now ."], videos=[video],
                       video_metadata=metadata, return_metadata=True, return_tensors="pt")
    return processor, dict(inputs)


@pytest.mark.parametrize("size", [(24, 32), (40, 24), (60, 20)])
def test_gemma4_each_token_pools_its_own_frames_quarter(size):
    model = tiny_model("gemma4")
    processor, inputs = run_processor(model, turning_quarters(6, *size))
    (video,), = family_of(model).videos(model.config, inputs)
    sampled = inputs["video_metadata"][0].frames_indices
    assert video.num_frames == len(sampled) == len(video.groups)
    assert list(sampled) != list(range(len(sampled)))  # 4 of 6 frames: some skipped
    assert video.source_frames.tolist() == list(sampled)
    torch.testing.assert_close(video.seconds, torch.as_tensor(sampled, dtype=torch.float64) / FPS)
    k = int(model.config.vision_config.pooling_kernel_size)
    patch = int(model.config.vision_config.patch_size)
    for g, group in enumerate(video.groups):
        source = int(sampled[g])  # the source frame this sampled frame is
        view = group.image.grid
        where = inputs["video_position_ids"][g]
        real = (where >= 0).all(-1)
        pixels = inputs["pixel_values_videos"][g][real].reshape(-1, patch * patch, 3)
        token = (where[real, 1] // k) * view.cols + where[real, 0] // k  # its token, row-major
        assert int(token.max()) + 1 == view.rows * view.cols
        colours = nearest_colour(processor, pixels, normaliser=processor.video_processor)
        per_token = torch.stack([colours[token == t].flatten()
                                 for t in range(view.rows * view.cols)])
        assert_quarter_colours(group.image.boxes, (per_token - source) % 4)


def test_llava_onevision_frames_are_the_model_own():
    model = tiny_model("llava_onevision")
    _, inputs = run_processor(model, turning_quarters(5, 24, 32))
    family = family_of(model)
    (video,), = family.videos(model.config, inputs)
    inputs = family.model_inputs(inputs)
    decoder = model.get_decoder()
    with torch.no_grad():
        before = decoder_kwargs(model, decoder, inputs)["inputs_embeds"][0]
        for f, group in enumerate(video.groups):
            moved = inputs["pixel_values_videos"].clone()
            moved[:, f] += 1
            after = decoder_kwargs(model, decoder,
                                   dict(inputs, pixel_values_videos=moved))["inputs_embeds"][0]
            changed = (after != before).any(-1).nonzero().flatten()
            assert group.frames == (f,)
            assert torch.equal(changed, group.image.positions)
    (marker,) = video.markers.tolist()
    assert marker == int(video.positions.max()) + 1
    assert video.grid[0] == 5


# the text of one picture in a prompt, as each family's processor expects it
PICTURE = {"gemma4": "<|image|>", "llava_onevision": "<image>"}


@pytest.mark.parametrize("model_type", sorted(PICTURE))
@pytest.mark.parametrize("picture_first", [True, False])
def test_a_picture_and_a_video_in_one_prompt(model_type, picture_first):
    """tr.images holds the picture, tr.videos the video, their regions numbered in sequence
    order (tr.media_regions); logits unchanged by the tracer."""
    from headscope.hf import Tracer, grid_regions
    from headscope.hf.families import ImageTokens, VideoTokens
    model = tiny_model(model_type)
    spec = tiny_of(model).spec
    processor = tiny_processor(model_type)
    parts = [PICTURE[model_type], spec.video] if picture_first else [spec.video, PICTURE[model_type]]
    metadata = [dict(total_num_frames=4, fps=FPS, frames_indices=[0, 1, 2, 3])]
    inputs = dict(processor(text=["describe " + " and ".join(parts) + " ."],
                            videos=[turning_quarters(4, 24, 32)], video_metadata=metadata,
                            images=[quarters(32, 24, QUARTER_COLOURS)], return_metadata=True,
                            return_tensors="pt"))
    inputs = family_of(model).model_inputs(inputs)
    with torch.no_grad():
        plain = model(**inputs).logits
        with Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
            assert torch.equal(model(**inputs).logits, plain)
    (picture,), = tr.images
    (video,), = tr.videos
    first, second = tr.media_regions[0]
    want = (picture, video) if picture_first else (video, picture)
    assert first.media is want[0] and second.media is want[1]
    assert isinstance(picture, ImageTokens) and isinstance(video, VideoTokens)
    count = {id(picture): 4, id(video): 4 * len(video.groups)}
    assert (first.first, first.end) == (0, count[id(first.media)])
    assert second.end == tr.num_regions[0] == first.end + count[id(second.media)]
    for part in (first, second):
        ids = tr.region_ids[0, part.media.positions]
        assert int(ids.min()) == part.first and int(ids.max()) == part.end - 1


@pytest.mark.parametrize("frames, size", [(5, (24, 32)), (4, (40, 16))])
def test_kimi_k25_each_chunk_token_pools_its_frames_quarter(frames, size):
    """Kimi K2.5's chunks of 2 frames (the tiny processor's temporal_patch_size): every
    token of a chunk pools its merge block of patches in each of the chunk's frames
    (pixel_values_videos, frame by frame, patches row-major), whose pixels carry that
    frame's colour of the token's box's quarter; the last chunk of an odd count holds one
    frame; seconds from the processor's metadata."""
    model = tiny_model("kimi_k25")
    processor, inputs = run_processor(model, turning_quarters(frames, *size))
    (video,), = family_of(model).videos(model.config, inputs)
    assert video.num_frames == frames
    assert [g.frames for g in video.groups] == [tuple(range(f, min(f + 2, frames)))
                                                for f in range(0, frames, 2)]
    torch.testing.assert_close(video.seconds, torch.arange(frames, dtype=torch.float64) / FPS)
    kh, kw = (int(k) for k in model.config.vision_config.merge_kernel_size)
    patches, start = inputs["pixel_values_videos"], 0
    for group, (t, h, w) in zip(video.groups, inputs["video_grid_thw"].tolist()):
        assert t == len(group.frames)
        chunk = patches[start:start + t * h * w].reshape(t, h // kh, kh, w // kw, kw, 3, -1)
        start += t * h * w
        # (frames, tokens row-major, pixels of its block, channels)
        pixels = chunk.permute(0, 1, 3, 2, 4, 6, 5).reshape(t, (h // kh) * (w // kw), -1, 3)
        for i, frame in enumerate(group.frames):
            colours = nearest_colour(processor, pixels[i], normaliser=processor.video_processor)
            assert_quarter_colours(group.image.boxes, (colours - frame) % 4)
    assert start == len(patches)


@pytest.mark.parametrize("size", [(24, 32), (96, 64)])
def test_minicpmv_frames_are_the_model_own(size):
    """MiniCPM-V 4.6: each sampled frame laid out as a picture (source view, and slices for
    a large frame); new pixels in one frame (its views' patches, NaViT-packed in
    pixel_values_videos) change exactly that frame group's decoder inputs."""
    model = tiny_model("minicpmv4_6")
    _, inputs = run_processor(model, turning_quarters(3, *size))
    family = family_of(model)
    (video,), = family.videos(model.config, inputs)
    sampled = inputs["video_metadata"][0].frames_indices
    assert video.num_frames == len(sampled) == len(video.groups)
    assert video.source_frames.tolist() == list(sampled)
    views = [len(g.image.views) for g in video.groups]
    assert len(set(views)) == 1 and (views[0] > 1) == (size == (96, 64))
    inputs = family.model_inputs(inputs)
    patch = int(model.config.vision_config.patch_size)
    per_view = (inputs["target_sizes_videos"].prod(-1) * patch).tolist()
    decoder = model.get_decoder()
    with torch.no_grad():
        before = decoder_kwargs(model, decoder, inputs)["inputs_embeds"][0]
        start = 0
        for f, group in enumerate(video.groups):
            width = sum(per_view[f * views[0]:(f + 1) * views[0]])
            moved = inputs["pixel_values_videos"].clone()
            moved[..., start:start + width] += 1
            start += width
            after = decoder_kwargs(model, decoder,
                                   dict(inputs, pixel_values_videos=moved))["inputs_embeds"][0]
            changed = (after != before).any(-1).nonzero().flatten()
            assert torch.equal(changed, group.image.positions.sort().values)
    assert start == inputs["pixel_values_videos"].shape[-1]
