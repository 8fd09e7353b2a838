"""``python -m headscope vas`` and ``detector fit|eval`` end to end on the shapes model,
with answers to hard scenes written and labelled by headscope.shapes: the table holds the
features and log-probabilities of the docs' hallucination measurement (the same Tracer
forward), a given answer scores as the same answer generated, a run killed mid-way and
resumed equals one straight run, two torchrun processes equal one; and on a tiny model of
every supported family, the command's features equal the Tracer's."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
import headscope  # noqa: E402
from headscope.commands import main  # noqa: E402
from headscope.commands.shards import shard_path  # noqa: E402
from conftest import kill_once_written, usage_error  # noqa: E402
from headscope.commands.vas_table import LAYOUT, read_table  # noqa: E402
from headscope.hf.families import FAMILIES  # noqa: E402
from headscope.hf.testing import tiny_of  # noqa: E402
from headscope.shapes.model import DATA_DIR  # noqa: E402

# Hard scenes (5 to 9 objects) of the hallucination measurement whose answers hold both
# classes: FIT for the detector, TEST held out (shapes.write_answers' start and count).
FIT, TEST = (0, 8), (8, 8)  # 1 and 2 hallucinated answers (to 9-object scenes)
OBJECTS = (5, 9)
ENV = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
# every registered model type; where the family contract cannot hold yet (its TinySpec's
# contract_xfail), the command fails too (exit 1)
MODEL_TYPES = [pytest.param(t, marks=() if tiny_of(f).spec.contract_xfail is None
                            else pytest.mark.xfail(strict=True,
                                                   reason=tiny_of(f).spec.contract_xfail[1]))
               for f in FAMILIES for t in f.model_types]


def headscope_cli(*args, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "headscope", *map(str, args)],
                            capture_output=True, text=True, env=ENV, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-2000:]}\n"
                             f"{result.stderr[-4000:]}")
    return result


def run(*argv) -> None:
    code = main([str(a) for a in argv])
    assert code == 0, code


def rows(folder) -> list:
    """The table's rows, without the time each took."""
    _, table = read_table(Path(folder))
    return [{k: v for k, v in row.items() if k != "seconds"} for row in table.to_pylist()]


