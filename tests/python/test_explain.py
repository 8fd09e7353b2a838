"""``python -m headscope explain`` and ``headscope.explain``: end to end on every family's
tiny checkpoint (report.json against a Tracer run of its own), on the embedded shapes model
(the object's cell is the hottest), the post-hoc scorers computed as each span ends, the
heat painted per image token, bad arguments (one line, exit 2, nothing created), a hub id
from the local Hugging Face cache, and the page in headless Chromium (on the world's cells
and on Ward regions)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from headscope.commands import main  # noqa: E402
from headscope.hf.testing import FAMILIES, quarters, tiny_checkpoint  # noqa: E402
from conftest import usage_error, with_options  # noqa: E402

PROMPT = "describe the image ."
COLOURS = ((200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40))


def _has_tiny_processor(model_type: str) -> bool:
    from headscope.hf.testing import tiny_processor
    try:
        tiny_processor(model_type)
    except NotImplementedError:
        return False
    return True


# Llama 4's tracing is not supported (docs/hf.md); the model types whose family module has
# no tiny processor (tiny_checkpoint cannot save one) run through the Python API on
# image_prompt's inputs
NO_PROCESSOR = tuple(f for f in FAMILIES if not _has_tiny_processor(f))
CHECKPOINT_FAMILIES = [f for f in FAMILIES if f not in ("llama4",) + NO_PROCESSOR]


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    path = tmp_path_factory.mktemp("pictures") / "quarters.png"
    quarters(40, 48, COLOURS).save(path)
    return path


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("qwen") / "model", "qwen2_vl")


def _tracer_spans(folder, picture, regions, max_new_tokens):
    """The spans a plain Tracer run gives for the command's prompt."""
    import transformers as tf
    from PIL import Image

    from headscope.explainer import prompt_inputs
    from headscope.hf import Tracer, grid_regions
    processor = tf.AutoProcessor.from_pretrained(folder)
    model = tf.AutoModelForImageTextToText.from_pretrained(folder).eval()
    inputs = prompt_inputs(processor, [Image.open(picture).convert("RGB")], PROMPT)
    with torch.no_grad(), Tracer(model, regions=grid_regions(*regions),
                                 tokenizer=processor.tokenizer) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False))
        (image,) = tr.images[0]
        labels = tr.region_ids[0, image.positions].tolist()
    return spans, labels, image.boxes


