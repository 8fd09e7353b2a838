"""``python -m headscope collect|train|eval``: the loop that fits and checks an attribution
head on a user's own VLM; ``vas`` and ``detector fit|eval``: the loop that fits and checks
a hallucination detector on the VAS features of its answers.

    python -m headscope collect --model MODEL --data DATA --out runs/train
    python -m headscope train --data runs/train --out head.safetensors
    python -m headscope eval --model MODEL --head head.safetensors --data DATA_TEST
    python -m headscope synthetic [--quick] [--seed dev|reported]
    python -m headscope explain --model MODEL --image PHOTO --prompt TEXT [--serve]
    python -m headscope vas --model MODEL --data DATA --out runs/vas-fit
    python -m headscope detector fit --data runs/vas-fit --out detector.safetensors
    python -m headscope detector eval --detector detector.safetensors --data runs/vas-test

``synthetic`` measures the head of each feature set against raw attention on synthetic data
whose truth is known (no model needed). ``explain`` answers a prompt about your pictures and
shows which regions each span of the answer rests on (a page, report.json, PNGs).

Exit codes: 0 success, 1 the run failed, 2 bad arguments or a missing or malformed input
file (one line naming the argument or the file and line; checked before any work, so
nothing was computed or created), 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import sys
import traceback

from .errors import FAILURE, Parser, reported
from .torchrun import leave_process_group

COMMANDS = {
    "collect": "generate, cut spans, record span features and region ablation effects",
    "train": "fit an AttributionHead to collected features and effects",
    "eval": "LDS, Pearson, subset LDS and pointing of a head against raw attention",
    "synthetic": "each feature set's head against raw attention on synthetic data with "
                 "value norms",
    "explain": "answer a prompt about your pictures and show which regions each span rests on",
    "vas": "the VAS features and log-probability of each answer of a data set (Parquet)",
    "detector": "fit a hallucination detector on `vas` tables, or score it (AUROC)",
}


def parser() -> argparse.ArgumentParser:
    from . import collect, detector, evaluate, explain, synthetic, train, vas
    top = Parser(prog="python -m headscope", description=__doc__.replace("``", ""),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS)
                             + "}")
    for name, module in (("collect", collect), ("train", train), ("eval", evaluate),
                         ("synthetic", synthetic), ("explain", explain), ("vas", vas),
                         ("detector", detector)):
        p = sub.add_parser(name, help=COMMANDS[name], description=module.__doc__.replace("``", ""),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == "collect":
            p.add_argument("--model", required=True, help="a transformers model folder, or a "
                           "hub id in the local Hugging Face cache (no network)")
            p.add_argument("--data", required=True,
                           help="folder with images and one .jsonl file (or the .jsonl file)")
            p.add_argument("--out", required=True, help="the collection's folder (resumed "
                           "when it exists)")
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)  # exits 2 on bad usage
    prog = " ".join(["headscope", args.command] + ([args.action] if "action" in args else []))
    try:
        return reported(prog, lambda: args.run(args))
    except Exception as e:  # noqa: BLE001 - reported with its traceback, exit 1
        traceback.print_exc()
        print(f"{prog}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return FAILURE
    finally:
        leave_process_group()
