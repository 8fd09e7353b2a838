"""Attribution in space and time on clips: which regions point at an object and when
(hand-made geometry), the hottest frame group, the summary of pointing in time, the seed
ranges, the video head's fit and the evaluation and demo on the shipped video model."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")
import headscope.shapes as shapes  # noqa: E402
from headscope.hf import grid_regions  # noqa: E402
from headscope.shapes.accuracy import CLIP_SEED_RANGES  # noqa: E402
from headscope.shapes.clip_eval import (  # noqa: E402
    CELLS, clip_seeds, hottest_group, object_on_tokens, region_hits, summarise_time)
from headscope.shapes.clips import FRAMES, ClipObject  # noqa: E402
from headscope.shapes.model import VIDEO_DIR  # noqa: E402

SIDE = shapes.IMAGE_SIZE
GROUPS, ROWS = 4, 6  # a clip's frame groups of 6 x 6 tokens


def clip_tokens():
    """``(centres, token_frames, groups, labels)`` of a clip's 144 tokens laid out as the
    video model's are: group by group, row-major, labelled by the world's cells per group
    (``grid_regions(3, 3)``)."""
    cell = SIDE / ROWS
    rows, cols = torch.meshgrid(torch.arange(ROWS), torch.arange(ROWS), indexing="ij")
    one = torch.stack([(cols.flatten() + 0.5) * cell, (rows.flatten() + 0.5) * cell], 1)
    centres = one.double().repeat(GROUPS, 1)
    groups = torch.arange(GROUPS).repeat_interleave(ROWS * ROWS)
    token_frames = torch.stack([2 * groups, 2 * groups + 1], 1)
    boxes = torch.cat([centres - cell / 2, centres + cell / 2], 1) / SIDE
    labels = groups * 9 + grid_regions(3, 3).of_boxes(boxes)
    return centres, token_frames, groups, labels


def an_object(event, quarter, boxes):
    return ClipObject("circle", "red", event, "top left", "top left", quarter, tuple(boxes))


TOP_LEFT = (4, 4, 28, 28)
CENTRE = (36, 36, 60, 60)


def test_regions_point_at_an_object_where_and_when_it_is_on():
    centres, token_frames, _, labels = clip_tokens()
    # appears in the third quarter: absent on frame 4, on from frame 5
    appears = an_object("appears", 2, [None] * 5 + [TOP_LEFT] * 3)
    hits = region_hits(labels, centres, token_frames, 36, appears)
    assert hits.nonzero().flatten().tolist() == [18, 27]  # the top-left cell, quarters 3, 4
    on = object_on_tokens(centres, token_frames, appears)
    assert on.sum() == 2 * 4 and set(labels[on].tolist()) == {18, 27}
    # moves from the top left to the centre in the second quarter: halfway on frame 2 (on
    # neither cell's centre), in the centre from frame 3
    moves = an_object("moves", 1, [TOP_LEFT] * 2 + [(20, 20, 44, 44)] + [CENTRE] * 5)
    hits = region_hits(labels, centres, token_frames, 36, moves)
    assert hits.nonzero().flatten().tolist() == [0, 13, 22, 31]
    stays = an_object("stays", None, [CENTRE] * FRAMES)
    assert region_hits(labels, centres, token_frames, 36, stays).nonzero().flatten().tolist() \
        == [4, 13, 22, 31]


def test_a_region_over_space_and_time_points_by_its_centre_on_the_frames_it_covers():
    centres, token_frames, _, _ = clip_tokens()
    # two regions: the top-left cell in the first two quarters, everything else
    labels = torch.ones(GROUPS * ROWS * ROWS, dtype=torch.int64)
    first_half_corner = (torch.arange(len(labels)) < 72) & (centres[:, 0] < 32) & \
        (centres[:, 1] < 32)
    labels[first_half_corner] = 0
    late = an_object("appears", 2, [None] * 5 + [TOP_LEFT] * 3)
    assert region_hits(labels, centres, token_frames, 2, late).tolist() == [False, False]
    early = an_object("disappears", 1, [TOP_LEFT] * 3 + [None] * 5)
    assert region_hits(labels, centres, token_frames, 2, early).tolist() == [True, False]


def test_the_hottest_frame_group_is_by_heat_per_token():
    _, _, groups, labels = clip_tokens()
    heat = torch.zeros(36, dtype=torch.float64)
    heat[20] = 1.0  # one cell of the third quarter
    assert hottest_group(heat, labels, groups, GROUPS) == 2
    heat[:9] = 0.5  # the whole first quarter, half as hot per token: hotter on average
    assert hottest_group(heat, labels, groups, GROUPS) == 0
    heat[:9] = float("nan")  # a region without tokens paints nothing
    assert hottest_group(heat, labels, groups, GROUPS) == 2


def test_pointing_in_time_summary_counts_event_sentences_and_chance():
    records = [{"time_pointing": [{"head": True, "attention": False, "effects": True},
                                  {"head": True, "attention": True, "effects": False}],
                "groups": 4},
               {"time_pointing": [], "groups": 4},
               {"spans": 0}]
    out = summarise_time(records, ["head", "attention"])
    assert out["spans"] == 2
    assert out["share"] == {"head": 1.0, "attention": 0.5, "effects": 0.5, "random": 0.25}
    assert summarise_time([{"spans": 0}], ["head"])["share"]["head"] is None


def test_clip_seed_ranges():
    assert clip_seeds("reported", 4) == [(CLIP_SEED_RANGES["reported"] + k, 1 + k % 3)
                                         for k in range(4)]
    assert clip_seeds("train", 3) == [(0, 1), (1, 2), (2, 3)]  # the training stream's
    with pytest.raises(ValueError, match="seed range"):
        clip_seeds("accurate", 1)
    with pytest.raises(ValueError, match="count"):
        clip_seeds("dev", 0)


def test_a_written_clip_reads_back_as_drawn():
    pytest.importorskip("av")
    from headscope.shapes.video_demo import write_clip
    from headscope.videos import decoder_missing, read_video
    if decoder_missing():
        pytest.skip(decoder_missing())
    frames, _ = shapes.clip(7, 3)
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as folder:
        path = write_clip(Path(folder) / "clip.mp4", frames)
        video = read_video(path)
    drawn = torch.as_tensor(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2)
    assert torch.equal(video.frames, drawn)
    assert float(video.metadata.fps) == shapes.clips.FPS


# ---- the shipped video model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def video_model():
    if not (VIDEO_DIR / "config.json").is_file():
        pytest.fail(f"the video shapes model is missing from the package ({VIDEO_DIR})")
    return VIDEO_DIR


def test_clip_eval_on_ward_regions_resumes_from_its_cache(video_model, tmp_path):
    from headscope.shapes.clip_eval import clip_table, evaluate_clips
    cache = tmp_path / "cache"
    first = evaluate_clips("dev", 2, layout=4, cache=cache, progress=False)
    assert len(list(cache.glob("scene-*.safetensors"))) == 2
    again = evaluate_clips("dev", 2, layout=4, cache=cache, progress=False)
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert first["scenes"] == 2 and first["regions"] == "4 Ward regions"
    assert set(first["lds"]) == {"head", "attention", "attention*value_norm", "attnlrp",
                                 "gradient"}
    assert first["time"]["share"]["random"] in (None, 0.25)
    assert "pointing in time" in clip_table(first)
    with pytest.raises(ValueError, match="other settings"):
        evaluate_clips("dev", 2, layout=5, cache=cache, progress=False)


def test_clip_record_points_in_space_and_time_on_the_cells(video_model):
    from headscope.shapes.clip_eval import clip_record, traced_regions
    model, processor, head = shapes.load(video_model)
    seed, objects = clip_seeds("dev", 3)[2]
    record = clip_record(model, processor, {"head": head}, traced_regions(CELLS), seed,
                         objects, features=head.feature_set)
    S, K = record["effects"].shape
    assert K == 36 and record["groups"] == 4 and record["tokens"].tolist() == [4] * 36
    assert record["scores"]["head"].shape == (S, K)
    for hits, chance in record["pointing"]:
        assert set(hits) == set(record["scores"]) and 0 < chance < 1
    for case in record["time_pointing"]:
        assert set(case) == {*record["scores"], "effects"}


def test_clip_head_and_clip_eval_commands(video_model, tmp_path):
    head = tmp_path / "head.safetensors"
    run = subprocess.run([sys.executable, "-m", "headscope.shapes", "--threads", "1",
                          "clip-head", "--out", str(head), "--clips", "2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    from headscope.head import AttributionHead
    fitted = AttributionHead.load(str(head))
    assert fitted.feature_set == "both" and float(fitted.bias) == 0.0  # through the origin
    out = tmp_path / "eval.json"
    run = subprocess.run([sys.executable, "-m", "headscope.shapes", "--threads", "1",
                          "clip-eval", "--clips", "1", "--regions", "6", "--head", str(head),
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "1 clips (dev seeds" in run.stdout and "pointing in time" in run.stdout
    assert json.loads(out.read_text())["regions"] == "6 Ward regions"
    bad = subprocess.run([sys.executable, "-m", "headscope.shapes", "clip-eval",
                          "--regions", "145"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "145" in bad.stderr


@pytest.mark.parametrize("argv, words", [
    (["--video", "--images", "2"], ["--images 2", "with --video", "--clips"]),
    (["--clips", "2"], ["--clips 2", "without --video"]),
])
def test_video_demo_refuses_the_other_demos_count(tmp_path, capsys, argv, words):
    from headscope.shapes.__main__ import main
    assert main(["demo", "--out", str(tmp_path / "demo"), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "demo" / "report.json").exists()


def test_video_demo_explains_written_clips(video_model, tmp_path):
    from headscope.shapes.video_demo import run_video_demo
    said = []
    report = run_video_demo(tmp_path, 2, echo=said.append)
    assert [c["video"] for c in report["clips"]] == ["clip0.mp4", "clip1.mp4"]
    for c in report["clips"]:
        assert (tmp_path / c["page"]).is_file()
        page = json.loads((tmp_path / c["page"]).with_name("report.json").read_text())
        assert len(page["videos"]) == 1
        for s in c["spans"]:
            assert len(s["scores_per_token"]) == c["num_regions"] == 36
            assert s["hottest_frames"] in ([0, 1], [2, 3], [4, 5], [6, 7])
            assert (s["space_hit"] is None) == (s["object"] is None)
    s = report["summary"]
    assert s["clips"] == 2 and s["space_hits"] <= s["spans_on_objects"]
    assert any("descriptions correct" in line for line in said)
    assert (tmp_path / "index.html").read_text().count("<h2>seed") == 2


def test_screenshot_of_the_video_page(video_model, tmp_path):
    from headscope.explainer.screenshot import browser_missing
    from headscope.shapes.video_demo import video_page
    page = video_page(tmp_path / "page")
    report = json.loads(page.with_name("report.json").read_text())
    assert len(report["videos"]) == 1 and report["num_regions"] == 36
    if browser_missing():
        pytest.skip(browser_missing())
    png = tmp_path / "video.png"
    run = subprocess.run([sys.executable, "-m", "headscope.shapes", "--threads", "1",
                          "screenshot", "--video", "--png", str(png)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    from PIL import Image
    with Image.open(png) as image:
        assert image.size[0] >= 800 and image.size[1] >= 600
        # the heat's colours are on the page: some pixels far from grey
        pixels = np.asarray(image.convert("RGB")).astype(int).reshape(-1, 3)
        assert ((pixels.max(1) - pixels.min(1)) > 120).sum() > 1000
    bad = subprocess.run([sys.executable, "-m", "headscope.shapes", "screenshot", "--video",
                          "--regions", "145", "--png", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "from 1 to 144" in bad.stderr
