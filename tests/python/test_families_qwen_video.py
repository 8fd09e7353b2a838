"""Qwen-VL's layout of videos against the real processors (tiny video processors and
tokenizer, built offline) of every model type that shares it: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (headscope.hf.families.qwen_vl), GLM-4.1V,
GLM-4.5V and GLM-4.6V (glm4v: frames in image tokens between the video markers), ERNIE
4.5-VL (ernie4_5_vl: frames joined in pairs by the resampler) and Cosmos 3 Edge (cosmos3:
one frame per group). For several frame counts (odd ones, whose last frame the processor
repeats) and aspect ratios: each video's frame groups, tokens and markers; the frames each
token's pixels come from (frames of distinct grey levels read from
``pixel_values_videos``); each token's box (four-coloured frames); its seconds against the
processor's own timestamps; regions in space and time through the tiny models; a picture
and a video in one prompt; and the errors for inputs that do not fit."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
np = pytest.importorskip("numpy")
pytest.importorskip("PIL.Image")

from conftest import QUARTER_COLOURS, nearest_colour  # noqa: E402
from headscope.hf import Tracer, grid_regions  # noqa: E402
from headscope.hf.families import family_of  # noqa: E402
from headscope.hf.families.base import Family  # noqa: E402
from headscope.hf.testing import (VISION_END, VISION_START,  # noqa: E402
                                  assert_quarter_colours, quarters, tiny_model, tiny_of,
                                  tiny_processor)
from headscope.hf.testing.tokens import MARKER_IDS  # noqa: E402

QWEN2 = ("qwen2_vl", "qwen2_5_vl")
QWEN3 = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
GLM = ("glm4v", "glm4v_moe", "glm46v")
TYPES = (*QWEN2, *QWEN3, *GLM, "ernie4_5_vl_moe", "cosmos3_edge")
# the tiny GLM's and ERNIE's video begin and end markers (their TinySpec's)
VIDEO_START, VIDEO_END = MARKER_IDS[5], MARKER_IDS[6]
# a picture in the prompt text, by family
PICTURE = {"qwen_vl": "<|vision_start|><|image_pad|><|vision_end|>",
           "cosmos3": "<|vision_start|><|image_pad|><|vision_end|>",
           "ernie4_5_vl": "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>",
           "glm4v": "<|begin_of_image|><|image|><|end_of_image|>"}
FPS = 2.0
# (frames, height, width): even and odd frame counts, square, wide, tall and thin frames
CLIPS = ((8, 32, 32), (5, 24, 48), (6, 60, 20), (3, 16, 40))
# each frame of a grey clip one level, far enough apart to read back after normalising
GREYS = tuple(20 + 18 * i for i in range(12))


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def processor(model):
    return tiny_processor(model.config.model_type)


def clip(kind: str, frames: int, height: int, width: int, seed: int = 0):
    """(frames, height, width, 3) uint8: ``"grey"``, frame i one level GREYS[i];
    ``"quarters"``, every frame four coloured quarters; ``"noise"``, random."""
    if kind == "grey":
        return np.stack([np.full((height, width, 3), GREYS[i], np.uint8) for i in range(frames)])
    if kind == "quarters":
        return np.stack([np.asarray(quarters(height, width, QUARTER_COLOURS))] * frames)
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), np.uint8)


def video_inputs(model, processor, clips, per_row, images=None, picture_first=False):
    """The processor's inputs, left-padded, for prompts of ``per_row[b]`` videos each (the
    ``clips`` in order; ``images``: one picture more per row, before the videos with
    ``picture_first``, else after), each clip's frames at ``FPS``, with their
    ``video_metadata``."""
    spec = tiny_of(model).spec
    picture = PICTURE[family_of(model).name]
    texts = []
    for count in per_row:
        parts = ["describe"] + [spec.video] * count
        if images is not None:
            parts.insert(1 if picture_first else len(parts), picture)
        texts.append(" and ".join(parts) + " .")
    metadata = [dict(total_num_frames=len(c), fps=FPS, frames_indices=list(range(len(c))))
                for c in clips]
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, videos=list(clips), images=images, video_metadata=metadata,
                       return_metadata=True, padding=True, return_tensors="pt")
    return dict(inputs)


def token_pixels(model, inputs, video) -> torch.Tensor:
    """``(tokens, frames_per_group, pixels, channels)``: the pixels each of ``video``'s
    tokens reads from each of its frame slots, from ``pixel_values_videos``, tokens in the
    order of ``video.positions``. Patches come merge x merge block by block (each block
    one token), frame group by frame group; Qwen-VL's and GLM's rows hold channels x
    frames x p x p, ERNIE's one frame's channels x p x p (the resampler joins the rows of
    two consecutive frames), Cosmos 3 Edge's one frame's p x p x channels."""
    vc = model.config.vision_config
    p, m = vc.patch_size, vc.spatial_merge_size
    thw = inputs["video_grid_thw"]
    start = int(thw[:video.index].prod(-1).sum())
    rows = inputs["pixel_values_videos"][start:start + int(thw[video.index].prod())]
    G, R, C = video.grid
    per_token = m * m
    if model.config.model_type == "cosmos3_edge":
        return rows.reshape(G * R * C, 1, per_token * p * p, -1)
    if model.config.model_type == "ernie4_5_vl_moe":
        x = rows.reshape(G, 2, R * C, per_token, -1, p * p)  # (groups, frame, token, ...)
        return x.permute(0, 2, 1, 3, 5, 4).reshape(G * R * C, 2, per_token * p * p, -1)
    T = vc.temporal_patch_size
    x = rows.reshape(G * R * C, per_token, -1, T, p * p)  # channels, frames, pixels
    return x.permute(0, 3, 1, 4, 2).reshape(G * R * C, T, per_token * p * p, -1)


def frame_slots(video) -> torch.Tensor:
    """``(tokens, frames_per_group)``: the sampled frame in each frame slot of each token:
    its group's frames, the last repeated where the processor repeats it."""
    per = video.frames_per_group
    rows = [[g.frames[min(i, len(g.frames) - 1)] for i in range(per)]
            for g in video.groups for _ in range(len(g.image.positions))]
    return torch.tensor(rows)


