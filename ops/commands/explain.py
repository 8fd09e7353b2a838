"""``python -m headscope explain``: which parts of your pictures each sentence of a VLM's
answer rests on, shown as the answer is generated.

    python -m headscope explain --model MODEL --image photo.jpg --prompt "Describe it."

Each span (sentence) is printed as it is generated, with its best-scored regions; then
DIR/index.html (one self-contained page: open it from disk), DIR/report.json (every
number) and DIR/span{j}.png are written. Scores: with --head, the head's predicted effect
of ablating each region; without, raw attention (each region's attention mass from the
span, mean over the decoder's layers and heads). --serve shows the answer and each span's
heat map on a live page while the model generates (needs `pip install "headscope[app]"`).
"""
from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path
from typing import List

from ..pictures import PictureError, check_picture, read_picture
from .errors import UsageError, check_output, integer, number, refuse_ignored

SAMPLING = ("temperature", "top_p", "top_k", "seed")
DEFAULT_PORT = 7860


def regions_type(text: str) -> str:
    """An argparse type: ``ROWSxCOLS`` (a grid of blocks on each picture) or K >= 1 (Ward
    regions)."""
    from ..hf.regions import parse_grid
    if text.strip().lstrip("-").isdigit():
        return str(integer(1)(text))
    try:
        return "{}x{}".format(*parse_grid(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be ROWSxCOLS (e.g. 3x3) or a number K >= 1 of "
                                         f"Ward regions, got {text!r}") from e


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a transformers VLM folder, or a hub "
                        "id in the local Hugging Face cache (no network)")
    parser.add_argument("--image", action="append", required=True, metavar="PATH",
                        help="a picture (give --image again for more, in prompt order)")
    parser.add_argument("--prompt", required=True, metavar="TEXT",
                        help="the question; the processor's chat template places the pictures")
    parser.add_argument("--head", default=None, metavar="FILE",
                        help="an attribution head for this model (`python -m headscope train`): "
                             "scores are its predicted effects (default: raw attention)")
    parser.add_argument("--detector", default=None, metavar="FILE",
                        help="a headscope.VASDetector (safetensors): the answer's "
                             "hallucination probability")
    parser.add_argument("--regions", type=regions_type, default=None, metavar="3x3|K",
                        help="ROWSxCOLS blocks of each picture, or K Ward regions of its "
                             "image tokens (default 3x3; 9 Ward regions for a model traced "
                             "by its structure, whose pictures have no known layout)")
    parser.add_argument("--max-new-tokens", type=integer(1), default=64, metavar="N",
                        help="tokens to generate at most (default 64)")
    parser.add_argument("--out", default="explain", metavar="DIR",
                        help="folder for index.html, report.json and the PNGs (default explain)")
    parser.add_argument("--serve", nargs="?", type=integer(1, 65535), const=DEFAULT_PORT,
                        default=None, metavar="PORT",
                        help=f"also show a live page on http://127.0.0.1:PORT while generating "
                             f"(default port {DEFAULT_PORT}; needs headscope[app]; Ctrl-C stops)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address --serve binds (default 127.0.0.1, this machine only)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        default="float32", help="model dtype (default float32)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N (default: the GPU if any, else cpu)")
    parser.add_argument("--do-sample", action="store_true",
                        help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=number(0, above=True), default=None,
                        help="sampling temperature (with --do-sample)")
    parser.add_argument("--top-p", type=number(0, above=True), default=None,
                        help="nucleus sampling mass, in (0, 1] (with --do-sample)")
    parser.add_argument("--top-k", type=integer(1), default=None,
                        help="sample from the K likeliest tokens (with --do-sample)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling (with --do-sample)")


def check_image(path: str) -> None:
    """UsageError unless ``path`` is a picture headscope reads (``headscope.pictures``)."""
    try:
        check_picture(path)
    except PictureError as e:
        raise UsageError(f"--image {e.path}: {e.reason}") from e


def read_images(paths: List[str]) -> List:
    """The --image pictures as they are seen, upright in RGB; UsageError for one whose
    pixels do not decode."""
    try:
        return [read_picture(path) for path in paths]
    except PictureError as e:
        raise UsageError(f"--image {e.path}: {e.reason}") from e


def check_port(host: str, port: int) -> None:
    """UsageError when ``host:port`` cannot be bound (in use, or not this machine's)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"--serve {port}: cannot listen on {host}:{port}: {e.strerror}; "
                             f"allowed: a free port") from e


def check_arguments(args) -> None:
    """Everything that needs no model: options, files, the output folder, the port."""
    if not args.prompt.strip():
        raise UsageError("--prompt: is empty; allowed: the question to ask about the pictures")
    if not args.do_sample:
        refuse_ignored(args, SAMPLING, "without --do-sample (decoding is greedy)")
    if args.top_p is not None and args.top_p > 1:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.serve is None:
        refuse_ignored(args, ["host"], "without --serve")
    for path in args.image:
        check_image(path)
    for name in ("head", "detector"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_file():
            raise UsageError(f"--{name} {path}: no such file")
    check_output(args.out, "--out", folder=True)
    if args.serve is not None:
        check_port(args.host, args.serve)
        import importlib.util
        if importlib.util.find_spec("gradio") is None:
            raise UsageError(f"--serve {args.serve}: needs gradio; allowed: install it with "
                             f"pip install \"headscope[app]\", or leave --serve out")


def load_head(path: str, num_layers: int, num_heads: int):
    from ..head import AttributionHead
    try:
        return AttributionHead.load(path, num_layers=num_layers, num_heads=num_heads)
    except (ValueError, OSError, KeyError) as e:
        raise UsageError(f"--head {path}: {e}") from e


def load_detector(path: str):
    from ..detector import VASDetector
    try:
        return VASDetector.load(path)
    except (ValueError, OSError, KeyError) as e:
        raise UsageError(f"--detector {path}: {e}") from e


def supported_family(args, config):
    """The model's family; a UsageError naming its model type when it is none."""
    from ..hf.families import family_of
    try:
        return family_of(config, "headscope explain")
    except ValueError as e:
        raise UsageError(f"--model {args.model}: {e}") from e


def choose_regions(args, config, family) -> None:
    """``args.regions``: the default where none was given; a grid needs the picture's
    layout, which a model traced by its structure does not have."""
    if args.regions is None:
        args.regions = "3x3" if family.has_layout else "9"
    elif "x" in args.regions and not family.has_layout:
        raise UsageError(f"--regions {args.regions}: no picture layout is known for model type "
                         f"{config.model_type!r} (traced by its structure, each picture a run "
                         f"of image tokens); allowed: K Ward regions, such as --regions 9")


def check_pictures(args, pictures: List, processor, config, family) -> None:
    """The processor gives one picture per --image, each with enough image tokens for the
    regions asked for."""
    from ..explainer import prompt_inputs
    from ..hf.regions import parse_grid
    try:
        found = family.images(config, prompt_inputs(processor, pictures, args.prompt))[0]
    except ValueError as e:
        raise UsageError(f"--model {args.model}: {e}") from e
    if len(found) != len(pictures):
        raise UsageError(f"--model {args.model}: its processor gives {len(found)} pictures for "
                         f"{len(pictures)} --image; allowed: a VLM whose chat template places "
                         f"every picture")
    for path, image in zip(args.image, found):
        rows, cols = image.rows, image.cols
        if "x" in args.regions:
            R, C = parse_grid(args.regions)
            if R > rows or C > cols:
                raise UsageError(f"--regions {args.regions}: more blocks than the {rows}x{cols} "
                                 f"image tokens of {path}; allowed: at most {rows}x{cols}")
        elif int(args.regions) > rows * cols:
            raise UsageError(f"--regions {args.regions}: more regions than the {rows}x{cols} "
                             f"image tokens of {path}; allowed: 1 to {rows * cols}")


def span_line(span) -> str:
    """One span on the terminal: its number, text and best regions with their scores."""
    if span.special:
        return f"[{span.index}] (special tokens only: {len(span.token_ids)})"
    top = "  ".join(f"region {k} {v:.4f}" for k, v in span.top_regions(3))
    return f"[{span.index}] {span.text.strip()}\n      {top}"


def summary(explanation, seconds: float) -> str:
    e = explanation
    tokens = sum(s.end - s.start for s in e.spans)
    shown = [s for s in e.spans if not s.special]
    lines = [f"{len(e.spans)} spans ({len(e.spans) - len(shown)} of special tokens only), "
             f"{tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s)"]
    if shown:
        best = max(shown, key=lambda s: float(s.scores.max()))
        k, v = best.top_regions(1)[0]
        lines.append(f"strongest: span {best.index}, region {k} ({e.score_name} {v:.4f})")
    if e.hallucination is not None:
        lines.append(f"hallucination probability (VAS detector): {e.hallucination:.3f}")
    return "\n".join(lines)


def run(args) -> int:
    from ..explainer import HEAD_EFFECT, RAW_ATTENTION, iter_explain
    from ..explainer.page import SCORE_HELP
    from .models import (device, load_config, load_model, load_processor, model_folder,
                         text_sizes)
    check_arguments(args)
    name, args.model = args.model, str(model_folder(args.model))
    config = load_config(args.model)
    family = supported_family(args, config)
    choose_regions(args, config, family)
    processor = load_processor(args.model)
    pictures = read_images(args.image)
    check_pictures(args, pictures, processor, config, family)
    L, H = text_sizes(config)
    head = None if args.head is None else load_head(args.head, L, H)
    detector = None if args.detector is None else load_detector(args.detector)
    generate_kwargs = {"do_sample": args.do_sample}
    if args.do_sample:
        generate_kwargs.update({k: getattr(args, k) for k in ("temperature", "top_p", "top_k")
                                if getattr(args, k) is not None})
        if args.seed is not None:
            import torch
            torch.manual_seed(args.seed)
    model, processor = load_model(args.model, args.dtype, device(args))

    def explanations():
        return iter_explain(model, processor, pictures, args.prompt, head,
                            regions=args.regions, detector=detector,
                            max_new_tokens=args.max_new_tokens, model_name=name,
                            **generate_kwargs)
    if args.serve is not None:
        from ..explainer.live import serve
        return serve(explanations, args.host, args.serve, Path(args.out))
    score_name = HEAD_EFFECT if head is not None else RAW_ATTENTION
    print(f"scores: {score_name} ({SCORE_HELP[score_name]}); regions: {args.regions}",
          flush=True)
    start, printed, result = time.perf_counter(), 0, None
    for result in explanations():
        for span in result.spans[printed:]:
            print(span_line(span), flush=True)
        printed = len(result.spans)
    seconds = time.perf_counter() - start
    page = result.save(args.out)
    print(summary(result, seconds))
    print(f"wrote {page}, report.json and {sum(not s.special for s in result.spans)} PNGs; "
          f"open the page in a browser")
    return 0
