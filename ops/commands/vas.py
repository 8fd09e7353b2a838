"""``python -m headscope vas``: the VAS features of each answer of a data set, for fitting
and scoring a hallucination detector (``python -m headscope detector``).

Each line of DATA (a JSON Lines file, or a folder holding one and the images) is a record:

    {"image": "a.png", "prompt": "Describe the image.", "answer": "A cat.", "hallucinated": false}

``image`` (or ``images``, a list) is relative to the file's folder. The prompt and the
images go through the processor's chat template. ``answer`` (optional) is scored
teacher-forced: its tokens (``tokenizer(answer, add_special_tokens=False)``) and the
end-of-sequence token follow the prompt (not with ``"ended": false``: an answer cut short,
as a generation stopped by its token limit); without one the model generates greedily (up to
``--max-new-tokens``; image tokens are never generated) and its answer is recorded. One
forward over prompt and answer inside a ``headscope.hf.Tracer(vas=True)`` gives the 36 VAS
features of the whole sequence and the answer tokens' log-probabilities. The label column
(``hallucinated``, or ``--label``) holds true/false (or 1/0); a record may leave it out.
Every other key is copied to the table (lists and objects as their JSON text), e.g. a
group for ``detector eval --group``. Results go to Parquet shards (``vas_table.py``); a rerun
resumes, and under ``torchrun`` each process takes every world-size-th shard.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..vas import VAS_COLUMNS
from .data import (checked_image_size, image_file, json_records, jsonl_file, non_empty_string,
                   read_image)
from .errors import UsageError, check_output, given, integer
from .models import chat_inputs, device, load_config, load_model, load_processor, text_sizes
from .shards import fill_shards, write_shard_bytes
from .torchrun import rank
from .vas_table import LAYOUT, RESERVED, read_table, shard_bytes

DEFAULT_LABEL = "hallucinated"
WHO = "headscope vas"


@dataclass
class Record:
    line: int                     # 1-based line of the JSON Lines file: the record's key
    images: List[Path]
    prompt: str
    answer: Optional[str]         # None: generated
    label: Optional[bool]
    ended: bool = True            # a given answer is complete: the end token follows it
    columns: Dict[str, Any] = field(default_factory=dict)  # its other keys, for the table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local transformers model folder "
                        "(from_pretrained with its processor, no network)")
    parser.add_argument("--data", required=True,
                        help="folder with images and one .jsonl file (or the .jsonl file)")
    parser.add_argument("--out", required=True,
                        help="the table's folder (resumed when it exists)")
    parser.add_argument("--label", default=DEFAULT_LABEL, metavar="COLUMN",
                        help="the records' key holding the label, true/false or 1/0 "
                             f"(default {DEFAULT_LABEL}; a record may leave it out)")
    parser.add_argument("--max-new-tokens", type=integer(1), default=64, metavar="N",
                        help="tokens generated for a record without an answer, greedily "
                             "(default 64)")
    parser.add_argument("--shard-size", type=integer(1), default=64,
                        help="records per shard file (default 64)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        default="float32", help="model dtype (default float32)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N (default: the process's GPU if any, else cpu)")


# ---- the records ----------------------------------------------------------------------------

def _label(value, where: str, name: str) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise UsageError(f"{where}: label {name!r} must be true/false or 1/0, got {value!r}")


def _column_type(value, where: str, name: str) -> Optional[str]:
    """The Arrow type of a copied key's value (None for null; lists and objects are
    copied as their JSON text)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UsageError(f"{where}: key {name!r} must be finite (it is copied to the "
                             f"table), got {value!r}")
        return "float64"
    return "string"


def _images(path: Path, record: Dict, where: str) -> List[Path]:
    if ("image" in record) == ("images" in record):
        raise UsageError(f"{where}: give one of 'image' (a file) or 'images' (a list of files)")
    if "image" in record:
        return [image_file(path, non_empty_string(record, "image", where), where)]
    names = record["images"]
    if not isinstance(names, list) or not names or \
            not all(isinstance(n, str) and n for n in names):
        raise UsageError(f"{where}: 'images' must be a non-empty list of file names")
    return [image_file(path, name, where) for name in names]


def read_records(data: Path, label: str) -> Tuple[List[Record], Dict[str, str]]:
    """Every record of DATA, checked (the error names the file and the line), and the
    types of the keys copied to the table (a number column holding integers and
    fractions is float64)."""
    path = jsonl_file(data)
    records: List[Record] = []
    types: Dict[str, str] = {}
    for number, record, where in json_records(path):
        images = _images(path, record, where)
        prompt = non_empty_string(record, "prompt", where)
        answer = record.get("answer")
        if answer is not None:
            answer = non_empty_string(record, "answer", where)
        ended = record.get("ended", True)
        if not isinstance(ended, bool) or (answer is None and "ended" in record):
            raise UsageError(f"{where}: 'ended' must be true or false, and only with an "
                             f"'answer', got {ended!r}")
        copied = {k: json.dumps(v) if isinstance(v, (list, dict)) else v
                  for k, v in record.items()
                  if k not in ("image", "images", "prompt", "answer", "ended", label)}
        for name, value in copied.items():
            if name in RESERVED:
                raise UsageError(f"{where}: key {name!r} is a column the table computes; "
                                 f"rename it")
            kind = _column_type(value, where, name)
            if kind is not None and types.setdefault(name, kind) != kind:
                if {kind, types[name]} == {"int64", "float64"}:
                    types[name] = "float64"
                else:
                    raise UsageError(f"{where}: key {name!r} holds a {kind} here but a "
                                     f"{types[name]} on an earlier line")
        records.append(Record(number, images, prompt, answer,
                              _label(record.get(label), where, label), ended, copied))
    if not records:
        raise UsageError(f"{path}: holds no record")
    for record in records:  # keys that some records leave out are null there
        for name in types:
            record.columns.setdefault(name, None)
    return records, types


