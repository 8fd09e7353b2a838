"""``python -m headscope synthetic --quick``: on data whose effects are linear in attention
times value norm, the heads and raw scores rank as that truth implies; without per-key
variation of the value norms, weighting cannot help the head (a control); seeds and bad
arguments."""
from __future__ import annotations

import json

import pytest
import torch

from headscope.commands import main
from headscope.commands import synthetic


def _run(tmp_path, *args):
    report = tmp_path / "report.json"
    assert main(["synthetic", "--quick", "--report", str(report), *args]) == 0
    return json.loads(report.read_text())


def _above_zero(m) -> bool:
    return m["interval95"][0] > 0


def test_value_norms_make_the_head_and_raw_scores_more_faithful(tmp_path, capsys):
    result = _run(tmp_path, "--seed", "dev")
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in synthetic.SCORERS)
    assert result["sizes"] == synthetic.SIZES["quick"] and result["seed"] == synthetic.SEEDS["dev"]
    # the truth is linear in A*N: its head beats the head on A alone, and so does "both"
    heads = result["lds_vs_attention_head"]
    assert _above_zero(heads["head: attention*value_norm"]) and _above_zero(heads["head: both"])
    # raw weighted attention beats raw attention; every head beats raw attention
    assert all(_above_zero(m) for m in result["lds_vs_raw_attention"].values())
    # the paired differences are those of the per-image values written beside them
    per_image = {k: torch.tensor(v) for k, v in result["lds_per_image"].items()}
    diff = per_image["head: attention*value_norm"] - per_image["head: attention"]
    assert heads["head: attention*value_norm"]["mean"] == pytest.approx(float(diff.mean()))
    assert len(per_image["raw attention"]) == synthetic.SIZES["quick"]["test"]


def test_per_head_scales_alone_give_the_heads_the_same_ranking(monkeypatch):
    """With value norms constant over an image's regions (one scale per head), A*N is A
    with each column scaled: the standardised features, and so the heads' scores, are the
    same, and weighting cannot help the head, while it still changes raw attention."""
    monkeypatch.setattr(synthetic, "KEY_SPREAD", 0.0)
    result = synthetic.measure(synthetic.SEEDS["dev"], **synthetic.SIZES["quick"])
    per_image = {k: torch.tensor(v) for k, v in result["lds_per_image"].items()}
    assert torch.allclose(per_image["head: attention*value_norm"],
                          per_image["head: attention"], atol=1e-9)
    assert not torch.allclose(per_image["raw attention*value_norm"], per_image["raw attention"])


def test_seeds_are_fixed_and_distinct():
    sizes = dict(synthetic.SIZES["quick"], train=10, test=5)
    dev = synthetic.generate(synthetic.SEEDS["dev"], **sizes)
    assert torch.equal(dev["test"].effects,
                       synthetic.generate(synthetic.SEEDS["dev"], **sizes)["test"].effects)
    reported = synthetic.generate(synthetic.SEEDS["reported"], **sizes)
    assert not torch.equal(dev["test"].effects, reported["test"].effects)
    a = dev["test"].attention
    assert bool((a >= 0).all()) and torch.allclose(a.sum(2), torch.ones(()).double())
    assert dev["test"].features("both").shape[-1] == 2 * sizes["layers"] * sizes["heads"]


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["synthetic", "--seed", "test"])
    assert e.value.code == 2 and "--seed" in capsys.readouterr().err
    assert main(["synthetic", "--quick", "--report", str(tmp_path / "no" / "r.json")]) == 2
    assert "--report" in capsys.readouterr().err and not (tmp_path / "no").exists()