@pytest.mark.parametrize("family", CHECKPOINT_FAMILIES)
def test_command_on_each_family_equals_a_tracer_run(family, picture, tmp_path, capsys):
    folder = tiny_checkpoint(tmp_path / "model", family)
    out = tmp_path / "out"
    code = main(["explain", "--model", str(folder), "--image", str(picture), "--prompt",
                 PROMPT, "--regions", "2x2", "--max-new-tokens", "6", "--out", str(out),
                 "--scores", "attention"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert printed.startswith("scores: raw attention")
    report = json.loads((out / "report.json").read_text())
    spans, labels, boxes = _tracer_spans(folder, picture, (2, 2), 6)
    assert [(s["start"], s["end"], s["token_ids"]) for s in report["spans"]] == \
        [(s.start, s.end, s.token_ids.tolist()) for s in spans]
    for ours, theirs in zip(report["spans"], spans):
        assert torch.equal(torch.tensor(ours["features"]), theirs.features)
        assert torch.equal(torch.tensor(ours["scores"]), theirs.features.mean(-1))
        assert ours["head_scores"] is None
        if not ours["special"]:
            assert f"[{ours['index']}]" in printed
            assert (out / ours["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (shown,) = report["pictures"]
    assert shown["token_regions"] == labels and shown["regions"] == [0, 4]
    assert torch.equal(torch.tensor(shown["token_boxes"]), boxes.float())
    # every view painted on the picture plane: each quarter's middle shows its block
    from types import SimpleNamespace

    from headscope.explainer.heat_map import region_map
    painted = region_map(SimpleNamespace(boxes=torch.tensor(shown["token_boxes"]),
                                         labels=torch.tensor(shown["token_regions"])), (48, 40))
    assert [int(painted[y, x]) for y in (10, 30) for x in (12, 36)] == [0, 1, 2, 3]
    assert report["num_regions"] == 4 and len(report["vas_features"]) == 36
    page = (out / "index.html").read_text()
    assert page.count("class='span'") == sum(not s["special"] for s in report["spans"])
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from a network
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["index.html", "report.json"] + [s["png"] for s in report["spans"] if s["png"]])


@pytest.mark.parametrize("family", NO_PROCESSOR)
def test_python_api_on_inputs_of_each_family_without_a_processor(family, picture):
    from PIL import Image

    import headscope
    from headscope.hf import Tracer, grid_regions
    from headscope.hf.testing import image_prompt, tiny_model, tiny_tokenizer
    model, tokenizer = tiny_model(family), tiny_tokenizer(family)
    inputs = image_prompt(model, grids=((2, 2),) if family == "smolvlm" else ((8, 8),))  # tiles
    result = headscope.explain(model, tokenizer, [Image.open(picture)], PROMPT, inputs=inputs,
                               regions=(2, 2), max_new_tokens=6, scores="attention")
    with torch.no_grad(), Tracer(model, regions=grid_regions(2, 2), tokenizer=tokenizer) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=6, do_sample=False))
        labels = tr.region_ids[0, tr.images[0][0].positions]
    assert [(s.start, s.end) for s in result.spans] == [(s.start, s.end) for s in spans]
    for ours, theirs in zip(result.spans, spans):
        assert torch.equal(ours.features, theirs.features)
        assert torch.equal(ours.scores, theirs.features.mean(-1))
    assert torch.equal(result.pictures[0].labels, labels.cpu())
    assert "<img class='heat'" in result.html()


def test_python_api_with_a_head_and_a_detector(qwen, picture, tmp_path):
    import transformers as tf
    from PIL import Image

    import headscope
    from headscope import AttributionHead, VASDetector
    processor = tf.AutoProcessor.from_pretrained(qwen)
    model = tf.AutoModelForImageTextToText.from_pretrained(qwen).eval()
    head = AttributionHead(2, 4)
    torch.manual_seed(0)
    with torch.no_grad():
        head.weight.normal_()
    detector = VASDetector()
    detector.weight = torch.randn(36, dtype=torch.float64)
    result = headscope.explain(model, processor, [Image.open(picture)], PROMPT, head,
                               regions=3, detector=detector, max_new_tokens=6)
    assert result.done and result.score_name == "head's predicted effect"
    assert result.regions_name == "3 Ward regions per picture" and result.num_regions == 3
    for span in result.spans:
        torch.testing.assert_close(span.scores, head(span.features))
        assert span.scores is span.head_scores
    vas = torch.tensor(list(result.vas_features.values()))
    assert result.hallucination == pytest.approx(float(detector.predict_proba(vas[None])[0]))
    assert result.answer == "".join(s.text for s in result.spans)
    inline = result._repr_html_()
    assert inline.startswith("<div class='hs' id='hs-") and "<html" not in inline
    page = result.save(tmp_path / "out")
    assert "Hallucination probability" in page.read_text()


def _traced(model, processor, picture, regions, max_new_tokens):
    """A plain Tracer run of the API's prompt: (inputs, sequences, spans, region ids)."""
    from PIL import Image

    from headscope.explainer import prompt_inputs
    from headscope.hf import Tracer
    inputs = prompt_inputs(processor, [Image.open(picture).convert("RGB")], PROMPT)
    with torch.no_grad(), Tracer(model, regions=regions, tokenizer=processor.tokenizer) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False))
    return inputs, tr.sequences, spans, tr.region_ids


@pytest.mark.parametrize("scores", ["attnlrp", "gradient"])
def test_posthoc_scores_are_computed_as_each_span_ends(qwen, picture, scores):
    """AttnLRP and the gradient norm over the sequence so far, at each span's end: the
    scores the functions give after generation over the whole answer, and the same answer
    as a run without them (the tracer stands aside and comes back)."""
    import transformers as tf
    from PIL import Image

    from headscope.explainer import iter_explain
    from headscope.hf import attnlrp_scores, gradient_norm_scores
    processor = tf.AutoProcessor.from_pretrained(qwen)
    model = tf.AutoModelForImageTextToText.from_pretrained(qwen).eval()
    inputs, sequences, spans, rid = _traced(model, processor, picture, 3, 10)
    seen = []
    for result in iter_explain(model, processor, [Image.open(picture)], PROMPT, scores=scores,
                               regions=3, max_new_tokens=10):
        if not result.done:  # each span is scored when it is yielded
            seen.append(result.spans[-1].scores.clone())
    assert result.scorer == scores and len(seen) == len(spans) >= 2
    assert [(s.start, s.end) for s in result.spans] == [(s.start, s.end) for s in spans]
    after = attnlrp_scores(model, inputs, sequences, spans, rid) if scores == "attnlrp" \
        else gradient_norm_scores(model, inputs, sequences, spans, rid)
    torch.testing.assert_close(torch.stack(seen), after, atol=1e-5, rtol=1e-4)
    for span, theirs in zip(result.spans, spans):
        assert torch.equal(span.attention, theirs.features.mean(-1))
    assert result.report()["scorer"] == scores


