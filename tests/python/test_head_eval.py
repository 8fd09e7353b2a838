"""The head-against-raw-baselines evaluation: its seed ranges, the paired per-image LDS on
hand-made records (one head and one baseline, and several of each), the exclusion of
special-token-only spans, the traced feature set that follows the heads, and the command
end to end on the shipped model."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
from headscope.hf import special_only  # noqa: E402
from headscope.shapes.head_eval import (  # noqa: E402
    RANGE_SIZE, SEED_RANGES, check_traced, head_labels, range_scenes, span_set, summarise,
    summarise_span_sets)


def test_seed_ranges_are_disjoint_from_every_other_use():
    from headscope.shapes.accuracy import HELD_OUT_SEED
    from headscope.shapes.demo import DEMO_OFFSET
    from headscope.shapes.faithfulness import EVAL_OFFSET
    from headscope.shapes.hallucination import OFFSET as HALLUCINATION_OFFSET
    others = [HELD_OUT_SEED + o for o in (0, EVAL_OFFSET, DEMO_OFFSET, HALLUCINATION_OFFSET)]
    firsts = sorted(SEED_RANGES.values())
    assert firsts[0] >= max(others) + RANGE_SIZE  # past every other range's first million
    assert firsts[1] - firsts[0] >= RANGE_SIZE
    dev = range_scenes("dev", 5)
    assert dev[0] == (SEED_RANGES["dev"], 1) and [n for _, n in dev] == [1, 2, 3, 4, 1]
    with pytest.raises(ValueError, match="one of"):
        range_scenes("test", 5)
    with pytest.raises(ValueError, match="'count'"):
        range_scenes("dev", 0)


def test_special_only_spans():
    special = [0, 1, 2]
    assert special_only([1], special)
    assert special_only([1, 0], special)
    assert not special_only([9, 1], special)
    assert not special_only([9], special)


def _record(head, attention, effects, pointing=(), special=()):
    """A scene's record: its sentence spans' rows, then its special-token-only spans'
    (``special``: (head, attention, effects) rows of those)."""
    rows = [*zip(head, attention, effects), *special]
    return {"spans": len(rows),
            "special": torch.tensor([False] * len(effects) + [True] * len(special)),
            "effects": torch.tensor([r[2] for r in rows], dtype=torch.float32),
            "scores": {"head": torch.tensor([r[0] for r in rows], dtype=torch.float32),
                       "attention": torch.tensor([r[1] for r in rows], dtype=torch.float32)},
            "pointing": list(pointing)}


def test_summary_pairs_scenes_and_leaves_out_special_spans():
    up, down = [[1.0, 2.0, 3.0]], [[3.0, 2.0, 1.0]]
    # an end-of-text span where attention ranks like the effects and the head does not
    eos = ([3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    records = [
        # head ranks like the effects (LDS 1), attention reversed (-1): difference 2
        _record(up, down, up, pointing=[({"head": True, "attention": False}, 1 / 3)],
                special=[eos]),
        # two spans: head 1 and -1 (mean 0), attention -1 and 1 (mean 0): difference 0
        _record(up + down, down + up, up + up,
                pointing=[({"head": True, "attention": True}, 1 / 3)], special=[eos]),
        # only the end-of-text span: nothing scored on sentence spans, counted as left out
        _record([], [], [], special=[eos]),
    ]
    s = summarise(records)
    assert s["ms_per_span"] == {}  # no record timed a baseline
    records[0]["seconds"], records[1]["seconds"] = {"attention": 0.003}, {"attention": 0.006}
    records[2]["seconds"] = {"attention": 0.003}
    # timed over every span of the records (6), whichever set is summarised
    assert summarise(records)["ms_per_span"] == pytest.approx({"attention": 2.0})
    assert summarise(records, spans="all")["ms_per_span"] == pytest.approx({"attention": 2.0})
    assert s["span_set"] == "sentence"
    assert s["scenes"] == 3 and s["scenes_scored"] == 2 and s["spans"] == 3
    assert s["special_spans_left_out"] == 3
    assert s["lds"]["head"]["mean"] == pytest.approx(0.5)
    assert s["lds"]["attention"]["mean"] == pytest.approx(-0.5)
    assert s["heads"] == ["head"] and s["baselines"] == ["attention"]
    d = s["lds_difference"]["head - attention"]
    assert list(s["lds_difference"]) == ["head - attention"]
    assert d["mean"] == pytest.approx(1.0) and d["n"] == 2
    assert d["se"] == pytest.approx(1.0)  # std of (2, 0) is sqrt(2), over sqrt(2)
    assert d["interval95"] == pytest.approx([0.0, 2.0])
    assert s["pointing_spans"] == 2
    assert s["pointing"] == pytest.approx({"head": 1.0, "attention": 0.5, "random": 1 / 3})
    # all spans: the end-of-text spans count (head -1, attention 1 on each), the third
    # scene is scored on its end-of-text span alone
    a = summarise(records, spans="all")
    assert a["span_set"] == "all" and a["special_spans_left_out"] == 0
    assert a["spans"] == 6 and a["scenes_scored"] == 3
    assert a["lds"]["head"]["mean"] == pytest.approx((0.0 + (-1 / 3) + -1.0) / 3)
    assert a["lds"]["attention"]["mean"] == pytest.approx((0.0 + 1 / 3 + 1.0) / 3)
    assert a["pointing"] == s["pointing"]  # an end-of-text span names no object


def test_span_sets_differ_by_exactly_the_special_spans():
    """The two sets hold the same sentence spans, and all spans adds each record's
    special-token-only spans, wherever they fall among the record's spans."""
    effects = torch.tensor([[1.0, 2.0, 3.0], [2.0, 1.0, 0.0], [0.0, 5.0, 1.0], [4.0, 4.0, 0.0]])
    record = {"spans": 4, "special": torch.tensor([False, True, False, True]),
              "effects": effects, "scores": {"head": effects * 2}, "pointing": []}
    sentence, every = span_set([record], "sentence")[0], span_set([record], "all")[0]
    assert torch.equal(sentence["effects"], effects[[0, 2]])
    assert torch.equal(sentence["scores"]["head"], 2 * effects[[0, 2]])
    assert sentence["spans"] == 2 and sentence["special_spans"] == 2
    assert torch.equal(every["effects"], effects) and every["special_spans"] == 0
    with pytest.raises(ValueError, match="span set"):
        span_set([record], "words")
    both = summarise_span_sets([_record([[1.0, 2.0, 3.0]], [[3.0, 2.0, 1.0]], [[1.0, 2.0, 3.0]],
                                        special=[([1.0, 2.0, 3.0], [1.0, 2.0, 3.0],
                                                  [1.0, 2.0, 3.0])])])
    assert both["spans"] == 1 and both["all_spans"]["spans"] == 2
    assert both["lds"]["attention"]["mean"] == pytest.approx(-1.0)
    assert both["all_spans"]["lds"]["attention"]["mean"] == pytest.approx(0.0)
    assert {k: v for k, v in both.items() if k != "all_spans"} == summarise(
        [_record([[1.0, 2.0, 3.0]], [[3.0, 2.0, 1.0]], [[1.0, 2.0, 3.0]],
                 special=[([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])])])


