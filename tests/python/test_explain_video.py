"""``python -m headscope explain --video`` and ``headscope.explain(videos=)`` on real video
files the tests write (PyAV): decoding and frame sampling as the model's video processor
does them (``headscope.videos``), the command against a plain Tracer run (report.json),
the frame groups' scores, bad input (one line, exit 2, nothing created), and the page and
the live page in headless Chromium."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
av = pytest.importorskip("av", reason="writing the test videos needs PyAV: pip install av")

from headscope.commands import main  # noqa: E402
from headscope.hf.testing import quarters, tiny_checkpoint  # noqa: E402
from headscope.videos import decoder_missing  # noqa: E402
from conftest import usage_error, with_options  # noqa: E402

if decoder_missing():
    pytest.skip(decoder_missing(), allow_module_level=True)

PROMPT = "describe the video ."
FPS = 4
SIDE = (64, 48)          # width, height of the test videos
COLOURS = ((200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40))


def frame_pixels(i: int, n: int) -> np.ndarray:
    """Frame ``i`` of ``n``: a grey level of its own (``20 + 20 i``) with a red square
    moving from left to right."""
    width, height = SIDE
    frame = np.full((height, width, 3), 20 + 20 * i, dtype=np.uint8)
    x = i * (width - 16) // max(n - 1, 1)
    frame[16:32, x:x + 16] = (230, 30, 30)
    return frame


def write_video(path: Path, n: int, fps: int = FPS) -> Path:
    """An MPEG-4 file of ``n`` frames (:func:`frame_pixels`) at ``fps``."""
    container = av.open(str(path), "w")
    stream = container.add_stream("mpeg4", rate=fps)
    stream.width, stream.height = SIDE
    stream.pix_fmt = "yuv420p"
    for i in range(n):
        frame = av.VideoFrame.from_ndarray(frame_pixels(i, n), format="rgb24")
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A picture, an 8-frame clip and a 12-frame clip."""
    folder = tmp_path_factory.mktemp("media")
    quarters(40, 48, COLOURS).save(folder / "quarters.png")
    return {"picture": folder / "quarters.png", "clip": write_video(folder / "clip.mp4", 8),
            "long": write_video(folder / "long.mp4", 12)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("qwen") / "model", "qwen2_vl")


def _load(folder):
    import transformers as tf
    return (tf.AutoModelForImageTextToText.from_pretrained(folder).eval(),
            tf.AutoProcessor.from_pretrained(folder))


class EveryThird:
    """Forces a full stop every third generated token, so that a tiny random model's
    answer has several spans."""

    def __init__(self, stop: int, prompt_length: int):
        self.stop, self.prompt_length = stop, prompt_length

    def __call__(self, input_ids, scores):
        if (input_ids.shape[1] - self.prompt_length) % 3 == 2:
            scores = torch.full_like(scores, -1e9)
            scores[:, self.stop] = 0
        return scores


# ---- decoding ---------------------------------------------------------------------------------

def test_every_frame_decoded_in_order_with_its_time(files):
    from headscope.hf.testing import tiny_processor
    from headscope.videos import check_video, read_video
    assert check_video(files["long"]) == {"frames": 12, "fps": FPS, "width": 64, "height": 48,
                                          "seconds": 3.0}
    video = read_video(files["long"], tiny_processor("qwen2_vl").video_processor)
    # the tiny Qwen2-VL video processor samples no frames (do_sample_frames off, as the
    # checkpoints'): every frame, each of its own grey level
    assert video.num_frames == 12 and video.frames.dtype == torch.uint8
    # MPEG-4 is lossy: a few levels off, far from the next frame's 20 levels away
    corner = video.frames[:, :, 40:, :8].float().mean(dim=(1, 2, 3))
    torch.testing.assert_close(corner, torch.tensor([20. + 20 * i for i in range(12)]),
                               atol=6, rtol=0)
    assert video.source_frames.tolist() == list(range(12))
    torch.testing.assert_close(video.seconds, torch.arange(12, dtype=torch.float64) / FPS)