def test_scorer_choice_and_what_attnlrp_cannot_run_on():
    from headscope.explainer.scorers import DEFAULT_SCORER, choose_scorer, posthoc_unsupported
    from headscope.hf.testing import tiny_model
    head = object()
    assert choose_scorer(None, None) == DEFAULT_SCORER == "gradient"
    assert choose_scorer(None, head) == "head" and choose_scorer("attnlrp", None) == "attnlrp"
    for scores, given, message in (("head", None, "needs a head"),
                                   ("attention", head, "does not use it"),
                                   ("words", None, "must be one of")):
        with pytest.raises(ValueError, match=message):
            choose_scorer(scores, given)
    moe = tiny_model("qwen3_vl_moe")  # mixture-of-experts layers: no AttnLRP rule
    assert "no AttnLRP rule for the parameters of" in posthoc_unsupported("attnlrp", moe)
    assert posthoc_unsupported("gradient", moe) is None
    assert posthoc_unsupported("attnlrp", tiny_model("qwen2_vl")) is None


def test_a_scorer_that_cannot_run_is_refused_before_generating(picture, tmp_path, capsys):
    """AttnLRP on mixture-of-experts layers: the Python API raises before generating (no
    processor is needed to refuse), the command refuses in one line and names the scorers
    that run on the model."""
    from PIL import Image

    from headscope import explain
    from headscope.hf.testing import tiny_model
    with pytest.raises(ValueError, match="scores='attnlrp' cannot run on this model: .*no "
                                         "AttnLRP rule for the parameters of"):
        explain(tiny_model("qwen3_vl_moe"), None, [Image.open(picture)], PROMPT,
                          scores="attnlrp")
    folder = tiny_checkpoint(tmp_path / "moe", "qwen3_vl_moe")
    capsys.readouterr()
    # known once the model is loaded (its loading bar comes first), before generating
    assert main(["explain", "--model", str(folder), "--image", str(picture), "--prompt",
                 PROMPT, "--scores", "attnlrp", "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert not out and last.startswith("headscope explain: error: --scores attnlrp: ")
    assert "no AttnLRP rule" in last
    assert last.endswith("allowed: --scores attention, attention*value_norm, gradient")
    assert not (tmp_path / "out").exists()


def test_the_page_paints_each_region_per_image_token(qwen, picture):
    """Ward regions of unequal size: the heat, the table order, the PNG and the page's
    overlay follow each region's score per image token, not its total."""
    import base64
    import io

    import matplotlib
    import numpy as np
    import transformers as tf
    from PIL import Image

    import headscope
    from headscope.explainer.heat_map import COLORMAP, HEAT_ALPHA, region_map
    from headscope.explainer.page import _page_data
    processor = tf.AutoProcessor.from_pretrained(qwen)
    model = tf.AutoModelForImageTextToText.from_pretrained(qwen).eval()
    result = headscope.explain(model, processor, [Image.open(picture)], PROMPT, regions=3,
                               scores="attention", max_new_tokens=6)
    tokens = result.region_tokens
    (shown,) = result.pictures
    assert tokens.tolist() == torch.bincount(shown.labels, minlength=3).tolist()
    assert len(set(tokens.tolist())) > 1  # unequal sizes
    span = next(s for s in result.spans if not s.special)
    # the largest region gets the largest total but the lowest score per token
    big = int(tokens.argmax())
    per_token = torch.where(torch.arange(3) == big, 0.5,
                            0.6 + 0.1 * torch.arange(3, dtype=torch.float64))
    assert (per_token * tokens).argmax() == big
    span.scores = (per_token * tokens).float()
    heat = span.per_token
    torch.testing.assert_close(heat, span.scores.double() / tokens.double())
    assert int(span.scores.argmax()) == big and int(heat.argmin()) == big
    order = [k for k, _ in span.top_regions(3)]
    assert order == torch.argsort(heat, descending=True).tolist()
    report = result.report()
    assert report["heat"] == "per image token" and report["region_tokens"] == tokens.tolist()
    assert report["spans"][span.index]["scores_per_token"] == pytest.approx(heat.tolist())
    data = _page_data(result)
    row = data["spans"][[s.index for s in result.spans if not s.special].index(span.index)]
    assert [r[0] for r in row["table"]] == order
    assert [r[2] for r in row["table"]] == [int(tokens[k]) for k in order]
    assert row["low"] == pytest.approx(float(heat.min()))
    assert row["high"] == pytest.approx(float(heat.max()))
    overlay = np.asarray(Image.open(io.BytesIO(base64.b64decode(
        row["overlays"][0].split(",", 1)[1]))))
    labels = region_map(shown, overlay.shape[1::-1])
    cmap = matplotlib.colormaps[COLORMAP]
    for k in range(3):
        t = (float(heat[k]) - row["low"]) / (row["high"] - row["low"])
        expected = np.round(np.array([*cmap(t)[:3], HEAT_ALPHA]) * 255)
        got = overlay[labels == k]
        assert np.abs(got.astype(float) - expected).max() <= 1, k
    png = Image.open(io.BytesIO(headscope.explainer.page.span_png(result, span)))
    assert png.size[0] > 100


def test_shapes_model_points_at_the_object(tmp_path):
    """On one-object scenes of the held-out seeds, the span naming the object has its
    hottest 3x3 cell on the object (the demo's scenes, the first four)."""
    import headscope
    from headscope.shapes import load, match_object, parse_sentence, prompt, scene
    from headscope.shapes.accuracy import HELD_OUT_SEED
    from headscope.shapes.demo import DEMO_OFFSET
    from headscope.shapes.world import IMAGE_SIZE
    model, processor, head = load()
    hits = []
    for i in range(4):
        image, objects = scene(HELD_OUT_SEED + DEMO_OFFSET + 100 + i, 1)
        result = headscope.explain(model, processor, [image], "Describe the image.", head,
                                   regions=(3, 3), inputs=prompt(processor, image),
                                   max_new_tokens=24)
        (obj,) = objects
        named = [s for s in result.spans
                 if match_object(parse_sentence(s.text.strip()), objects) is obj]
        assert named, [s.text for s in result.spans]
        x0, y0, x1, y1 = obj.box
        cell = int(3 * ((y0 + y1) / 2) // IMAGE_SIZE) * 3 + int(3 * ((x0 + x1) / 2) // IMAGE_SIZE)
        hits.append(named[0].top_regions(1)[0][0] == cell)
    assert all(hits), hits
    result.save(tmp_path / "shapes")


def _files(folder: Path):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_bad_arguments_fail_before_any_work(qwen, picture, tmp_path, capsys):
    from headscope import AttributionHead
    work = tmp_path / "work"
    work.mkdir()
    (work / "text.png").write_text("not a picture")
    (work / "afile").write_text("x")
    AttributionHead(3, 4).save(work / "wrong.safetensors")
    other = tiny_checkpoint(work / "bert", "qwen2_vl")
    config = json.loads((other / "config.json").read_text())
    # a text model: no image placeholder in its config (the generic path needs one)
    config = {k: v for k, v in config.items() if k not in ("image_token_id", "video_token_id")}
    (other / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    before = _files(tmp_path)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    base = ["explain", "--model", str(qwen), "--image", str(picture), "--prompt", PROMPT,
            "--out", str(tmp_path / "never")]
    cases = {
        "no such file": ["--image", str(work / "none.png")],
        "not a readable picture": ["--image", str(work / "text.png")],
        "model_type 'bert'": ["--model", str(other)],
        "num_layers=3, expected 2": ["--head", str(work / "wrong.safetensors")],
        "--regions: must be": ["--regions", "0"],
        "--scores head: needs --head FILE": ["--scores", "head"],
        "has no effect with --scores attention": ["--head", str(work / "wrong.safetensors"),
                                                  "--scores", "attention"],
        "--prompt: is empty": ["--prompt", "  "],
        "exists and is not a folder": ["--out", str(work / "afile")],
        f"cannot listen on 127.0.0.1:{busy.getsockname()[1]}":
            ["--serve", str(busy.getsockname()[1])],
        "--temperature 0.5: has no effect without --do-sample": ["--temperature", "0.5"],
        "more blocks than the": ["--regions", "50x50"],
        "nor a model in the local Hugging Face cache": ["--model", "nobody/no-such-model"],
    }
    for expected, override in cases.items():
        err = usage_error(capsys, *with_options(base, override))
        assert expected in err, (expected, err)
        assert _files(tmp_path) == before, expected
    busy.close()


def test_hub_id_from_the_local_cache(qwen, picture, tmp_path):
    """--model ORG/NAME finds the snapshot in HF_HOME's hub cache, with the hub offline."""
    snapshot = tmp_path / "hf" / "hub" / "models--tiny--qwen" / "snapshots" / ("0" * 40)
    shutil.copytree(qwen, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    result = subprocess.run([sys.executable, "-m", "headscope", "explain", "--model",
                             "tiny/qwen", "--image", str(picture), "--prompt", PROMPT,
                             "--max-new-tokens", "4", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "report.json").read_text())["model"] == "tiny/qwen"


@pytest.fixture(scope="module")
def shapes_page(tmp_path_factory):
    """The shapes model's page of a two-object held-out scene (several spans)."""
    from headscope.shapes.demo import explain_page
    return explain_page(tmp_path_factory.mktemp("shapes"))


@pytest.fixture
def browser():
    from headscope.explainer.screenshot import browser_missing, headless_chromium
    if browser_missing():
        pytest.skip(browser_missing())
    with headless_chromium() as session:
        yield session


def _wait(browser, condition, seconds=30):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, seconds, poll_frequency=0.1).until(lambda _: condition())


def test_page_in_a_browser(shapes_page, browser, tmp_path):
    """Opened from disk: the spans are listed, the first span's heat map and table show,
    choosing another span changes them; a screenshot is written."""
    from selenium.webdriver.common.by import By
    report = json.loads((shapes_page.parent / "report.json").read_text())
    browser.get(shapes_page.as_uri())
    spans = browser.find_elements(By.CSS_SELECTOR, ".span")
    shown = [s for s in report["spans"] if not s["special"]]
    assert len(spans) == len(shown) >= 2
    heat = browser.find_element(By.CSS_SELECTOR, "img.heat")

    def state():
        return (heat.get_attribute("src"),
                browser.find_element(By.CSS_SELECTOR, "tbody.scores").text,
                browser.find_element(By.CSS_SELECTOR, ".chosen-text").text)
    first = state()
    assert first[0].startswith("data:image/png;base64,")
    assert browser.execute_script("return arguments[0].naturalWidth", heat) > 0
    assert len(first[1].splitlines()) == report["num_regions"]
    assert shown[0]["text"].strip() in first[2]
    spans[1].click()
    second = state()
    assert "chosen" in spans[1].get_attribute("class")
    assert second[0] != first[0] and shown[1]["text"].strip() in second[2]
    assert browser.execute_script("return arguments[0].naturalWidth", heat) > 0
    assert browser.get_screenshot_as_file(str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000


def test_ward_page_in_a_browser(browser, tmp_path):
    """The page on 8 Ward regions of unequal size, without a head: the colour bar names the
    unit (per image token), the table shows each region's tokens, total and score per token,
    hottest first, and the heat map shows; a screenshot is written."""
    from selenium.webdriver.common.by import By

    from headscope.shapes.demo import explain_page
    page = explain_page(tmp_path / "ward", regions=8, scores="attention")
    report = json.loads((page.parent / "report.json").read_text())
    assert len(set(report["region_tokens"])) > 1 and report["heat"] == "per image token"
    browser.get(page.as_uri())
    unit = browser.find_element(By.CSS_SELECTOR, ".note.unit").text
    assert unit.startswith("raw attention per image token")
    header = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "thead th")]
    assert header == ["region", "where", "tokens", "total", "per image token"]
    cells = [[c.text for c in tr.find_elements(By.TAG_NAME, "td")]
             for tr in browser.find_elements(By.CSS_SELECTOR, "tbody.scores tr")]
    assert len(cells) == 8 and all(c[1] == "picture 0" for c in cells)
    rows = [[float(c) if j != 1 else None for j, c in enumerate(row)] for row in cells]
    shown = next(s for s in report["spans"] if not s["special"])
    assert [int(r[0]) for r in rows] == shown["top_regions"]
    assert [int(r[2]) for r in rows] == [report["region_tokens"][int(r[0])] for r in rows]
    per_token = [r[4] for r in rows]
    assert per_token == sorted(per_token, reverse=True)  # hottest first, per image token
    heat = browser.find_element(By.CSS_SELECTOR, "img.heat")
    assert browser.execute_script("return arguments[0].naturalWidth", heat) > 0
    assert browser.get_screenshot_as_file(str(tmp_path / "ward.png"))
    assert (tmp_path / "ward.png").stat().st_size > 10_000


def test_live_page_shows_spans_while_generating(qwen, picture, browser, tmp_path):
    """The live page (Gradio, on 127.0.0.1) shows the first span's text and heat map
    while generation is held after that span, then the rest and the written files."""
    pytest.importorskip("gradio", reason="the live page needs gradio: pip install "
                                         "\"headscope[app]\"")
    import threading

    from selenium.webdriver.common.by import By

    import transformers as tf
    from PIL import Image

    from headscope.explainer import iter_explain
    from headscope.explainer.live import app, launch
    processor = tf.AutoProcessor.from_pretrained(qwen)
    model = tf.AutoModelForImageTextToText.from_pretrained(qwen).eval()
    release, spans_seen = threading.Event(), []

    def explanations():  # generation held after the first span until the browser shows it
        for result in iter_explain(model, processor, [Image.open(picture)], PROMPT,
                                   max_new_tokens=12):
            spans_seen.append(len(result.spans))
            yield result
            if len(spans_seen) == 1:
                assert release.wait(60), "the browser never saw the first span"
    blocks = app(explanations, tmp_path / "live")
    url = launch(blocks, "127.0.0.1", None)
    try:
        browser.get(url)
        _wait(browser, lambda: "span 0" in browser.find_element(By.ID, "answer").text.lower()
              and browser.find_elements(By.CSS_SELECTOR, "#spans img"), 60)
        assert spans_seen == [1] and not (tmp_path / "live").exists()  # still generating
        assert "Generating" in browser.find_element(By.ID, "status").text
        release.set()
        _wait(browser, lambda: "Done:" in browser.find_element(By.ID, "status").text, 60)
        report = json.loads((tmp_path / "live" / "report.json").read_text())
        shown = [s for s in report["spans"] if not s["special"]]
        assert len(browser.find_elements(By.CSS_SELECTOR, "#spans img")) >= len(shown)
        assert browser.get_screenshot_as_file(str(tmp_path / "live.png"))
    finally:
        release.set()
        blocks.close()


def test_ctrl_c_exits_130_and_writes_nothing(qwen, picture, tmp_path, capsys, monkeypatch,
                                            ctrl_c):
    """SIGINT after the first span: one line, exit 130, no output folder."""
    import signal

    import headscope.explainer as explainer
    generate = explainer.iter_explain

    def interrupted(*args, **kwargs):
        for result in generate(*args, **kwargs):
            yield result
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(explainer, "iter_explain", interrupted)
    code = main(["explain", "--model", str(qwen), "--image", str(picture), "--prompt", PROMPT,
                 "--max-new-tokens", "8", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 130 and err.strip().splitlines()[-1] == "headscope explain: interrupted", err
    assert "[0]" in out and not (tmp_path / "out").exists()


def test_a_model_traced_by_its_structure_gets_ward_regions_and_refuses_a_grid():
    from types import SimpleNamespace

    from headscope.commands.errors import UsageError
    from headscope.commands.explain import choose_regions
    from headscope.hf.families import GENERIC, family_of

    config = SimpleNamespace(model_type="cosmos3")
    args = SimpleNamespace(regions=None)
    choose_regions(args, config, GENERIC)
    assert args.regions == "9"
    with pytest.raises(UsageError, match="no picture layout is known for model type 'cosmos3'"):
        choose_regions(SimpleNamespace(regions="3x3"), config, GENERIC)
    laid_out = SimpleNamespace(regions=None)
    choose_regions(laid_out, config, family_of(SimpleNamespace(model_type="qwen2_vl")))
    assert laid_out.regions == "3x3"
