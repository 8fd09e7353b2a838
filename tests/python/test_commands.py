"""``python -m headscope collect|train|eval`` end to end on a tiny random Qwen2-VL saved
with a real processor and a handful of synthetic images: the shards hold what
region_effects and the Tracer give for each example, a collection killed mid-run and
resumed equals one run straight through, two torchrun processes (gloo) give the examples
one process gives, and every command reports bad input with its file and line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
from headscope.commands import main  # noqa: E402
from headscope.commands.collection import read_collection, shard_path  # noqa: E402
from conftest import kill_once_written, usage_error  # noqa: E402
from headscope.hf.families import FAMILIES  # noqa: E402
from headscope.hf.testing import tiny_checkpoint, tiny_dataset, tiny_of  # noqa: E402

IMAGES = 4
COLLECT = ["--regions", "4", "--max-new-tokens", "6", "--subsets", "3", "--shard-size", "1"]
# One intra-op thread everywhere: torchrun gives its workers one, and the comparisons
# between runs are bitwise.
ENV = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")


def headscope(*args, check=True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "headscope", *map(str, args)],
                            capture_output=True, text=True, env=ENV, timeout=300, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-2000:]}\n"
                             f"{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    model = tiny_checkpoint(root / "model", "qwen2_vl")
    data = tiny_dataset(root / "data", IMAGES)
    collection = root / "collection"
    headscope("collect", "--model", model, "--data", data, "--out", collection, *COLLECT)
    return root, model, data, collection


def _same(a, b) -> None:
    assert a.texts == b.texts and a.boxes == b.boxes
    for name, t in a.tensors.items():
        if name == "seconds":
            continue
        assert torch.equal(t, b.tensors[name]), name


def test_collection_holds_tracer_features_and_region_effects(files):
    from headscope.commands.collect import random_subsets
    from headscope.commands.models import load_model
    from headscope.commands.data import load_image, read_examples
    from headscope.commands.collect import prompt_inputs
    from headscope.hf import Tracer, region_effects
    root, model_dir, data, collection = files
    col = read_collection(collection)
    t = col.tensors
    S = col.num_spans
    assert t["line"].tolist() == list(range(1, IMAGES + 1))
    assert t["features"].shape == (S, 4, 2 * 4) and t["effects"].shape == (S, 4)
    assert t["subsets"].shape == (IMAGES, 3, 4) and bool((t["subsets"].sum(-1) == 2).all())
    assert t["subset_effects"].shape == (S, 3)
    assert len(col.texts) == S and all(isinstance(x, str) for x in col.texts)
    assert bool((t["seconds"] > 0).all())
    assert torch.isfinite(t["effects"]).all() and t["effects"].abs().max() > 0
    # example 2 again, by hand: same spans, features and effects
    example = read_examples(data)[1]
    model, processor = load_model(str(model_dir), "float32", torch.device("cpu"))
    inputs = prompt_inputs(processor, example, load_image(example), torch.device("cpu"))
    spans = []
    with torch.no_grad(), Tracer(model, regions=4, vas=False, tokenizer=processor.tokenizer) as tr:
        tr.generate_with(spans.append, **inputs, max_new_tokens=6, do_sample=False)
    mine = t["span_example"] == 1
    assert t["span_bounds"][mine].tolist() == [[s.start, s.end] for s in spans]
    special = processor.tokenizer.all_special_ids
    assert t["special_only"][mine].tolist() == [all(int(i) in special for i in s.token_ids)
                                                for s in spans]
    torch.testing.assert_close(t["features"][mine], torch.stack([s.features for s in spans]))
    subsets = random_subsets(3, 4, 0, example.line)
    assert torch.equal(t["subsets"][1], subsets)
    effects, joint = region_effects(model, inputs, tr.sequences, spans, tr.region_ids,
                                    subsets=subsets, progress=False)
    torch.testing.assert_close(t["effects"][mine], effects)
    torch.testing.assert_close(t["subset_effects"][mine], joint)


def test_train_and_eval_report_numbers(files, tmp_path):
    root, model, data, collection = files
    head = tmp_path / "head.safetensors"
    out = headscope("train", "--data", collection, "--out", head, "--val-fraction", "0.25")
    assert "validation LDS" in out.stdout and head.is_file()
    pearson_head = tmp_path / "pearson.safetensors"
    out = headscope("train", "--data", collection, "--out", pearson_head, "--loss", "pearson",
                    "--epochs", "2")
    assert "train (pearson)" in out.stderr  # the progress bar
    # boxes on words the model did say, so that pointing has spans to score
    col = read_collection(collection)
    lines = [json.loads(x) for x in (data / "data.jsonl").read_text().splitlines()]
    for e, line in enumerate(lines):
        text = col.texts[int((col.tensors["span_example"] == e).nonzero()[0])]
        line["boxes"] = {text.split()[0]: [0, 0, 24, 40]}  # the left half
    boxed = tmp_path / "boxed"
    boxed.mkdir()
    for line in lines:
        (boxed / line["image"]).write_bytes((data / line["image"]).read_bytes())
    (boxed / "data.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    report = tmp_path / "report.json"
    out = headscope("eval", "--model", model, "--head", head, "--data", boxed,
                    "--report", report, *COLLECT, "--attnlrp")
    assert "LDS (mean over images)" in out.stdout and "pointing accuracy" in out.stdout
    results = json.loads(report.read_text())
    # --attnlrp: AttnLRP's scores are collected and scored as a baseline, timed per span
    assert results["baselines"][-1] == "attnlrp" and results["manifest"]["attnlrp"] is True
    assert results["attnlrp"]["ms_per_span"] > 0 and "attnlrp: " in out.stdout
    lrp = read_collection(tmp_path / "report.collect").tensors["attnlrp"]
    assert lrp.shape == (col.num_spans, 4) and bool(torch.isfinite(lrp).all())
    assert lrp.abs().max() > 0
    for scorer in ("head", "attention", "attnlrp"):
        r = results[scorer]
        for key in ("lds", "lds_pooled", "pearson", "subset_lds", "pointing"):
            assert isinstance(r[key], float) and -1 <= r[key] <= 1, (scorer, key, r[key])
        assert r["pointing_spans"] >= IMAGES and len(r["lds_per_image"]) == IMAGES
    # every box is the left half (x < 24 of 48): a random region's chance is the share of
    # regions whose centroid lies there (strictly between 0 and 1 on these images)
    random = results["random"]
    assert random["pointing_spans"] == results["head"]["pointing_spans"]
    assert 0 < random["pointing"] < 1 and "random" in out.stdout.splitlines()[0]
    # the collection eval made of the boxed data equals the plain one (same images)
    _same_numbers = read_collection(tmp_path / "report.collect")
    assert torch.equal(_same_numbers.tensors["effects"], col.tensors["effects"])
    # eval of an existing collection reads it without collecting
    out = headscope("eval", "--model", model, "--head", pearson_head, "--data", collection,
                    "--report", tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["spans"] == col.num_spans


def test_value_norm_features_through_collect_train_eval(files, tmp_path):
    """collect --features both records the feature set and holds the default collection's
    features as its first block; train fits a head of that set; eval collects with the
    head's set, scores a raw baseline per block, refuses a --features without the head's
    columns, and scores a one-block head on a 'both' collection from its own block."""
    root, model, data, collection = files
    both = tmp_path / "both"
    headscope("collect", "--model", model, "--data", data, "--out", both, *COLLECT,
              "--features", "both")
    got, plain = read_collection(both), read_collection(collection)
    assert got.manifest["feature_set"] == "both" and plain.manifest["feature_set"] == "attention"
    features = got.tensors["features"]
    assert features.shape == (plain.num_spans, 4, 2 * 2 * 4)
    assert torch.equal(features[..., :8], plain.tensors["features"])
    assert not torch.allclose(features[..., 8:], features[..., :8])
    assert torch.equal(got.tensors["effects"], plain.tensors["effects"])
    head = tmp_path / "head.safetensors"
    headscope("train", "--data", both, "--out", head)
    from headscope import AttributionHead
    assert AttributionHead.load(head).feature_set == "both"
    report = tmp_path / "report.json"
    out = headscope("eval", "--model", model, "--head", head, "--data", data,
                    "--report", report, *COLLECT)
    results = json.loads(report.read_text())
    assert results["manifest"]["feature_set"] == "both"
    assert results["baselines"] == ["attention", "attention*value_norm"]
    for scorer in ("head", "attention", "attention*value_norm"):
        assert -1 <= results[scorer]["lds"] <= 1 and scorer in out.stdout.splitlines()[0]
    assert results["attention"] != results["attention*value_norm"]
    # a head of one block, on a collection of both: it reads its own block (equal to the
    # single-set collection's, so its scores are the same), and both blocks are baselines
    attention_head = tmp_path / "attention.safetensors"
    headscope("train", "--data", both, "--out", attention_head, "--features", "attention",
              "--keep-special-spans")
    for folder, name in ((both, "on_both.json"), (collection, "on_plain.json")):
        headscope("eval", "--model", model, "--head", attention_head, "--data", folder,
                  "--report", tmp_path / name)
    on_both, on_plain = (json.loads((tmp_path / n).read_text())
                         for n in ("on_both.json", "on_plain.json"))
    assert on_both["baselines"] == ["attention", "attention*value_norm"]
    assert on_plain["baselines"] == ["attention"]
    for scorer in ("head", "attention"):
        assert on_both[scorer] == on_plain[scorer], scorer
    error = headscope("eval", "--model", model, "--head", head, "--data", data, "--report",
                      tmp_path / "r.json", "--work", tmp_path / "w", "--features",
                      "attention", *COLLECT, check=False).stderr
    assert "fitted on 'both' features, expected 'attention'" in error
    error = headscope("eval", "--model", model, "--head", head, "--data", both, "--report",
                      tmp_path / "r.json", "--features", "attention", check=False).stderr
    assert "--features attention: has no effect when --data is a collection (it was made " \
        "with --features both)" in error


def test_resume_after_kill_equals_straight_run(files, tmp_path):
    root, model, data, collection = files
    out = tmp_path / "resumed"
    kill_once_written([sys.executable, "-m", "headscope", "collect", "--model", model,
                       "--data", data, "--out", out, *COLLECT], shard_path(out, 0), ENV,
                      "collect")
    done = sorted(p.name for p in out.glob("shard-*.safetensors"))
    assert 1 <= len(done) < IMAGES, done
    rerun = headscope("collect", "--model", model, "--data", data, "--out", out, *COLLECT)
    assert f"collected {IMAGES - len(done)} examples now, {IMAGES} in total" in rerun.stdout
    assert not list(out.glob(".*.tmp"))
    _same(read_collection(out), read_collection(collection))


def test_torchrun_two_processes_equal_one(files, tmp_path):
    root, model, data, collection = files
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", "-m", "headscope", "collect", "--model", str(model),
           "--data", str(data), "--out", str(out), *COLLECT]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    _same(read_collection(out), read_collection(collection))


def test_help_and_errors(files, tmp_path, capsys):
    root, model, data, collection = files
    for command in ("collect", "train", "eval"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
        assert "--data" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["collect", "--data", str(data)])  # --model and --out missing
    assert e.value.code == 2

    def error(*argv) -> str:
        return usage_error(capsys, *argv)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "image0.png").write_bytes((data / "image0.png").read_bytes())
    (bad / "d.jsonl").write_text('{"image": "image0.png", "prompt": "a"}\n{"image": \n')
    assert f"{bad / 'd.jsonl'}:2: not valid JSON" in error(
        "collect", "--model", model, "--data", bad, "--out", tmp_path / "o")
    (bad / "d.jsonl").write_text('\n{"image": "nope.png", "prompt": "a"}\n')
    assert f"{bad / 'd.jsonl'}:2: image 'nope.png' not found" in error(
        "collect", "--model", model, "--data", bad, "--out", tmp_path / "o")
    (bad / "d.jsonl").write_text('{"image": "image0.png", "prompt": "a", "boxes": {"x": [3, 0, 1, 2]}}\n')
    assert ":1: box of 'x'" in error("collect", "--model", model, "--data", bad,
                                     "--out", tmp_path / "o")
    assert "no such folder" in error("collect", "--model", tmp_path / "none", "--data", data,
                                     "--out", tmp_path / "o")
    assert "other settings" in error("collect", "--model", model, "--data", data,
                                     "--out", collection, *COLLECT[:-2], "--shard-size", "2")
    for grid in ("3", "3x", "0x2"):
        assert "--grid: a grid" in error("collect", "--model", model, "--data", data,
                                        "--out", tmp_path / "o", "--grid", grid)
    assert "no manifest.json" in error("train", "--data", tmp_path, "--out", tmp_path / "h")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text(
        (collection / "manifest.json").read_text())
    assert "shard-00000.safetensors: missing" in error(
        "train", "--data", tmp_path / "broken", "--out", tmp_path / "h")
    from headscope import AttributionHead
    sizes = json.loads((collection / "manifest.json").read_text())
    AttributionHead(sizes["num_layers"], sizes["num_heads"], feature_set="both").save(
        tmp_path / "both.safetensors")
    assert "fitted on 'both' features, expected 'attention'" in error(
        "eval", "--model", model, "--head", tmp_path / "both.safetensors", "--data",
        collection, "--report", tmp_path / "r.json")
    AttributionHead(3, 4).save(tmp_path / "wrong.safetensors")
    assert "num_layers=3, expected 2" in error(
        "eval", "--model", model, "--head", tmp_path / "wrong.safetensors", "--data",
        collection, "--report", tmp_path / "r.json")


def _files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# Bad arguments, each refused before any work. DATA's images are 48x40 pixels (width x
# height): 5 rows and 6 columns of image tokens. ``p``: the paths of _bad_argument_paths.
BAD_ARGUMENTS = {
    "collect-regions-over-tokens": (lambda p: p.collect + ["--regions", "500"],
                                    ["--regions 500", "5x6 image tokens", "allowed: 1 to 30"]),
    "collect-grid-over-tokens": (lambda p: p.collect + ["--grid", "100x100"],
                                 ["--grid 100x100", "at most 5x6"]),
    "collect-grid-and-regions": (lambda p: p.collect + ["--grid", "3x3", "--regions", "4"],
                                 ["--regions 4", "--grid 3x3"]),
    "collect-regions-0": (lambda p: p.collect + ["--regions", "0"],
                          ["--regions", "'0'", ">= 1"]),
    "collect-seed-without-subsets": (lambda p: p.collect + ["--subsets", "0", "--seed", "3"],
                                     ["--seed 3", "--subsets 0"]),
    "eval-head-typo": (lambda p: ["eval", "--model", p.model, "--head", p.tmp / "typo.st",
                                  "--data", p.data, "--report", p.report],
                       ["--head", "typo.st", "no such file"]),
    "eval-head-wrong-size": (lambda p: p.evaluate + ["--data", p.data],
                             ["--head", "num_layers=3, expected 2"]),
    "eval-regions-on-collection": (lambda p: p.evaluate + ["--data", p.collection,
                                                           "--regions", "3"],
                                   ["--regions 3", "--regions 4"]),
    "eval-regions-and-grid": (lambda p: p.evaluate + ["--data", p.collection, "--regions", "3",
                                                      "--grid", "2x2"],
                              ["--regions 3", "--grid 2x2"]),
    "eval-grid-on-collection": (lambda p: p.evaluate + ["--data", p.collection, "--grid", "2x2"],
                                ["--grid 2x2", "--regions 4"]),
    "eval-batch-size-on-collection": (lambda p: p.evaluate + ["--data", p.collection,
                                                              "--batch-size", "2"],
                                      ["--batch-size 2", "collection"]),
    "eval-work-on-collection": (lambda p: p.evaluate + ["--data", p.collection,
                                                        "--work", p.tmp / "w"], ["--work"]),
    "eval-other-model-on-collection": (
        lambda p: ["eval", "--model", p.other, "--head", p.wrong, "--data", p.collection,
                   "--report", p.report], ["--model", "other-model", "loop"]),
    "eval-report-no-folder": (lambda p: p.evaluate + ["--data", p.data, "--report",
                                                      p.tmp / "nodir" / "r.json"],
                              ["nodir/r.json", "does not exist"]),
    "eval-report-folder-is-file": (lambda p: p.evaluate + ["--data", p.data, "--report",
                                                           p.tmp / "file" / "r.json"],
                                   ["file/r.json", "not a folder"]),
    "train-out-no-folder": (lambda p: p.train + ["--out", p.tmp / "nodir" / "h.safetensors"],
                            ["nodir/h.safetensors", "does not exist"]),
    "train-ridge-negative": (lambda p: p.train + ["--out", p.tmp / "h", "--ridge", "-1"],
                             ["--ridge", "'-1'", ">= 0"]),
    "train-ridge-nan": (lambda p: p.train + ["--out", p.tmp / "h", "--ridge", "nan"],
                        ["--ridge", "'nan'", "finite"]),
    "train-epochs-with-lstsq": (lambda p: p.train + ["--out", p.tmp / "h", "--epochs", "3"],
                                ["--epochs 3", "--loss lstsq"]),
    "train-ridge-with-pearson": (lambda p: p.train + ["--out", p.tmp / "h", "--loss",
                                                      "pearson", "--ridge", "1"],
                                 ["--ridge 1.0", "--loss pearson"]),
    "train-effect-weight-with-effects": (lambda p: p.train + ["--out", p.tmp / "h",
                                                              "--effect-weight", "1"],
                                         ["--effect-weight 1.0", "--target effects"]),
    "train-special-span-weight-and-keep": (
        lambda p: p.train + ["--out", p.tmp / "h", "--keep-special-spans",
                             "--special-span-weight", "0.5"],
        ["--special-span-weight 0.5", "--keep-special-spans"]),
    "train-special-span-weight-with-pearson": (
        lambda p: p.train + ["--out", p.tmp / "h", "--loss", "pearson",
                             "--special-span-weight", "0.5"],
        ["--special-span-weight 0.5", "--loss pearson"]),
    "train-special-span-weight-0": (lambda p: p.train + ["--out", p.tmp / "h",
                                                         "--special-span-weight", "0"],
                                    ["--special-span-weight", "'0'", "> 0"]),
    "train-seed-without-val": (lambda p: p.train + ["--out", p.tmp / "h", "--seed", "1"],
                               ["--seed 1", "--val-fraction"]),
    "train-val-fraction-1": (lambda p: p.train + ["--out", p.tmp / "h", "--val-fraction", "1"],
                             ["--val-fraction", "'1'", "< 1"]),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_fail_before_any_work(files, tmp_path, capsys, case):
    """One line naming the argument, the value given and what is allowed, exit 2, and
    nothing created (no collection folder, report or head)."""
    import shutil
    from types import SimpleNamespace
    from headscope import AttributionHead
    root, model, data, collection = files
    p = SimpleNamespace(model=model, data=data, collection=collection, tmp=tmp_path,
                        other=tmp_path / "other-model", wrong=tmp_path / "wrong.safetensors",
                        report=tmp_path / "r.json")
    shutil.copytree(model, p.other)
    AttributionHead(3, 4).save(p.wrong)
    (tmp_path / "file").write_text("")
    p.collect = ["collect", "--model", model, "--data", data, "--out", tmp_path / "out"]
    p.evaluate = ["eval", "--model", model, "--head", p.wrong, "--report", p.report]
    p.train = ["train", "--data", collection]
    before = _files_under(tmp_path)
    argv, words = BAD_ARGUMENTS[case]
    err = usage_error(capsys, *argv(p))
    assert ".tmp" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert _files_under(tmp_path) == before, err


def test_refused_collection_leaves_nothing_that_blocks_a_rerun(files, tmp_path, capsys):
    root, model, data, collection = files
    out = tmp_path / "out"
    usage_error(capsys, "collect", "--model", model, "--data", data, "--out", out,
                 "--regions", "500")
    headscope("collect", "--model", model, "--data", data, "--out", out, "--regions", "2",
              "--max-new-tokens", "2", "--subsets", "0", "--shard-size", "4")
    assert read_collection(out).manifest["regions"] == 2


def test_damaged_shard_is_found_by_its_checksum(files, tmp_path, capsys):
    import shutil
    from headscope.commands.errors import UsageError
    root, model, data, collection = files
    copy = tmp_path / "copy"
    shutil.copytree(collection, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    assert sorted(manifest["checksums"]) == [shard_path(copy, s).name for s in range(IMAGES)]
    shard = shard_path(copy, 1)
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[-1] ^= 0x01  # the last tensor's last byte: the header still parses
    shard.write_bytes(bytes(data_bytes))
    with pytest.raises(UsageError, match="shard-00001.safetensors: damaged"):
        read_collection(copy)
    err = usage_error(capsys, "train", "--data", copy, "--out", tmp_path / "h.safetensors")
    assert "shard-00001.safetensors: damaged" in err
    assert not (tmp_path / "h.safetensors").exists()


def test_resume_records_the_checksum_of_a_shard_written_just_before_a_kill(files, tmp_path):
    """A kill between a shard's rename and the manifest's update leaves a complete shard
    without a checksum (and maybe the manifest's temporary file): the rerun records it."""
    import shutil
    from headscope.commands.errors import UsageError
    root, model, data, collection = files
    copy = tmp_path / "copy"
    shutil.copytree(collection, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["checksums"][shard_path(copy, 2).name]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / ".manifest.json.abc123.tmp").write_text("{")
    with pytest.raises(UsageError, match="shard-00002.safetensors: no SHA-256 recorded"):
        read_collection(copy)
    out = headscope("collect", "--model", model, "--data", data, "--out", copy, *COLLECT)
    assert f"collected 0 examples now, {IMAGES} in total" in out.stdout
    assert not list(copy.glob(".*.tmp"))
    _same(read_collection(copy), read_collection(collection))


def _written_collection(folder, feature_set, special=None):
    """A collection of 2 examples, 6 spans, 3 regions, 2 layers x 2 heads, written with the
    shards' own writer; ``special``: each span's special_only flag (None: not recorded,
    as an older collect wrote it)."""
    from headscope.commands.collection import write_manifest, write_shard
    g = torch.Generator().manual_seed(5)
    S, K, F = 6, 3, 4 * (2 if feature_set == "both" else 1)
    features = torch.rand(S, K, F, generator=g)
    folder.mkdir()
    # the effects follow feature 1, with noise: each subset of spans has its own fit
    effects = features[..., 1] + 0.01 * torch.randn(S, K, generator=g)
    write_manifest(folder, {"model": "m", "num_layers": 2, "num_heads": 2,
                            "feature_set": feature_set, "examples": 2, "shard_size": 2})
    tensors = {"line": torch.tensor([1, 2]), "span_example": torch.tensor([0, 0, 0, 1, 1, 1]),
               "span_bounds": torch.tensor([[i, i + 1] for i in range(S)]),
               "features": features, "effects": effects,
               "subsets": torch.zeros(2, 0, K, dtype=torch.bool),
               "subset_effects": torch.zeros(S, 0), "grid": torch.tensor([[1, 3], [1, 3]]),
               "labels": torch.tensor([0, 1, 2, 0, 1, 2]),
               "image_size": torch.tensor([[3, 1], [3, 1]]),
               "seconds": torch.ones(2, 2, dtype=torch.float64)}
    if special is not None:
        tensors["special_only"] = torch.tensor(special)
    write_shard(folder, 0, tensors, ["a."] * S, [{}, {}])
    return features, effects


def test_train_leaves_special_spans_out_and_fits_a_block_of_both(tmp_path, capsys):
    """train fits on the spans that are not only special tokens (as head-eval scores), or
    on all with --keep-special-spans; --features takes one block out of a 'both'
    collection; a collection that does not record special spans is refused by default."""
    from headscope.head import AttributionHead
    special = [False, False, True, False, False, True]
    features, effects = _written_collection(tmp_path / "both", "both", special)
    ordinary = ~torch.tensor(special)

    def fitted(*extra):
        out = tmp_path / f"head{len(list(tmp_path.glob('*.safetensors')))}.safetensors"
        assert main(["train", "--data", str(tmp_path / "both"), "--out", str(out),
                     *extra]) == 0
        return AttributionHead.load(str(out))

    def same(head, expected):
        assert head.feature_set == expected.feature_set
        for name in ("weight", "bias", "mean", "std"):
            assert torch.equal(getattr(head, name), getattr(expected, name)), name

    same(fitted(), AttributionHead(2, 2, feature_set="both").fit(features[ordinary],
                                                                 effects[ordinary]))
    assert "on 4 spans x 3 regions (2 special-token-only spans left out)" in \
        capsys.readouterr().out
    same(fitted("--keep-special-spans"),
         AttributionHead(2, 2, feature_set="both").fit(features, effects))
    same(fitted("--features", "attention"),
         AttributionHead(2, 2).fit(features[ordinary][..., :4], effects[ordinary]))
    same(fitted("--features", "attention*value_norm"),
         AttributionHead(2, 2, feature_set="attention*value_norm").fit(
             features[ordinary][..., 4:], effects[ordinary]))
    # a held-out image is scored on its ordinary spans only
    fitted("--val-fraction", "0.5")
    assert "validation LDS" in capsys.readouterr().out
    _written_collection(tmp_path / "attention", "attention", special)
    err = usage_error(capsys, "train", "--data", tmp_path / "attention", "--out",
                       tmp_path / "h.safetensors", "--features", "both")
    assert "--features both: the collection" in err and "holds feature set 'attention'" in err
    _written_collection(tmp_path / "older", "attention")
    err = usage_error(capsys, "train", "--data", tmp_path / "older", "--out",
                       tmp_path / "h.safetensors")
    assert "does not record which spans are only special tokens" in err
    assert "--keep-special-spans" in err
    err = usage_error(capsys, "train", "--data", tmp_path / "older", "--out",
                      tmp_path / "h.safetensors", "--special-span-weight", "0.1")
    assert "--special-span-weight 0.1" in err and "collect it again" in err
    assert main(["train", "--data", str(tmp_path / "older"), "--out",
                 str(tmp_path / "older.safetensors"), "--keep-special-spans"]) == 0


def test_ranked_targets():
    """Per span: standardised average ranks (ties share theirs) plus the weighted
    standardised effects; a span of equal effects gives zeros."""
    from headscope.commands.train import ranked_targets
    effects = torch.tensor([[0.1, 5.0, 2.0], [3.0, 1.0, 3.0], [2.0, 2.0, 2.0]])
    z = (torch.tensor([0.0, 1.0, 2.0]) - 1) / (2 / 3) ** 0.5  # ranks 0, 1, 2 standardised
    assert torch.allclose(ranked_targets(effects, 0.0)[0], z[[0, 2, 1]].double())
    tied = torch.tensor([1.5, 0.0, 1.5]) - 1  # ranks 1.5, 0, 1.5 centred: std 1/sqrt(2)
    assert torch.allclose(ranked_targets(effects, 0.0)[1], (tied * 2 ** 0.5).double())
    assert torch.equal(ranked_targets(effects, 0.5)[2], torch.zeros(3, dtype=torch.float64))
    e = effects[0].double()
    assert torch.allclose(ranked_targets(effects, 0.5)[0] - ranked_targets(effects, 0.0)[0],
                          0.5 * (e - e.mean()) / e.std(unbiased=False))


def test_train_fits_ranked_targets(tmp_path, capsys):
    """--target ranks fits the head to ranked_targets of the same spans (the closed form on
    them), --effect-weight sets their mix; the LDS printed is against the effects."""
    from headscope.head import AttributionHead
    from headscope.commands.train import ranked_targets
    special = [False, False, True, False, False, True]
    features, effects = _written_collection(tmp_path / "both", "both", special)
    ordinary = ~torch.tensor(special)
    for weight in ("0.5", "2"):
        out = tmp_path / f"ranks{weight}.safetensors"
        assert main(["train", "--data", str(tmp_path / "both"), "--out", str(out),
                     "--target", "ranks", "--effect-weight", weight]) == 0
        head = AttributionHead.load(str(out))
        expected = AttributionHead(2, 2, feature_set="both").fit(
            features[ordinary], ranked_targets(effects[ordinary], float(weight))).calibrate(
            features[ordinary], effects[ordinary])
        for name in ("weight", "bias", "mean", "std"):
            assert torch.equal(getattr(head, name), getattr(expected, name)), name
    assert "train LDS" in capsys.readouterr().out
    # --special-span-weight: the special-token-only spans fitted too, weighing that much
    out = tmp_path / "weighted.safetensors"
    assert main(["train", "--data", str(tmp_path / "both"), "--out", str(out), "--target",
                 "ranks", "--special-span-weight", "0.1"]) == 0
    assert "(2 special-token-only spans weighted 0.1)" in capsys.readouterr().out
    head = AttributionHead.load(str(out))
    weights = torch.where(torch.tensor(special), 0.1, 1.0).unsqueeze(1).expand(-1, 3)
    expected = AttributionHead(2, 2, feature_set="both").fit(
        features, ranked_targets(effects, 0.5), weights=weights).calibrate(
        features, effects, weights)
    for name in ("weight", "bias", "mean", "std"):
        assert torch.equal(getattr(head, name), getattr(expected, name)), name


def test_manifest_feature_sets(tmp_path):
    """One feature set per collection; a manifest from before feature sets holds
    "attention" (resumable as such); feature columns must match it."""
    from headscope.commands.errors import UsageError
    from headscope.commands.collection import (check_feature_columns, feature_set,
                                               read_manifest, write_manifest)
    from headscope.commands.shards import MANIFEST
    settings = {"model": "m", "num_layers": 2, "num_heads": 3}
    write_manifest(tmp_path, settings)  # an older collect's settings: no feature_set
    assert feature_set(read_manifest(tmp_path)) == "attention"
    write_manifest(tmp_path, {**settings, "feature_set": "attention"})  # resumes
    with pytest.raises(UsageError, match=r"feature_set: 'attention', now 'both'"):
        write_manifest(tmp_path, {**settings, "feature_set": "both"})
    manifest = read_manifest(tmp_path)
    check_feature_columns(manifest, 6, "train")
    with pytest.raises(UsageError, match=r"train: features have 12 columns; the manifest's 2 "
                                         r"layers x 3 heads of feature set 'attention' make 6"):
        check_feature_columns(manifest, 12, "train")
    check_feature_columns({**manifest, "feature_set": "both"}, 12, "train")
    with pytest.raises(UsageError, match=r"feature_set must be one of"):
        feature_set({**manifest, "feature_set": "values"})
    assert (tmp_path / MANIFEST).is_file()


def test_readme_loop_commands_parse():
    """The README's loop: every `python -m headscope` line is a valid command line (the
    loop itself runs in the tests above, on the same tiny model and data)."""
    import shlex
    from conftest import REPO
    from headscope.commands import parser
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Your own VLM"):]
    block = section[section.index("```bash\n") + 8:section.index("```\n", 8)]
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    assert len(lines) == 5
    commands = [shlex.split(line)[3:] for line in lines if line.startswith("python -m headscope")]
    assert [c[0] for c in commands] == ["collect", "train", "eval"]
    for argv in commands:
        parser().parse_args(argv)
    assert "tiny_checkpoint('model')" in lines[0] and "tiny_dataset('data'" in lines[0]


def test_figure_centroids_are_the_metric_centroids_in_pixels():
    import numpy as np
    from headscope.shapes.figures import region_centroids as pixel_centroids
    labels = np.array([0, 0, 1, 1, 0, 0, 2, 2])
    assert np.allclose(pixel_centroids(labels, (2, 4), 96, 3),
                       [[24, 48], [72, 24], [72, 72]])


def test_grid_collection_has_the_grid_regions(files, tmp_path):
    from headscope.hf import grid_regions
    root, model, data, _ = files
    out = tmp_path / "grid"
    headscope("collect", "--model", model, "--data", data, "--out", out, "--grid", "2X3",
              *COLLECT[2:])
    got = read_collection(out)
    assert got.manifest["grid"] == "2x3" and got.manifest["regions"] == 6
    rows, cols = got.tensors["grid"][0].tolist()
    labels = got.tensors["labels"].reshape(IMAGES, rows * cols)
    assert (labels == grid_regions(2, 3)(None, (rows, cols))).all()
    assert got.tensors["effects"].shape[1] == 6


@pytest.mark.parametrize("family", [t for f in FAMILIES for t in tiny_of(f).spec.commands])
def test_collect_train_eval_on_a_saved_model_of_another_layout(tmp_path, family):
    """The commands on a saved tiny model of a family other than the Qwen-VL of the
    other tests, with its real processor, on non-square pictures: the model types each
    family module names in its TinySpec.commands (layouts of their own: rows with break
    tokens, tiles and a thumbnail, tiles with row and column markers, Qwen's grid under
    another processor)."""
    model = tiny_checkpoint(tmp_path / "model", family)
    data = tiny_dataset(tmp_path / "data", 3, size=(48, 24))
    collection = tmp_path / "collection"
    headscope("collect", "--model", model, "--data", data, "--out", collection, "--regions",
              "4", "--max-new-tokens", "4", "--subsets", "2", "--shard-size", "1")
    t = read_collection(collection).tensors
    assert t["features"].shape[1:] == (4, 2 * 4)
    assert torch.isfinite(t["effects"]).all() and t["effects"].abs().max() > 0
    headscope("train", "--data", collection, "--out", tmp_path / "head", "--val-fraction",
              "0.25")
    out = headscope("eval", "--model", model, "--head", tmp_path / "head", "--data", data,
                    "--regions", "4", "--max-new-tokens", "4", "--report",
                    tmp_path / "report.json")
    assert "LDS (mean over images)" in out.stdout