def test_summary_pairs_every_head_with_every_baseline():
    """Two heads, two raw baselines: four paired differences of a head to a baseline and
    one of the heads to each other, each of its own pair; a scene where one scorer's LDS
    is undefined (constant scores) counts for none."""
    up, down, flat = [[1.0, 2.0, 3.0]], [[3.0, 2.0, 1.0]], [[1.0, 1.0, 1.0]]

    def record(a, b, raw, weighted, hits):
        return {"spans": 1, "special": torch.tensor([False]), "effects": torch.tensor(up),
                "scores": {k: torch.tensor(v) for k, v in (("head:a", a), ("head:b", b),
                                                          ("attention", raw),
                                                          ("attention*value_norm", weighted))},
                "pointing": [(hits, 0.25)]}

    hits = {"head:a": True, "head:b": False, "attention": True, "attention*value_norm": False}
    records = [record(up, down, up, down, hits), record(up, up, down, down, hits),
               record(up, up, up, flat, hits)]
    s = summarise(records, ["head:a", "head:b"], ["attention", "attention*value_norm"])
    assert s["scenes"] == 3 and s["scenes_scored"] == 2  # the flat scene has no LDS
    assert {k: v["mean"] for k, v in s["lds"].items()} == pytest.approx(
        {"head:a": 1.0, "head:b": 0.0, "attention": 0.0, "attention*value_norm": -1.0})
    assert {k: v["mean"] for k, v in s["lds_difference"].items()} == pytest.approx(
        {"head:a - attention": 1.0, "head:a - attention*value_norm": 2.0,
         "head:b - attention": 0.0, "head:b - attention*value_norm": 1.0,
         "head:a - head:b": 1.0})
    assert s["lds_difference"]["head:b - attention"]["interval95"] == pytest.approx(
        [-2.0, 2.0])  # differences -2 and 2
    assert s["pointing"] == pytest.approx({**{k: float(v) for k, v in hits.items()},
                                           "random": 0.25})


