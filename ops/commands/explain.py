"""``python -m headscope explain``: which parts of your pictures (and which moments and
places of your videos) each sentence of a VLM's answer rests on, shown as the answer is
generated.

    python -m headscope explain --model MODEL --image photo.jpg --prompt "Describe it."
    python -m headscope explain --model MODEL --video clip.mp4 --prompt "What happens?"

Videos are decoded as the model's video processor decodes a file (torchcodec) and its
frames sampled as it samples them (``headscope.videos``).

Each span (sentence) is printed as it is generated, with its best-scored regions; then
DIR/index.html (one self-contained page: open it from disk), DIR/report.json (every
number) and DIR/span{j}.png are written. Scores (--scores): with --head, the head's
predicted effect of ablating each region; without, the gradient norm computed as each span
ends, or raw attention, raw value-norm-weighted attention or AttnLRP. The page paints each
region's score per image token. --serve shows the answer and each span's
heat map on a live page while the model generates (needs `pip install "headscope[app]"`).
"""
from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path
from typing import List

from ..explainer.scorers import DEFAULT_SCORER, SCORERS
from ..pictures import PictureError, check_picture, read_picture
from ..videos import VideoError, check_video, read_video
from .errors import UsageError, check_output, integer, number, refuse_ignored
from .models import add_model_arguments

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
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="a picture (give --image again for more, in prompt order)")
    parser.add_argument("--video", action="append", default=[], metavar="PATH",
                        help="a video file, its frames sampled as the model's video processor "
                             "samples them (give --video again for more; the prompt holds the "
                             "pictures, then the videos); at least one --image or --video")
    parser.add_argument("--prompt", required=True, metavar="TEXT",
                        help="the question; the processor's chat template places the pictures "
                             "and videos")
    parser.add_argument("--scores", choices=tuple(SCORERS), default=None,
                        help="what scores each region: raw attention, raw value-norm-weighted "
                             "attention, AttnLRP or the gradient norm (both computed as each "
                             "span ends), or the head of --head (default: head with --head, "
                             f"else {DEFAULT_SCORER})")
    parser.add_argument("--head", default=None, metavar="FILE",
                        help="an attribution head for this model (`python -m headscope train`): "
                             "scores are its predicted effects")
    parser.add_argument("--detector", default=None, metavar="FILE",
                        help="a headscope.VASDetector (safetensors): the answer's "
                             "hallucination probability")
    parser.add_argument("--regions", type=regions_type, default=None, metavar="3x3|K",
                        help="ROWSxCOLS blocks of each picture and of each video's frame "
                             "groups, or K Ward regions of its image tokens (of a video's over "
                             "space and time) (default 3x3; 9 Ward regions for a model traced "
                             "by its structure, whose pictures have no known layout)")
    parser.add_argument("--frames", type=integer(1), default=None, metavar="N",
                        help="with ROWSxCOLS regions and --video: blocks over windows of N "
                             "sampled frames, a multiple of the frames the model merges into "
                             "one token (default: each frame group)")
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
    add_model_arguments(parser)
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


def check_video_file(path: str) -> None:
    """UsageError unless ``path`` opens as a video with frames and a frame rate."""
    try:
        check_video(path)
    except VideoError as e:
        raise UsageError(f"--video {e}") from e


def read_videos(paths: List[str], processor, model: str) -> List:
    """The --video files, their frames sampled as ``processor``'s video processor samples
    them; UsageError for a processor without one, or a file that does not decode."""
    if not paths:
        return []
    if getattr(processor, "video_processor", None) is None:
        raise UsageError(f"--video {paths[0]}: the processor of {model} "
                         f"({type(processor).__name__}) has no video processor, so the model "
                         f"takes no video; allowed: --image only")
    try:
        return [read_video(path, processor.video_processor) for path in paths]
    except VideoError as e:
        raise UsageError(f"--video {e}") from e


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
    if not args.image and not args.video:
        raise UsageError("no --image and no --video: allowed: at least one picture or video")
    if args.frames is not None and not args.video:
        raise UsageError(f"--frames {args.frames}: has no effect without --video")
    if not args.do_sample:
        refuse_ignored(args, SAMPLING, "without --do-sample (decoding is greedy)")
    if args.top_p is not None and args.top_p > 1:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.serve is None:
        refuse_ignored(args, ["host"], "without --serve")
    if args.scores == "head" and args.head is None:
        raise UsageError("--scores head: needs --head FILE (an attribution head fitted for "
                         "this model by `python -m headscope train`)")
    if args.head is not None and args.scores not in (None, "head"):
        raise UsageError(f"--head {args.head}: has no effect with --scores {args.scores}; "
                         f"allowed: leave --scores out (or --scores head), or leave --head out")
    for path in args.image:
        check_image(path)
    for path in args.video:
        check_video_file(path)
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