def test_frames_sampled_as_the_processor_samples_a_file(files):
    """With frame sampling on, the frames read are those the video processor takes from
    the file itself: the same pixel values and the same source frames."""
    from headscope.hf.testing import tiny_processor
    from headscope.videos import Video, read_video
    video_processor = tiny_processor("qwen2_vl").video_processor
    video_processor.do_sample_frames, video_processor.fps = True, 2
    own = video_processor(videos=[str(files["long"])], return_metadata=True,
                          return_tensors="pt")
    video = read_video(files["long"], video_processor)
    ours = video_processor(**Video.processor_kwargs([video]), return_tensors="pt")
    assert video.source_frames.tolist() == [0, 2, 4, 6, 8, 10] \
        == [int(i) for i in own["video_metadata"][0].frames_indices]
    assert torch.equal(ours["pixel_values_videos"], own["pixel_values_videos"])
    assert torch.equal(ours["video_grid_thw"], own["video_grid_thw"])


def test_unreadable_videos_are_one_line(files, tmp_path):
    from headscope.hf.testing import tiny_processor
    from headscope.videos import VideoError, read_video
    (tmp_path / "text.mp4").write_text("not a video")
    cases = {tmp_path / "none.mp4": "none.mp4: no such file",
             tmp_path / "text.mp4": "text.mp4: not a readable video: ",
             files["picture"]: "quarters.png: not a readable video: "}
    for path, expected in cases.items():
        with pytest.raises(VideoError) as error:
            read_video(path)
        assert expected in str(error.value) and "\n" not in str(error.value)
    video_processor = tiny_processor("qwen2_vl").video_processor
    video_processor.do_sample_frames, video_processor.num_frames = True, 50
    with pytest.raises(VideoError, match="clip.mp4: the video processor samples no frames of "
                                         "it: .*num_frames=50"):
        read_video(files["clip"], video_processor)


# ---- the command and the Python API -----------------------------------------------------------

