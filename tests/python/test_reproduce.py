"""python -m headscope.shapes reproduce --quick: every step runs and lands in results.json
and results.md; a rerun skips the finished steps; a run that stopped after some steps
resumes with the rest."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
from headscope.shapes.reproduce import RESULTS, STEPS, reproduce  # noqa: E402


def test_quick_reproduce_runs_every_step_and_resumes(tmp_path):
    said = []
    reproduce(tmp_path, quick=True, echo=said.append)
    results = json.loads((tmp_path / RESULTS).read_text())
    assert results["quick"] is True and list(results["steps"]) == list(STEPS)
    steps = results["steps"]
    assert 0 <= steps["accuracy"]["result"]["recall"] <= 1
    versus = steps["head_vs_attention"]["result"]
    assert versus["seed_range"] == "heat-reported" and versus["scenes"] == 2
    assert versus["seeds"] == [1_007_000_000, 1_007_000_001]
    assert versus["regions"] == "3x3 grid" and versus["special_spans_left_out"] >= 1
    # the head reads its own block; both raw baselines and AttnLRP are scored beside it
    assert versus["features"] == "both"
    assert versus["baselines"] == ["attention", "attention*value_norm", "attnlrp", "gradient"]
    assert list(versus["lds_difference"]) == ["head - attention", "head - attention*value_norm",
                                              "head - attnlrp", "head - gradient"]
    assert versus["ms_per_span"]["attnlrp"] > 0
    # the heat map's yardsticks beside LDS, on the cells and on 8 Ward regions
    for result in (versus, steps["head_vs_attention_ward"]["result"]):
        heat = result["heat"]
        assert set(heat["deletion"]) == {"head", *result["baselines"], "effects", "random"}
        assert heat["r_squared"]["head"] is not None
    assert steps["head_vs_attention_ward"]["result"]["regions"] == 8
    check = steps["heat_check"]["result"]
    assert check["seeds"] == [1_008_000_000, 1_008_000_001] and check["regions"] == 8
    assert check["no head"]["sentences"] >= 1 and check["head"]["sentences"] >= 1
    assert set(steps["scorer_cost"]["result"]["seconds"]) == {
        "attention", "attention*value_norm", "attnlrp", "gradient", "head"}
    every = versus["all_spans"]  # the same comparisons with the end-of-text spans put back
    assert every["spans"] == versus["spans"] + versus["special_spans_left_out"]
    assert list(every["lds_difference"]) == list(versus["lds_difference"])
    head_eval = steps["head_eval"]["result"]
    assert head_eval["seeds"] == [1_000_500_000, 1_000_500_001]
    assert 0 <= head_eval["random"]["pointing"] <= 1
    assert head_eval["random"]["pointing_spans"] == head_eval["head"]["pointing_spans"]
    assert head_eval["baselines"] == ["attention", "attention*value_norm", "attnlrp"]
    assert -1 <= head_eval["attention*value_norm"]["lds"] <= 1
    assert -1 <= head_eval["attnlrp"]["lds"] <= 1 and head_eval["ms_per_span"]["attnlrp"] > 0
    assert set(head_eval["curves"]["insertion"]) == {"head", *head_eval["baselines"],
                                                     "effects", "random"}
    on_cells = steps["head_eval_grid"]["result"]
    assert on_cells["seeds"] == head_eval["seeds"] and on_cells["spans"] == head_eval["spans"]
    if on_cells["random"]["pointing_spans"]:  # one cell in nine holds a given object
        assert abs(on_cells["random"]["pointing"] - 1 / 9) < 1e-9
    assert steps["latency"]["result"]["ms_per_token"]["plain"] > 0
    faith = steps["faithfulness"]["result"]
    assert faith["latency"] == steps["latency"]["result"]  # one latency measurement
    assert (tmp_path / "faithfulness" / "faithfulness.png").is_file()
    assert steps["hallucination"]["result"]["test_answers"] == 2
    assert steps["hallucination_hard"]["result"]["objects"] == [5, 9]
    mixer = steps["mixer"]["result"]
    assert mixer["accuracy"]["1-4"]["mixer"]["count"] == 2
    assert [row["max_iter"] for row in mixer["sweep"]["settings"]][-1] == 50
    video = steps["video_accuracy"]["result"]
    assert video["count"] == 2 and video["seeds"] == [1_010_000_000, 1_010_000_001]
    for name, regions in (("video_head_cells", "the world's cells per quarter"),
                          ("video_head_ward", "16 Ward regions")):
        result = steps[name]["result"]
        assert result["seeds"] == [1_012_000_000] * 2 and result["regions"] == regions
        assert set(result["heat"]["deletion"]) == {"head", *result["baselines"], "effects",
                                                   "random"}
        assert set(result["time"]["share"]) == {"head", *result["baselines"], "effects",
                                                "random"}
    text = (tmp_path / "results.md").read_text()
    assert "| raw value-norm-weighted attention |" in text
    assert "| AttnLRP (log p) |" in text and "AttnLRP (log p): " in text
    assert "| per-image LDS, all spans |" in text
    for title in ("Caption accuracy", "The head against raw attention",
                  "The head against raw attention on 8 Ward regions",
                  "The page's heat map: the named object hotter than the rest",
                  "What each scorer of headscope.explain costs", "Attribution head",
                  "Attribution head on the world's cells", "Latency",
                  "Faithfulness against time", "Hallucination detection",
                  "Hallucination detection on hard scenes",
                  "Mixer against softmax vision attention",
                  "The video model's descriptions of held-out clips",
                  "The video head on the world's cells in each quarter",
                  "The video head on 16 Ward regions over space and time"):
        assert f"## {title}" in text
    assert "random region (expected)" in text
    assert "Deletion and insertion AUC" in text and "object hotter than the rest" in text
    assert [line.endswith("...") for line in said].count(True) == len(STEPS)

    # a run stopped after the latency step: the rerun does only the two removed
    del results["steps"]["faithfulness"], results["steps"]["hallucination"]
    (tmp_path / RESULTS).write_text(json.dumps(results))
    said.clear()
    again = reproduce(tmp_path, quick=True, echo=said.append)
    skipped = [line for line in said if line.endswith("skipped")]
    ran = [line for line in said if line.endswith("...")]
    assert len(skipped) == len(STEPS) - 2 and len(ran) == 2
    assert "faithfulness" in ran[0] and "hallucination" in ran[1]
    assert again["steps"]["accuracy"] == steps["accuracy"]
    assert json.loads((tmp_path / RESULTS).read_text())["steps"].keys() == set(STEPS)

    # a latency step of an older format runs again, and so does faithfulness, which uses it
    results = json.loads((tmp_path / RESULTS).read_text())
    del results["steps"]["latency"]["format"]
    (tmp_path / RESULTS).write_text(json.dumps(results))
    said.clear()
    again = reproduce(tmp_path, quick=True, echo=said.append)
    ran = [line for line in said if line.endswith("...")]
    assert len(ran) == 2 and "latency" in ran[0] and "faithfulness" in ran[1]
    assert again["steps"]["faithfulness"]["result"]["latency"] == \
        again["steps"]["latency"]["result"]