def test_head_labels_and_traced_features():
    from headscope.head import AttributionHead
    assert head_labels(["x/h.safetensors"]) == ["head"]
    assert head_labels(["x/attention.safetensors", "y/both.safetensors"]) == \
        ["head:attention", "head:both"]  # never a raw baseline's name
    with pytest.raises(ValueError, match="share a name"):
        head_labels(["x/h.safetensors", "y/h.safetensors"])
    weighted = {"head": AttributionHead(2, 2, feature_set="attention*value_norm")}
    check_traced(weighted, "attention*value_norm")
    check_traced(weighted, "both")
    with pytest.raises(ValueError, match=r"'attention\*value_norm' block features='attention' "
                                         r"does not trace"):
        check_traced(weighted, "attention")
    with pytest.raises(ValueError, match="features must be one of"):
        check_traced(weighted, "values")


def test_head_eval_command_on_the_shipped_model(tmp_path, capsys):
    from headscope.shapes.__main__ import main
    out = tmp_path / "result.json"
    assert main(["--threads", "1", "head-eval", "--seeds", "dev", "--scenes", "4",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    from headscope.shapes import load
    _, _, shipped = load()
    assert result["features"] == shipped.feature_set  # the tracer follows the head
    assert result["head_feature_sets"] == {"head": shipped.feature_set}
    assert result["seeds"] == [SEED_RANGES["dev"], SEED_RANGES["dev"] + 3]
    assert result["regions"] == "3x3 grid" and result["scenes"] == 4
    # every description that ends within the token budget ends with a special-only span
    assert 1 <= result["special_spans_left_out"] <= 4
    # all spans: the sentence spans and the special-token-only ones, none left out
    every = result["all_spans"]
    assert every["span_set"] == "all" and every["special_spans_left_out"] == 0
    assert every["spans"] == result["spans"] + result["special_spans_left_out"]
    assert list(every["lds_difference"]) == list(result["lds_difference"])
    assert every["pointing"] == result["pointing"]
    for name in ("head", *result["baselines"]):
        assert -1 <= result["lds"][name]["mean"] <= 1
    assert result["pointing"]["random"] == pytest.approx(1 / 9)
    printed = capsys.readouterr().out
    assert "special-token-only spans left out" in printed
    assert "| per-image LDS, all spans |" in printed
    assert "attnlrp" in result["baselines"] and result["ms_per_span"]["attnlrp"] > 0
    assert "| AttnLRP (log p) |" in printed and "AttnLRP (log p): " in printed
    assert f"| head ({shipped.feature_set}) - raw " in printed
    # traced with both blocks, the same head scores the same spans exactly as before (its
    # columns are the same numbers), and each block is a raw baseline
    both = tmp_path / "both.json"
    assert main(["--threads", "1", "head-eval", "--seeds", "dev", "--scenes", "4",
                 "--features", "both", "--json", str(both)]) == 0
    both = json.loads(both.read_text())
    assert both["baselines"] == ["attention", "attention*value_norm", "attnlrp"]
    for name in ("head", *result["baselines"]):
        assert both["lds"][name] == result["lds"][name], name
        assert both["all_spans"]["lds"][name] == every["lds"][name], name
    assert "| raw value-norm-weighted attention |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["head-eval", "--head", str(tmp_path / "missing.safetensors")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--head" in err and "missing.safetensors" in err, err