def lines(data: Path) -> list:
    return [json.loads(x) for x in (data / "data.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory):
    """Two DATA folders of labelled answers to hard scenes (fit and test), and the fit
    set's table."""
    from headscope.shapes.dataset import write_answers
    root = tmp_path_factory.mktemp("vas")
    fit = write_answers(root / "fit", FIT[1], FIT[0], OBJECTS, progress=False)
    test = write_answers(root / "test", TEST[1], TEST[0], OBJECTS, progress=False)
    for data in (fit, test):
        labels = [x["hallucinated"] for x in lines(data)]
        assert any(labels) and not all(labels), labels  # both classes: the scenes chosen so
    run("vas", "--model", DATA_DIR, "--data", fit, "--out", root / "fit.vas",
        "--shard-size", "3")
    return root, fit, test


def test_table_holds_the_hallucination_measurements_features(shapes_data):
    """The table equals what headscope.shapes.hallucination.answers computes for the same
    scenes (its own generation and Tracer forward): labels, answers, VAS (1e-6) and the
    mean log-probability."""
    from headscope.shapes.hallucination import answers
    root, fit, _ = shapes_data
    got = rows(root / "fit.vas")
    want = answers(FIT[1], FIT[0], progress=False, objects=OBJECTS)
    records = lines(fit)
    assert [r["line"] for r in got] == list(range(1, FIT[1] + 1))
    assert [r["answer"] for r in got] == want["texts"] == [x["answer"] for x in records]
    assert [r["label"] for r in got] == want["hallucinated"].tolist()
    assert [r["objects"] for r in got] == want["objects"].tolist()
    assert [r["seed"] for r in got] == [x["seed"] for x in records]
    assert not any(r["generated"] for r in got)
    # the 9-object answer runs into the 64-token limit: scored without an end token
    assert [r["ended"] for r in got] == [x["ended"] for x in records] \
        == [n < 9 for n in want["objects"].tolist()]
    features = torch.tensor([[r[c] for c in headscope.VAS_COLUMNS] for r in got])
    torch.testing.assert_close(features, want["features"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.tensor([r["answer_logprob"] for r in got], dtype=torch.float64),
                               want["logprob"].double(), atol=1e-6, rtol=1e-6)
    manifest, _ = read_table(root / "fit.vas")
    assert manifest["columns"] == {"objects": "int64", "seed": "int64"}
    assert manifest["label"] == "hallucinated"


def test_given_answer_scores_as_the_same_answer_generated(shapes_data, tmp_path):
    root, fit, _ = shapes_data
    data = tmp_path / "data"
    shutil.copytree(fit, data)
    records = lines(data)
    for record in records:
        del record["answer"], record["ended"]
    (data / "data.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    run("vas", "--model", DATA_DIR, "--data", data, "--out", tmp_path / "out",
        "--shard-size", "4")
    generated, given = rows(tmp_path / "out"), rows(root / "fit.vas")
    assert all(r["generated"] for r in generated)
    for a, b in zip(generated, given):
        assert a["answer"] == b["answer"] and a["answer_tokens"] == b["answer_tokens"]
        assert a["ended"] == b["ended"]
        features = torch.tensor([[r[c] for c in headscope.VAS_COLUMNS] for r in (a, b)])
        torch.testing.assert_close(features[0], features[1], atol=1e-6, rtol=1e-6)
        assert abs(a["answer_logprob"] - b["answer_logprob"]) < 1e-6


def test_detector_fit_and_eval_on_held_out_answers(shapes_data, tmp_path):
    from headscope import VASDetector
    from headscope.metrics import auroc, auroc_within
    root, _, test = shapes_data
    run("vas", "--model", DATA_DIR, "--data", test, "--out", tmp_path / "test.vas")
    for features, width in (("vas", 36), ("vas+logprob", 37), ("logprob", 1)):
        detector = tmp_path / f"{features}.safetensors"
        run("detector", "fit", "--data", root / "fit.vas", "--out", detector,
            "--features", features)
        assert VASDetector.load(detector).num_features == width
    report = tmp_path / "report.json"
    run("detector", "eval", "--detector", tmp_path / "vas+logprob.safetensors", "--data",
        tmp_path / "test.vas", "--group", "objects", "--report", report, "--rounds", "200")
    result = json.loads(report.read_text())
    table = rows(tmp_path / "test.vas")
    labels = torch.tensor([r["label"] for r in table])
    logprob = torch.tensor([r["answer_logprob"] for r in table], dtype=torch.float64)
    counts = torch.tensor([r["objects"] for r in table])
    assert result["records"] == TEST[1] and result["positive"] == int(labels.sum())
    baseline = result["mean_logprob"]
    assert baseline["auroc"] == auroc(-logprob, labels)
    assert baseline["auroc_within_groups"] == auroc_within(-logprob, labels, counts)
    detector = VASDetector.load(tmp_path / "vas+logprob.safetensors")
    assert detector.columns == [*headscope.VAS_COLUMNS, "answer_logprob"]
    X = torch.tensor([[r[c] for c in detector.columns] for r in table], dtype=torch.float64)
    assert result["detector"]["auroc"] == auroc(detector.predict_proba(X), labels)
    for name in ("detector", "mean_logprob"):
        low, high = result[name]["interval95"]
        assert 0 <= low <= result[name]["auroc"] <= high <= 1
    assert result["auroc_group_alone"] == auroc(counts.double(), labels)
    assert sum(g["records"] for g in result["groups"]) == TEST[1]
    # the logprob-only detector ranks as the baseline does (a monotone map of it)
    run("detector", "eval", "--detector", tmp_path / "logprob.safetensors", "--data",
        tmp_path / "test.vas", "--report", tmp_path / "lp.json", "--rounds", "20")
    lp = json.loads((tmp_path / "lp.json").read_text())
    assert lp["detector"]["auroc"] == pytest.approx(lp["mean_logprob"]["auroc"])


def test_resume_after_kill_equals_straight_run(shapes_data, tmp_path):
    root, fit, _ = shapes_data
    out = tmp_path / "resumed"
    args = ["vas", "--model", DATA_DIR, "--data", fit, "--out", out, "--shard-size", "3"]
    kill_once_written([sys.executable, "-m", "headscope", *args], shard_path(out, 0, LAYOUT),
                      ENV, "vas")
    done = sorted(p.name for p in out.glob("shard-*.parquet"))
    assert 1 <= len(done) < 3, done
    rerun = headscope_cli(*args)
    assert f"{FIT[1]} in total" in rerun.stdout
    assert not list(out.glob(".*.tmp"))
    assert rows(out) == rows(root / "fit.vas")


def test_torchrun_two_processes_equal_one(shapes_data, tmp_path):
    root, fit, _ = shapes_data
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", "-m", "headscope", "vas", "--model", str(DATA_DIR),
           "--data", str(fit), "--out", str(out), "--shard-size", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert rows(out) == rows(root / "fit.vas")


# ---- every supported family -------------------------------------------------------------------

@pytest.mark.parametrize("family", MODEL_TYPES)
def test_features_equal_the_tracers_on_every_family(family, tmp_path):
    """A record with an answer and one without: the table's features equal those of
    Tracer.generate over the same prompt (forced to the given answer's tokens, or free),
    whose vas_features trace the final sequence."""
    from PIL import Image
    from headscope.commands.models import chat_inputs, load_model
    from headscope.hf.answer import end_tokens
    from headscope.hf import Tracer
    from headscope.hf.families import family_of
    from headscope.hf.testing import tiny_checkpoint, tiny_dataset
    try:
        model_dir = tiny_checkpoint(tmp_path / "model", family)
    except (ValueError, NotImplementedError) as e:  # a family the tests have no processor of
        if "tiny_processor" not in str(e):
            raise
        pytest.skip(str(e))
    data = tiny_dataset(tmp_path / "data", 2, size=(48, 24))
    records = lines(data)
    records[0]["answer"] = "a red cat on the left ."
    records[1]["hallucinated"] = True
    (data / "data.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    assert main(["vas", "--model", str(model_dir), "--data", str(data), "--out",
                 str(tmp_path / "out"), "--max-new-tokens", "3"]) == 0
    got = rows(tmp_path / "out")
    assert [r["generated"] for r in got] == [False, True]
    assert [r["label"] for r in got] == [None, True]
    model, processor = load_model(str(model_dir), "float32", torch.device("cpu"))
    image_ids = list(family_of(model).image_token_ids(model.config))
    for row, record in zip(got, records):
        inputs = chat_inputs(processor, record["prompt"],
                             [Image.open(data / record["image"]).convert("RGB")], "cpu")
        P = inputs["input_ids"].shape[1]
        kwargs = dict(max_new_tokens=3, do_sample=False, suppress_tokens=image_ids)
        if "answer" in record:
            forced = processor.tokenizer(record["answer"], add_special_tokens=False)[
                "input_ids"] + end_tokens(model, processor.tokenizer)[:1]
            kwargs = dict(max_new_tokens=len(forced), do_sample=False,
                          prefix_allowed_tokens_fn=lambda b, ids: [forced[len(ids) - P]])
        with torch.no_grad(), Tracer(model, regions=None, vas=True) as tr:
            tr.generate_with(lambda span: None, **inputs, **kwargs)
            want = tr.vas_features()[0]
        assert row["answer_tokens"] == tr.sequences.shape[1] - P
        features = torch.tensor([row[c] for c in headscope.VAS_COLUMNS])
        torch.testing.assert_close(features, want, atol=1e-6, rtol=1e-6)
        assert row["answer_logprob"] < 0


def test_unsupported_family_and_bad_arguments_fail_before_any_work(shapes_data, tmp_path,
                                                                    capsys):
    import transformers as tf
    root, fit, _ = shapes_data
    mllama = tmp_path / "mllama"
    tf.MllamaConfig(text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, cross_attention_layers=[1]),
                    vision_config=dict(hidden_size=16, num_hidden_layers=1,
                                       num_global_layers=1, attention_heads=2,
                                       intermediate_size=32, image_size=28, patch_size=14,
                                       vision_output_dim=32)).save_pretrained(mllama)
    made = []

    def write(*records) -> Path:
        """A DATA folder of its own holding ``records`` and the image a.png."""
        folder = tmp_path / f"bad{len(made)}"
        folder.mkdir()
        shutil.copy(fit / lines(fit)[0]["image"], folder / "a.png")
        (folder / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
        made.append(folder)
        return folder

    good = {"image": "a.png", "prompt": "Describe the image."}
    cases = [
        (["vas", "--model", mllama, "--data", fit], ["--model", "not supported",
                                                     "cross-attention"]),
        (["vas", "--model", DATA_DIR, "--data", write(dict(good, hallucinated="yes"))],
         ["d.jsonl:1", "label 'hallucinated'", "true/false"]),
        (["vas", "--model", DATA_DIR, "--data", write(dict(good, image="x.png"))],
         ["d.jsonl:1", "'x.png' not found"]),
        (["vas", "--model", DATA_DIR, "--data", write(dict(good, images=["a.png"]))],
         ["d.jsonl:1", "one of 'image'"]),
        (["vas", "--model", DATA_DIR, "--data", write(dict(good, ended=False))],
         ["d.jsonl:1", "'ended'", "only with an 'answer'"]),
        (["vas", "--model", DATA_DIR, "--data", write(good, dict(good, objects="5"),
                                                      dict(good, objects=5))],
         ["d.jsonl:3", "'objects'", "string on an earlier line"]),
        (["vas", "--model", DATA_DIR, "--data", write(dict(good, line=3))],
         ["'line' is a column the table computes"]),
        (["vas", "--model", DATA_DIR, "--data", write(dict(good, answer="A <|image_pad|>."))],
         ["d.jsonl:1", "image token"]),
        (["vas", "--model", DATA_DIR, "--data", write(good), "--label", "wrong"],
         ["--label wrong", "no record"]),
        (["vas", "--model", DATA_DIR, "--data", fit, "--max-new-tokens", "0"],
         ["--max-new-tokens", ">= 1"]),
        (["detector", "fit", "--data", root / "fit.vas", "--out", tmp_path / "no" / "d"],
         ["--out", "does not exist"]),
        (["detector", "fit", "--data", fit, "--out", tmp_path / "d"],
         ["no manifest.json", "headscope vas"]),
        (["detector", "eval", "--detector", tmp_path / "none", "--data", root / "fit.vas"],
         ["--detector", "no such file"]),
        (["detector", "eval", "--detector", DATA_DIR / "head.safetensors", "--data",
          root / "fit.vas"], ["--detector", "not a headscope.VASDetector file"]),
    ]
    for argv, words in cases:
        if argv[0] == "vas":
            argv = argv + ["--out", tmp_path / "out"]
        before = sorted(p.name for p in tmp_path.iterdir())
        err = usage_error(capsys, *argv)
        for word in words:
            assert word in err, (word, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, err
    # a detector fitted elsewhere must find its columns in the table
    run("detector", "fit", "--data", root / "fit.vas", "--out", tmp_path / "d.safetensors")
    capsys.readouterr()
    assert main(["detector", "eval", "--detector", str(tmp_path / "d.safetensors"), "--data",
                 str(root / "fit.vas"), "--group", "colour"]) == 2
    assert "--group colour: not a column" in capsys.readouterr().err