def check_media(args, pictures: List, videos: List, processor, config, family) -> None:
    """The processor gives one picture per --image and one video per --video, each with
    enough tokens for the regions asked for (a video: per frame group, or over space and
    time for Ward regions)."""
    from ..explainer import media_mismatch, prompt_inputs
    if args.frames is not None and "x" not in args.regions:
        raise UsageError(f"--frames {args.frames}: windows of frames need ROWSxCOLS regions; "
                         f"Ward regions (--regions {args.regions}) cluster over space and "
                         f"time by themselves")
    try:
        inputs = prompt_inputs(processor, pictures, args.prompt, videos)
        found = family.images(config, inputs)[0]
        found_videos = family.videos(config, inputs)[0] if videos else []
    except ValueError as e:
        raise UsageError(f"--model {args.model}: {e}") from e
    except NotImplementedError as e:
        raise UsageError(f"--video {args.video[0]}: headscope does not read the video tokens "
                         f"of model type {config.model_type!r} yet; allowed: --image only") from e
    mismatch = media_mismatch(len(found), len(found_videos), len(pictures), len(videos))
    if mismatch:
        raise UsageError(f"--model {args.model}: {mismatch}; allowed: a VLM whose chat "
                         f"template places every --image and --video")
    for path, image in zip(args.image, found):
        check_regions(args.regions, (image.rows, image.cols), "image", path)
    for path, video in zip(args.video, found_videos):
        check_regions(args.regions, video.grid, "video", path)
        merged = video.frames_per_group
        if args.frames is not None and args.frames % merged:
            raise UsageError(f"--frames {args.frames}: the model merges {merged} frames into "
                             f"each video token of {path}; allowed: a multiple of {merged}")


def check_regions(regions: str, grid: tuple, kind: str, path: str) -> None:
    """UsageError when grid ``regions`` have more blocks than a picture's (or a video frame
    group's) ``rows x cols`` tokens, or K Ward regions more than its tokens; ``grid``:
    ``(rows, cols)``, a video's ``(groups, rows, cols)``."""
    from ..hf.regions import parse_grid
    rows, cols = grid[-2:]
    video = len(grid) == 3
    if "x" in regions:
        R, C = parse_grid(regions)
        if R > rows or C > cols:
            where = "each frame group of " if video else ""
            raise UsageError(f"--regions {regions}: more blocks than the {rows}x{cols} {kind} "
                             f"tokens of {where}{path}; allowed: at most {rows}x{cols}")
        return
    tokens = rows * cols * (grid[0] if video else 1)
    shape = f"{grid[0]} frame groups of {rows}x{cols}" if video else f"{rows}x{cols}"
    if int(regions) > tokens:
        raise UsageError(f"--regions {regions}: more regions than the {shape} {kind} tokens "
                         f"of {path}; allowed: 1 to {tokens}")


def span_line(span) -> str:
    """One span on the terminal: its number, text and best regions with their scores."""
    if span.special:
        return f"[{span.index}] (special tokens only: {len(span.token_ids)})"
    top = "  ".join(f"region {k} {v:.4g}/token ({float(span.scores[k]):.4g})"
                    for k, v in span.top_regions(3))
    return f"[{span.index}] {span.text.strip()}\n      {top}"


def summary(explanation, seconds: float) -> str:
    e = explanation
    tokens = sum(s.end - s.start for s in e.spans)
    shown = [s for s in e.spans if not s.special]
    lines = [f"{len(e.spans)} spans ({len(e.spans) - len(shown)} of special tokens only), "
             f"{tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s)"]
    if shown:
        best = max(shown, key=lambda s: s.top_regions(1)[0][1])
        k, v = best.top_regions(1)[0]
        lines.append(f"hottest: span {best.index}, region {k} ({e.score_name} {v:.4g} per "
                     f"image token)")
    if e.hallucination is not None:
        lines.append(f"hallucination probability (VAS detector): {e.hallucination:.3f}")
    return "\n".join(lines)


def run(args) -> int:
    from ..explainer import iter_explain
    from ..explainer.scorers import SCORE_HELP, posthoc_unsupported, runnable_scorer
    from .models import (device, load_config, load_model, load_processor, model_folder,
                         text_sizes)
    check_arguments(args)
    name, args.model = args.model, str(model_folder(args.model))
    config = load_config(args.model)
    family = supported_family(args, config)
    choose_regions(args, config, family)
    processor = load_processor(args.model)
    pictures = read_images(args.image)
    videos = read_videos(args.video, processor, args.model)
    check_media(args, pictures, videos, processor, config, family)
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
    model, processor = load_model(args.model, args.dtype, device(args), args.quantize)
    # the page and report say which weights gave the answer
    shown = name if args.quantize is None else f"{name} ({args.quantize} weights)"

    if args.scores is not None:
        unsupported = posthoc_unsupported(args.scores, model)
        if unsupported:
            allowed = [s for s in SCORERS
                       if s != "head" and posthoc_unsupported(s, model) is None]
            raise UsageError(f"--scores {args.scores}: {unsupported}; allowed: --scores "
                             f"{', '.join(allowed)}")
    # the default without a head falls back to raw attention, with a warning, on a model
    # that passes no gradient (the scorer is chosen once, here, for the terminal and page)
    scorer = runnable_scorer(args.scores, head, model)

    def explanations():
        return iter_explain(model, processor, pictures, args.prompt, head, videos=videos,
                            scores=scorer, regions=args.regions, frames=args.frames,
                            detector=detector,
                            max_new_tokens=args.max_new_tokens, model_name=shown,
                            **generate_kwargs)
    if args.serve is not None:
        from ..explainer.live import serve
        return serve(explanations, args.host, args.serve, Path(args.out))
    print(f"scores: {SCORERS[scorer]} ({SCORE_HELP[scorer]}); regions: {args.regions}; "
          f"each span's hottest regions: score per image token (the region's total)",
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