# ---- the layout ---------------------------------------------------------------------------

@pytest.mark.parametrize("per_row", [(1, 1, 1, 1), (2, 1, 1)])
def test_video_tokens_follow_the_processors_layout(model, processor, per_row):
    clips = [clip("noise", *c, seed=i) for i, c in enumerate(CLIPS)]
    inputs = video_inputs(model, processor, clips, per_row)
    family = family_of(model)
    config = model.config
    assert family.images(config, inputs) == [[] for _ in per_row]  # videos only
    videos = family.videos(config, inputs)
    assert [len(row) for row in videos] == list(per_row)
    assert [v.index for row in videos for v in row] == list(range(len(CLIPS)))
    ids, types = inputs["input_ids"], inputs["mm_token_type_ids"]
    per_group = 1 if config.model_type == "cosmos3_edge" else 2
    for b, row in enumerate(videos):
        # the processor types each video token 2: exactly the videos' positions
        seen = torch.cat([v.positions for v in row]).sort().values
        assert torch.equal(seen, (types[b] == 2).nonzero().flatten())
        for video in row:
            frames, height, width = CLIPS[video.index]
            metadata = inputs["video_metadata"][video.index]
            assert video.num_frames == len(metadata.frames_indices)
            sampled = torch.as_tensor(metadata.frames_indices)
            assert torch.equal(video.source_frames, sampled)
            torch.testing.assert_close(video.seconds, sampled.double() / FPS)
            assert video.frames_per_group == per_group
            G, R, C = video.grid
            t, h, w = inputs["video_grid_thw"][video.index].tolist()
            assert (G * per_group if config.model_type == "ernie4_5_vl_moe" else G, R, C) == \
                (t, h // 2, w // 2)
            want = processor._get_num_multimodal_tokens(
                video_sizes=[(video.num_frames, height, width)]).num_video_tokens[0]
            assert len(video.positions) == want == G * R * C
            for g, group in enumerate(video.groups):
                (view,) = group.image.views
                assert view.name == "base" and view.box == (0, 0, 1, 1) and \
                    (view.rows, view.cols) == (R, C)
                assert group.frames == tuple(range(g * per_group, min((g + 1) * per_group,
                                                                      video.num_frames)))
            assert_markers(config.model_type, ids[b], video)


def assert_markers(model_type: str, ids: torch.Tensor, video) -> None:
    """Each frame group's run between vision start and end (Qwen3-VL, Qwen3.5, Cosmos 3
    Edge; GLM's begin and end of image, the whole video between its begin and end of
    video), or the whole video one run (Qwen2-VL, Qwen2.5-VL between vision start and end,
    ERNIE between its video start and end)."""
    first, last = int(video.positions[0]), int(video.positions[-1])
    if model_type in (*QWEN2, "ernie4_5_vl_moe"):
        assert torch.equal(video.positions, torch.arange(first, last + 1))
        before, after = (VIDEO_START, VIDEO_END) if model_type.startswith("ernie") \
            else (VISION_START, VISION_END)
        assert (int(ids[first - 1]), int(ids[last + 1])) == (before, after)
        return
    for group in video.groups:
        (view,) = group.image.views
        start, end = int(view.positions[0]), int(view.positions[-1])
        assert torch.equal(view.positions, torch.arange(start, end + 1))
        assert (int(ids[start - 1]), int(ids[end + 1])) == (VISION_START, VISION_END)
    if model_type in GLM:
        opened = (ids[:first] == VIDEO_START).nonzero().flatten()
        assert len(opened) and not bool((ids[int(opened[-1]):last] == VIDEO_END).any())
        assert bool((ids[last:] == VIDEO_END).any())


@pytest.mark.parametrize("frames", [4, 5, 7])
def test_each_tokens_frames_are_the_frames_its_pixels_come_from(model, processor, frames):
    """Frames of distinct grey levels: every pixel each token reads in each of its frame
    slots is the grey of the sampled frame the layout says that slot holds (the processor
    repeats an odd count's last frame in the last group's second slot)."""
    inputs = video_inputs(model, processor, [clip("grey", frames, 24, 32)], (1,))
    (video,), = family_of(model).videos(model.config, inputs)
    pixels = token_pixels(model, inputs, video)  # (tokens, slots, pixels, channels)
    levels = [(g, g, g) for g in GREYS[:frames]]
    read = nearest_colour(processor, pixels.flatten(0, 1), levels,
                          normaliser=processor.video_processor).reshape(pixels.shape[:3])
    want = video.source_frames[frame_slots(video)]
    assert bool((read == want[..., None]).all())
    assert video.num_frames == (frames if model.config.model_type not in GLM
                                else frames + frames % 2)  # GLM's sampler repeats the last


@pytest.mark.parametrize("size", [(32, 32), (24, 48), (60, 20), (30, 50)])
def test_each_tokens_box_holds_the_quarter_its_pixels_show(model, processor, size):
    inputs = video_inputs(model, processor, [clip("quarters", 4, *size)], (1,))
    (video,), = family_of(model).videos(model.config, inputs)
    pixels = token_pixels(model, inputs, video)
    colours = nearest_colour(processor, pixels.flatten(1, 2),
                             normaliser=processor.video_processor)
    assert_quarter_colours(video.boxes, colours)


def test_seconds_are_the_processors_timestamps(model, processor):
    """Where the processor writes each group's time into the prompt (Qwen3-VL, Qwen3.5,
    Cosmos 3 Edge: its frames' mean time; GLM: its first frame's) or hands it to the
    model (Qwen2.5-VL's seconds per group), it is the time of the frames the layout
    gives the group."""
    model_type = model.config.model_type
    inputs = video_inputs(model, processor, [clip("noise", 7, 24, 32)], (1,))
    (video,), = family_of(model).videos(model.config, inputs)
    metadata = inputs["video_metadata"][0]
    firsts = torch.stack([video.seconds[g.frames[0]] for g in video.groups])
    lasts = torch.stack([video.seconds[g.frames[-1]] for g in video.groups])
    if model_type in (*QWEN3, "cosmos3_edge"):
        told = processor._calculate_timestamps(list(metadata.frames_indices), metadata.fps,
                                               processor.video_processor.temporal_patch_size)
        torch.testing.assert_close((firsts + lasts) / 2, torch.tensor(told, dtype=torch.float64))
    elif model_type in GLM:
        torch.testing.assert_close(firsts, torch.tensor(metadata.timestamps[::2],
                                                        dtype=torch.float64))
    elif model_type == "qwen2_5_vl":
        per_group = float(inputs["second_per_grid_ts"][0])
        torch.testing.assert_close(firsts[1:] - firsts[:-1],
                                   torch.full((len(firsts) - 1,), per_group, dtype=torch.float64))
    else:
        pytest.skip(f"the {model_type} processor says nothing of time")


# ---- regions in space and time, through the model -------------------------------------------

def test_grid_regions_per_frame_group_and_per_window_through_the_model(model, processor):
    """Four-coloured frames: grid_regions(2, 2) gives every frame group its four quarters
    (numbered group by group), frames=W windows of W frames; logits bitwise the model's."""
    inputs = video_inputs(model, processor, [clip("quarters", 8, 24, 32)], (1,))
    (video,), = family_of(model).videos(model.config, inputs)
    pixels = token_pixels(model, inputs, video)
    colours = nearest_colour(processor, pixels.flatten(1, 2), normaliser=processor.video_processor)
    single = (colours == colours[:, :1]).all(1)  # tokens whose pixels read one colour only
    group = torch.cat([torch.full((len(g.image.positions),), i)
                       for i, g in enumerate(video.groups)])
    per_group = video.frames_per_group
    with torch.no_grad():
        plain = model(**family_of(model).model_inputs(inputs)).logits
    for regions, window in [(grid_regions(2, 2), per_group),
                            (grid_regions(2, 2, frames=4), 4),
                            (grid_regions(2, 2, frames=8), 8)]:
        with torch.no_grad(), Tracer(model, regions=regions, vas=False) as tr:
            assert torch.equal(model(**inputs).logits, plain)
        (traced,), = tr.videos
        assert tr.images == [[]]
        assert tr.num_regions == [4 * -(-8 // window)]
        got = tr.region_ids[0, video.positions]
        want = group * per_group // window * 4 + colours[:, 0]
        assert torch.equal(got[single], want[single])
        elsewhere = torch.ones(inputs["input_ids"].shape[1], dtype=torch.bool)
        elsewhere[video.positions] = False
        assert bool((tr.region_ids[0][elsewhere] == -1).all())
    if per_group > 1:  # a window must hold whole frame groups
        with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2, frames=3), vas=False), \
                pytest.raises(ValueError, match=r"frames=3 must be a multiple of the 2 frames"):
            model(**inputs)


def test_ward_regions_given_labels_and_callables_over_space_and_time(model, processor):
    """regions=K clusters the frame groups' tokens adjacent in space or, at the same
    place, in time: features that change only between the first and the second half of
    the video, and between the frame's left and right, give K=2 the halves in time and
    K=4 halves in time and space. Labels of the (G, R, C) space-time grid pass through as
    given; a callable gets the features and (G, R, C)."""
    from headscope.hf.regions import video_labels
    inputs = video_inputs(model, processor, [clip("noise", 8, 24, 32)], (1,))
    (video,), = family_of(model).videos(model.config, inputs)
    G, R, C = video.grid
    group = torch.arange(G)[:, None, None].expand(G, R, C)
    right = torch.arange(C)[None, None, :].expand(G, R, C)
    late = group >= G // 2
    noise = torch.randn(G, R, C, 3, generator=torch.Generator().manual_seed(0)) * 1e-3
    features = (noise + torch.stack([late * 100.0, (right >= C // 2) * 1.0,
                                     torch.zeros(G, R, C)], -1)).reshape(G * R * C, 3)
    labels, count = video_labels(2, video, features)
    assert count == 2 and torch.equal(labels, late.flatten().long())
    labels, count = video_labels(4, video, features)
    halves = late.long() * 2 + (right >= C // 2).long()
    assert count == 4 and torch.equal(labels, halves.flatten())
    given = torch.arange(G * R * C) % 5
    assert torch.equal(video_labels(given, video, features)[0], given)
    seen = []

    def callable_regions(feats, grid):
        seen.append((feats.shape, grid))
        return torch.zeros(feats.shape[0], dtype=torch.int64)
    labels, count = video_labels(callable_regions, video, features)
    assert count == 1 and not bool(labels.any())
    assert seen == [(features.shape, (G, R, C))]
    with pytest.raises(ValueError, match=rf"must be an int64 tensor \({G * R * C},\) for the "
                                         rf"video's {G} frame groups of {R}x{C} tokens"):
        video_labels(torch.zeros(R * C, dtype=torch.int64), video, features)
    with pytest.raises(ValueError, match=rf"must be in \[1, {G * R * C}\]"):
        video_labels(G * R * C + 1, video, features)


def test_a_picture_and_a_video_in_one_prompt(model, processor):
    """tr.images holds the picture, tr.videos the video, and their regions are numbered in
    sequence order (tr.media_regions). GLM's model scatters a picture's features into
    every image token, its video's too, so it takes no such prompt; its reading still
    tells them apart."""
    from headscope.hf.families import ImageTokens, VideoTokens
    picture = quarters(24, 32, QUARTER_COLOURS)
    for picture_first in (True, False):
        inputs = video_inputs(model, processor, [clip("noise", 4, 24, 32)], (1,),
                              images=[picture], picture_first=picture_first)
        family = family_of(model)
        (image,), = family.images(model.config, inputs)
        (video,), = family.videos(model.config, inputs)
        types = inputs["mm_token_type_ids"][0]
        assert torch.equal(image.positions.sort().values, (types == 1).nonzero().flatten())
        assert torch.equal(video.positions.sort().values, (types == 2).nonzero().flatten())
        if model.config.model_type in GLM:
            with pytest.raises(Exception, match="Image features and image tokens do not match"):
                with torch.no_grad():
                    model(**family.model_inputs(inputs))
            continue
        with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
            model(**inputs)
        (first, second), = tr.media_regions
        kinds = (ImageTokens, VideoTokens) if picture_first else (VideoTokens, ImageTokens)
        assert (type(first.media), type(second.media)) == kinds
        count = {ImageTokens: 4, VideoTokens: 4 * len(video.groups)}
        assert (first.first, first.end) == (0, count[kinds[0]])
        assert (second.first, second.end) == (first.end, first.end + count[kinds[1]])
        assert tr.num_regions == [second.end]
        for part in (first, second):
            ids = tr.region_ids[0, part.media.positions]
            assert int(ids.min()) == part.first and int(ids.max()) == part.end - 1


# ---- inputs that do not fit ------------------------------------------------------------------

def test_video_inputs_are_checked(model, processor):
    family, config = family_of(model), model.config
    inputs = video_inputs(model, processor, [clip("noise", 5, 24, 32)], (1,))
    with pytest.raises(ValueError, match="need the video_grid_thw"):
        family.videos(config, dict(inputs, video_grid_thw=None))
    taller = inputs["video_grid_thw"] * torch.tensor([1, 2, 1])
    with pytest.raises(ValueError, match="do not split into whole videos|more video tokens"):
        family.videos(config, dict(inputs, video_grid_thw=taller))
    metadata = [dict(inputs["video_metadata"][0], frames_indices=list(range(12)))]
    with pytest.raises(ValueError, match="video_metadata lists 12 sampled frames, but its"):
        family.videos(config, dict(inputs, video_metadata=metadata))
    if config.model_type in (*QWEN3, *GLM, "cosmos3_edge"):
        # the same tokens as one group, whose tokens are then no one run: each group's run
        # lies between its own markers
        t, h, w = inputs["video_grid_thw"][0].tolist()
        assert t > 1
        with pytest.raises(ValueError, match="frame group 0 of video 0 is not one run"):
            family.videos(config, dict(inputs, video_grid_thw=torch.tensor([[1, h * t, w]]),
                                       video_metadata=None))
    # without video_metadata: the groups' frame slots, times unknown
    (video,), = family.videos(config, dict(inputs, video_metadata=None))
    assert video.seconds is None and video.source_frames is None
    assert video.num_frames == len(video.groups) * video.frames_per_group


def test_generation_reads_videos_and_plain_generate_is_told_to_use_the_tracer(model,
                                                                              processor):
    """The diagnosis a video-only prompt got before: tr.generate passes video_grid_thw on
    and keeps the prompt's regions; plain model.generate does not hand it to the forward,
    and the Tracer names it."""
    inputs = video_inputs(model, processor, [clip("noise", 4, 24, 32)], (1,))
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), vas=False) as tr:
        model(**inputs)
        want = tr.region_ids.clone()
        spans = list(tr.generate(**inputs, max_new_tokens=2, do_sample=False))
        assert spans and spans[0].features.shape[0] == tr.num_regions[0] > 0
        assert torch.equal(tr.region_ids[:, :want.shape[1]], want)
        with pytest.raises(ValueError, match="need the video_grid_thw"):
            model.generate(**family_of(model).model_inputs(inputs), max_new_tokens=1,
                           do_sample=False)


def test_a_family_that_reads_no_video_refuses_video_tokens(monkeypatch):
    """The default Family.videos: no video without video tokens, an error naming the model
    type with them; the Tracer refuses pixel_values_videos whose tokens its family
    does not find."""
    from types import SimpleNamespace
    config = SimpleNamespace(model_type="some_vlm", video_token_id=7)
    bare = Family()
    assert bare.videos(config, {"input_ids": torch.tensor([[1, 2], [3, 4]])}) == [[], []]
    with pytest.raises(NotImplementedError, match="does not read the video layout of a "
                                                  "some_vlm model yet"):
        bare.videos(config, {"input_ids": torch.tensor([[1, 7]])})
    model = tiny_model("qwen2_vl")
    inputs = video_inputs(model, tiny_processor("qwen2_vl"), [clip("noise", 4, 24, 32)], (1,))
    tr = Tracer(model, regions=2, vas=False)
    monkeypatch.setattr(tr.family, "videos", lambda config, inputs: [[]])
    with tr, torch.no_grad(), pytest.raises(NotImplementedError,
                                            match=r"inputs hold a video \(pixel_values_videos\)"):
        model(**inputs)