def answer_ids(tokenizer, answer: str) -> List[int]:
    """The tokens of a given answer, as they follow the prompt (the end token apart)."""
    return tokenizer(answer, add_special_tokens=False)["input_ids"]


def check_answers(records: List[Record], tokenizer, image_ids, data: Path) -> None:
    """A given answer holding an image token is refused: prompt and answer would be no
    valid model input."""
    for record in records:
        if record.answer is None:
            continue
        held = sorted(set(image_ids) & set(answer_ids(tokenizer, record.answer)))
        if held:
            raise UsageError(f"{jsonl_file(data)}:{record.line}: the answer holds the image "
                             f"token {held[0]} ({tokenizer.decode(held[:1])!r}), which only "
                             f"a prompt's image may hold")


# ---- one record -----------------------------------------------------------------------------

def answer_vas(model, inputs: Dict[str, torch.Tensor], answer: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(features (36,), log-probabilities (N,))`` of the answer ``answer`` (N,) after
    the prompt ``inputs``: one forward over both inside a ``Tracer(vas=True)``."""
    from ..hf import Tracer
    from ..hf.answer import continue_inputs
    from ..hf.families import family_of
    full = continue_inputs(family_of(model, WHO), inputs, answer[None])
    with Tracer(model, regions=None, vas=True) as tracer:
        logits = tracer.forward_answer(full, answer.shape[0])[0]
        features = tracer.vas_features()[0]
    logprob = torch.log_softmax(logits.float(), -1).gather(
        1, answer.to(logits.device)[:, None])[:, 0]
    return features.float().cpu(), logprob.cpu()


def score_record(model, processor, record: Record, max_new_tokens: int) -> Dict[str, Any]:
    """The table's row of one record."""
    from ..hf.answer import end_tokens
    from ..hf.families import family_of
    start = time.perf_counter()
    images = [read_image(p, record.line) for p in record.images]
    dev = next(model.parameters()).device
    inputs = chat_inputs(processor, record.prompt, images, dev)
    tokenizer = processor.tokenizer
    ends = end_tokens(model, tokenizer)
    if record.answer is not None:
        answer = torch.tensor(answer_ids(tokenizer, record.answer)
                              + (ends[:1] if record.ended else []), dtype=torch.int64)
        text = record.answer
    else:
        family = family_of(model, WHO)
        P = inputs["input_ids"].shape[1]
        with torch.no_grad():
            sequences = model.generate(**family.model_inputs(inputs),
                                       max_new_tokens=max_new_tokens, do_sample=False,
                                       suppress_tokens=list(family.image_token_ids(
                                           model.config)))
        answer = sequences[0, P:].cpu()
        # one row: generation stopped at its first end token, if any
        done = answer.numel() > 0 and int(answer[-1]) in ends
        text = tokenizer.decode(answer[:-1] if done else answer, skip_special_tokens=False)
    ended = answer.numel() > 0 and int(answer[-1]) in ends
    features, logprob = answer_vas(model, inputs, answer)
    row = {"line": record.line, "answer": text, "generated": record.answer is None,
           "ended": ended, "answer_tokens": int(answer.numel()),
           "answer_logprob": float(logprob.double().mean()),
           "label": record.label, **dict(zip(VAS_COLUMNS, features.tolist())),
           **record.columns}
    row["seconds"] = time.perf_counter() - start
    return row


# ---- the command ----------------------------------------------------------------------------

def prepare(args) -> Tuple[List[Record], Dict[str, str], Dict]:
    """Every check before any work: the output folder, DATA, the images, the model's
    config, family and processor. Returns the records, the copied keys' types and the
    manifest's settings."""
    from ..hf.families import family_of
    check_output(args.out, "--out", folder=True)
    records, types = read_records(Path(args.data), args.label)
    if "label" in given(args) and all(r.label is None for r in records):
        raise UsageError(f"--label {args.label}: no record of {args.data} holds that key")
    for record in records:
        for image in record.images:
            checked_image_size(image, record.line)  # it reads, in a mode taken
    config = load_config(args.model)
    try:
        family = family_of(config, WHO)
    except ValueError as e:
        raise UsageError(f"--model {args.model}: {e}") from e
    processor = load_processor(args.model)
    check_answers(records, processor.tokenizer, family.image_token_ids(config),
                  Path(args.data))
    L, H = text_sizes(config)
    settings = {"model": str(Path(args.model).resolve()), "num_layers": L, "num_heads": H,
                "data": str(Path(args.data).resolve()), "label": args.label,
                "columns": types, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype}
    return records, types, settings


def run(args) -> int:
    records, types, settings = prepare(args)
    out = Path(args.out)

    def start():
        model, processor = load_model(args.model, args.dtype, device(args))
        return lambda i: score_record(model, processor, records[i], args.max_new_tokens)

    def write(shard: int, rows: List[Dict]) -> None:
        write_shard_bytes(out, shard, shard_bytes(rows, types), LAYOUT)

    before = fill_shards(out, LAYOUT, settings, len(records), args.shard_size, start, write,
                         "vas", "record")
    if rank() == 0:
        _, table = read_table(out)
        seconds = table.column("seconds").to_pylist()
        labels = table.column("label").to_pylist()
        print(f"scored {len(records) - before} records now, {table.num_rows} in total "
              f"({before} were there) into {out}: "
              f"{sum(table.column('generated').to_pylist())} answers generated, "
              f"{sum(v is not None for v in labels)} labelled "
              f"({sum(v is True for v in labels)} positive); "
              f"{sum(seconds) / len(seconds):.3f} s per record")
    return 0