def test_command_with_a_picture_and_a_video_equals_a_tracer_run(qwen, files, tmp_path, capsys):
    """report.json against a plain Tracer run of the same inputs: spans and scores bit for
    bit, each video token's region, box and frames, the frames' times; each frame group's
    score is the sum of its 3x3 regions' scores (a grid's regions lie in one group)."""
    from PIL import Image

    from headscope.explainer import prompt_inputs
    from headscope.hf import Tracer, grid_regions
    from headscope.videos import read_video
    out = tmp_path / "out"
    assert main(["explain", "--model", str(qwen), "--image", str(files["picture"]),
                 "--video", str(files["clip"]), "--prompt", PROMPT, "--max-new-tokens", "6",
                 "--scores", "attention", "--out", str(out)]) == 0
    assert "regions: 3x3" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())

    model, processor = _load(qwen)
    video = read_video(files["clip"], processor.video_processor)
    inputs = prompt_inputs(processor, [Image.open(files["picture"]).convert("RGB")], PROMPT,
                           [video])
    with torch.no_grad(), Tracer(model, regions=grid_regions(3, 3),
                                 tokenizer=processor.tokenizer) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=6, do_sample=False))
        (tokens,) = tr.videos[0]
        picture, clip = tr.media_regions[0]
        labels = tr.region_ids[0, tokens.positions]
    assert report["num_regions"] == 9 + 4 * 9 == clip.end and clip.first == 9
    assert report["regions"] == "a 3x3 grid per picture and per frame group of each video"
    (v,) = report["videos"]
    assert (v["name"], v["num_frames"], v["fps"], v["width"], v["height"]) == \
        ("clip.mp4", 8, FPS, 64, 48)
    assert v["source_frames"] == list(range(8)) and v["seconds"] == [i / FPS for i in range(8)]
    assert [g["frames"] for g in v["groups"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert v["token_regions"] == labels.tolist() and v["regions"] == [9, 45]
    torch.testing.assert_close(torch.tensor(v["token_boxes"]), tokens.boxes.float())
    assert v["token_groups"] == tokens.token_frames[:, 0].div(2, rounding_mode="floor").tolist()
    assert len(report["spans"]) == len(spans) == len(v["spans"])
    for ours, theirs, per_video in zip(report["spans"], spans, v["spans"]):
        assert (ours["start"], ours["end"], ours["token_ids"]) == \
            (theirs.start, theirs.end, theirs.token_ids.tolist())
        assert torch.equal(torch.tensor(ours["features"]), theirs.features)
        assert torch.equal(torch.tensor(ours["scores"]), theirs.features.mean(-1))
        assert per_video["region_scores"] == ours["scores"][9:45]
        counts = torch.bincount(labels, minlength=45)[9:45].double()
        torch.testing.assert_close(torch.tensor(per_video["region_scores_per_token"],
                                                dtype=torch.float64) * counts,
                                   torch.tensor(per_video["region_scores"], dtype=torch.float64))
        by_group = torch.tensor(per_video["region_scores"], dtype=torch.float64).reshape(4, 9)
        torch.testing.assert_close(torch.tensor(per_video["group_scores"], dtype=torch.float64),
                                   by_group.sum(1))
    assert sorted(p.name for p in out.iterdir()) == \
        sorted(["index.html", "report.json"] + [f"span{s['index']}.png" for s in report["spans"]
                                                if not s["special"]])


def test_python_api_video_only_ward_regions_over_space_and_time(qwen, files):
    """A video-only prompt with Ward regions: K regions over the video's frame groups, a
    region may span several groups, and the region table names each region's frames."""
    import headscope
    from headscope.videos import read_video
    model, processor = _load(qwen)
    video = read_video(files["long"], processor.video_processor)
    result = headscope.explain(model, processor, [], PROMPT, videos=[video], regions=5,
                               max_new_tokens=4)
    (v,) = result.videos
    assert not result.pictures and result.num_regions == 5 and v.regions == (0, 5)
    assert result.regions_name == "5 Ward regions per picture and per video (over space and time)"
    assert sorted(v.labels.unique().tolist()) == list(range(5))
    assert [len(g) for g in v.groups] == [2] * 6 and v.num_frames == 12
    for k in range(5):
        frames = v.region_frames(k)
        assert result.where(k) == f"video 0, {v.span_of(frames)}"
    assert "<img class='vheat'" in result.html()


def test_grid_windows_of_frames(qwen, files):
    """frames=4: 3x3 blocks over windows of 4 sampled frames (two frame groups each)."""
    from PIL import Image

    import headscope
    model, processor = _load(qwen)
    result = headscope.explain(model, processor, [], PROMPT, videos=[str(files["long"])],
                               regions="3x3", frames=4, max_new_tokens=3)
    (v,) = result.videos
    assert result.num_regions == 3 * 9
    for g in range(6):
        assert set(v.group_tokens(g).labels.tolist()) == set(range(g // 2 * 9, g // 2 * 9 + 9))
    assert result.where(9) == "video 0, 1.00-1.75 s"
    with pytest.raises(ValueError, match="frames=3 must be a multiple of the 2 frames"):
        headscope.explain(model, processor, [], PROMPT, videos=[str(files["long"])],
                          regions="3x3", frames=3, max_new_tokens=3)
    with pytest.raises(ValueError, match="'frames' .* has no effect without videos"):
        headscope.explain(model, processor, [Image.open(files["picture"])], PROMPT,
                          regions="3x3", frames=4)
    with pytest.raises(ValueError, match="'frames' .* needs grid regions"):
        headscope.explain(model, processor, [], PROMPT, videos=[str(files["long"])],
                          regions=4, frames=4)


def test_frames_sampled_by_a_sampling_processor_end_to_end(files):
    """Qwen3-VL's video processor samples frames (2 per second): the explanation's frames,
    times and frame groups are those of the frames it takes from the file itself."""
    import headscope
    from headscope.hf.testing import tiny_model, tiny_processor
    processor = tiny_processor("qwen3_vl")
    own = processor.video_processor(videos=[str(files["long"])], return_metadata=True)
    sampled = [int(i) for i in own["video_metadata"][0].frames_indices]
    result = headscope.explain(tiny_model("qwen3_vl").eval(), processor, [], PROMPT,
                               videos=[str(files["long"])], max_new_tokens=3)
    (v,) = result.videos
    assert 1 < len(sampled) < 12 and v.source_frames.tolist() == sampled
    assert v.seconds.tolist() == [i / FPS for i in sampled]
    assert v.groups == [tuple(range(i, min(i + 2, len(sampled))))
                        for i in range(0, len(sampled), 2)]
    report = result.report()["videos"][0]
    assert report["source_frames"] == sampled and report["num_frames"] == len(sampled)
    assert report["source_num_frames"] == 12
    assert f"{len(sampled)} of its 12 frames sampled (64x48, 4 fps)" in result.html()


def _video_families():
    """The model types whose tiny family reads videos (``TinySpec.video``) and whose tiny
    processor has a video processor."""
    from types import SimpleNamespace

    from headscope.hf.families import family_of
    from headscope.hf.testing import FAMILIES, tiny_of, tiny_processor
    chosen = []
    for model_type in FAMILIES:
        try:
            processor = tiny_processor(model_type)
        except NotImplementedError:
            continue
        tiny = tiny_of(family_of(SimpleNamespace(model_type=model_type)))
        if tiny.spec.video is not None and getattr(processor, "video_processor", None):
            chosen.append(model_type)
    return chosen


@pytest.mark.parametrize("model_type", _video_families())
def test_each_family_with_a_video_layout(model_type, files):
    """Every family that reads videos: the explanation's frames are the ones read (sampled
    as its video processor samples them), its frame groups cover them once in order, and
    every video token has a region of the video (the tiny chat templates write no video,
    so the prompt is the family's video text: ``TinySpec.video``)."""
    import headscope
    from headscope.hf.families import family_of
    from headscope.hf.testing import tiny_model, tiny_of, tiny_processor
    from headscope.videos import Video, read_video
    model, processor = tiny_model(model_type).eval(), tiny_processor(model_type)
    video = read_video(files["long"], processor.video_processor)
    text = tiny_of(family_of(model)).spec.video + " " + PROMPT
    inputs = dict(processor(text=[text], return_tensors="pt", **Video.processor_kwargs([video])))
    result = headscope.explain(model, processor, [], PROMPT, videos=[video], inputs=inputs,
                               regions=(2, 2), max_new_tokens=2)
    (v,) = result.videos
    assert v.num_frames == video.num_frames and v.source_frames.tolist() == \
        video.source_frames.tolist()
    torch.testing.assert_close(v.seconds, video.seconds)
    assert [f for g in v.groups for f in g] == list(range(v.num_frames))
    assert v.regions == (0, result.num_regions) and int(v.labels.min()) >= 0
    assert len(v.group_tokens(len(v.groups) - 1).labels) > 0
    assert result.report()["videos"][0]["num_frames"] == video.num_frames


def test_a_video_written_as_pictures_is_refused_in_one_line(files):
    """InternVL's processor writes a video's frames as pictures of their own: explain
    says so instead of showing them as pictures nobody gave."""
    import headscope
    from headscope.hf.testing import tiny_model, tiny_processor
    from headscope.videos import Video, read_video
    processor = tiny_processor("internvl")
    video = read_video(files["clip"], processor.video_processor)
    inputs = dict(processor(text=[processor.video_token + " " + PROMPT], return_tensors="pt",
                            **Video.processor_kwargs([video])))
    with pytest.raises(ValueError, match=r"^headscope.explain: the prompt holds 8 pictures and "
                                         r"0 videos, got 0 images and 1 videos; this model's "
                                         r"processor writes a video's frames as pictures"):
        headscope.explain(tiny_model("internvl").eval(), processor, [], PROMPT, videos=[video],
                          inputs=inputs, regions=(2, 2), max_new_tokens=2)


def test_a_processor_without_a_video_processor_is_refused_before_reading():
    import headscope
    from headscope.hf.testing import tiny_model, tiny_processor
    with pytest.raises(ValueError, match=r"the processor \(Gemma3Processor\) has no video "
                                         r"processor, so the model takes no video"):
        headscope.explain(tiny_model("gemma3").eval(), tiny_processor("gemma3"), [], PROMPT,
                          videos=["no-such-file.mp4"])
    with pytest.raises(ValueError, match="hold no picture and no video"):
        headscope.explain(tiny_model("gemma3").eval(), tiny_processor("gemma3"), [], PROMPT)


def _files(folder: Path):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_bad_video_arguments_fail_before_any_work(qwen, files, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "text.mp4").write_text("not a video")
    gemma = tiny_checkpoint(work / "gemma3", "gemma3")
    before = _files(tmp_path)
    base = ["explain", "--model", str(qwen), "--video", str(files["clip"]), "--prompt", PROMPT,
            "--out", str(tmp_path / "never")]
    cases = {
        "--video " + str(work / "none.mp4") + ": no such file": ["--video", str(work / "none.mp4")],
        "--video " + str(work / "text.mp4") + ": not a readable video":
            ["--video", str(work / "text.mp4")],
        "has no video processor, so the model takes no video": ["--model", str(gemma)],
        "--regions 500: more regions than the 4 frame groups of 5x6 video tokens of":
            ["--regions", "500"],
        "--regions 7x9: more blocks than the 5x6 video tokens of each frame group of":
            ["--regions", "7x9"],
        "--frames 3: the model merges 2 frames into each video token": ["--frames", "3"],
        "--frames 4: windows of frames need ROWSxCOLS regions": ["--frames", "4", "--regions", "5"],
    }
    for expected, override in cases.items():
        err = usage_error(capsys, *with_options(base, override))
        assert expected in err, (expected, err)
        assert _files(tmp_path) == before, expected
    no_media = [a for a in base if a not in ("--video", str(files["clip"]))]
    assert "no --image and no --video" in usage_error(capsys, *no_media)
    assert "--frames 2: has no effect without --video" in usage_error(
        capsys, *no_media, "--image", str(files["picture"]), "--frames", "2")
    assert _files(tmp_path) == before


# ---- the pages in headless Chromium ------------------------------------------------------------

@pytest.fixture(scope="module")
def video_page(qwen, files, tmp_path_factory):
    """The page of a picture and two videos, the answer cut into several spans."""
    import headscope
    model, processor = _load(qwen)
    stop = processor.tokenizer.convert_tokens_to_ids(".")
    from headscope.explainer import prompt_inputs
    from headscope.videos import read_video
    from PIL import Image
    videos = [read_video(files[k], processor.video_processor) for k in ("long", "clip")]
    pictures = [Image.open(files["picture"]).convert("RGB")]
    length = prompt_inputs(processor, pictures, PROMPT, videos)["input_ids"].shape[1]
    from transformers import LogitsProcessorList
    result = headscope.explain(model, processor, pictures, PROMPT, videos=videos,
                               max_new_tokens=9,
                               logits_processor=LogitsProcessorList([EveryThird(stop, length)]))
    return result.save(tmp_path_factory.mktemp("page"))


def _wait(browser, condition, seconds=10):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, seconds, poll_frequency=0.1).until(lambda _: condition())


@pytest.fixture
def browser():
    from headscope.explainer.screenshot import browser_missing, headless_chromium
    if browser_missing():
        pytest.skip(browser_missing())
    with headless_chromium(1100, 1300) as session:
        yield session


def test_video_page_in_a_browser(video_page, browser, tmp_path):
    """Each video a strip of its sampled frames with their times; the first span's heat on
    every frame and its frame groups' bars; choosing another span repaints both."""
    from selenium.webdriver.common.by import By
    report = json.loads((video_page.parent / "report.json").read_text())
    shown = [s for s in report["spans"] if not s["special"]]
    browser.get(video_page.as_uri())
    spans = browser.find_elements(By.CSS_SELECTOR, ".span")
    assert len(spans) == len(shown) >= 2
    boxes = browser.find_elements(By.CSS_SELECTOR, ".video")
    assert len(boxes) == 2
    for box, v in zip(boxes, report["videos"]):
        times = [t.text for t in box.find_elements(By.CSS_SELECTOR, ".vtime")]
        assert times == [f"{s:.2f} s" for s in v["seconds"]]
        assert len(box.find_elements(By.CSS_SELECTOR, "img.base")) == v["num_frames"]
        assert len(box.find_elements(By.CSS_SELECTOR, ".vbar")) == len(v["groups"])

    def state(span):
        heats, bars = [], []
        for box, v in zip(boxes, report["videos"]):
            for img in box.find_elements(By.CSS_SELECTOR, "img.vheat"):
                assert browser.execute_script("return arguments[0].naturalWidth", img) > 0
                heats.append(img.get_attribute("src"))
            scores = v["spans"][report["spans"].index(span)]["group_scores"]
            fills = box.find_elements(By.CSS_SELECTOR, ".vbar .fill")
            heights = [f.size["height"] for f in fills]
            best = int(np.argmax(scores))
            # the tallest bar is the best group's, in red; bars ordered as the scores
            assert heights[best] == max(heights) > 0, (heights, scores)
            assert fills[best].value_of_css_property("background-color") == "rgba(217, 72, 15, 1)"
            labels = [b.find_element(By.CSS_SELECTOR, ".val").text for b in
                      box.find_elements(By.CSS_SELECTOR, ".vbar")]
            assert [float(x) for x in labels] == pytest.approx(scores, abs=1e-4, rel=1e-3)
            timeline = [b.size["height"] for b in
                        box.find_elements(By.CSS_SELECTOR, ".tbar .fill")]
            assert len(timeline) == len(scores) and timeline[best] == max(timeline) > 0
            bars.append(heights)
        return heats, bars
    first = state(shown[0])
    assert all(src.startswith("data:image/png;base64,") for src in first[0])
    assert shown[0]["text"].strip() in browser.find_element(By.CSS_SELECTOR, ".vchosen").text
    assert browser.get_screenshot_as_file(str(tmp_path / "first.png"))
    spans[1].click()
    second = state(shown[1])
    assert second[0] != first[0]
    assert shown[1]["text"].strip() in browser.find_element(By.CSS_SELECTOR, ".vchosen").text
    rows = browser.find_element(By.CSS_SELECTOR, "tbody.scores").text.splitlines()
    assert len(rows) == report["num_regions"]
    # a click on the timeline's last bar scrolls the strip to the last frame group
    strip = boxes[0].find_element(By.CSS_SELECTOR, ".vscroll")
    assert browser.execute_script("return arguments[0].scrollLeft", strip) == 0
    boxes[0].find_elements(By.CSS_SELECTOR, ".tbar")[-1].click()
    _wait(browser, lambda: browser.execute_script("return arguments[0].scrollLeft", strip) > 0)
    assert browser.get_screenshot_as_file(str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000


def test_live_page_with_a_video(qwen, files, browser, tmp_path):
    """The live page shows each span's PNG (the frames under its heat and the timeline)
    as spans come, then writes the files."""
    pytest.importorskip("gradio", reason="the live page needs gradio: pip install "
                                         "\"headscope[app]\"")
    from selenium.webdriver.common.by import By

    from headscope.explainer import iter_explain
    from headscope.explainer.live import app, launch
    model, processor = _load(qwen)

    def explanations():
        return iter_explain(model, processor, [], PROMPT, videos=[str(files["clip"])],
                            max_new_tokens=6)
    blocks = app(explanations, tmp_path / "live")
    url = launch(blocks, "127.0.0.1", None)
    try:
        browser.get(url)
        _wait(browser, lambda: "Done:" in browser.find_element(By.ID, "status").text, 60)
        report = json.loads((tmp_path / "live" / "report.json").read_text())
        shown = [s for s in report["spans"] if not s["special"]]
        images = browser.find_elements(By.CSS_SELECTOR, "#spans img")
        assert len(images) >= len(shown) >= 1 and len(report["videos"]) == 1
        # a span's PNG holds the video: wider than a picture-only one (11 inches at 100 dpi)
        width = "return arguments[0].complete && arguments[0].naturalWidth"
        _wait(browser, lambda: browser.execute_script(width, images[0]), 30)
        assert browser.execute_script(width, images[0]) >= 1000
        assert browser.get_screenshot_as_file(str(tmp_path / "live.png"))
    finally:
        blocks.close()
