"""python -m headscope.shapes {train,demo,screenshot,accuracy,latency,data,answers,
hallucination,faithfulness,head-eval,clip-head,clip-eval,scorer-cost,heat-check,
heat-default,mixer,reproduce}: the embedded shapes models.

  train     train the model from scratch into a folder (resumable: rerun the same command);
            --world clips trains the video model
  demo      describe held-out scenes while streaming span attributions; PNGs, JSON, HTML
  screenshot  the explain page of a held-out scene in headless Chromium, as a PNG (the
            picture of docs/explain.md)
  accuracy  caption accuracy of a model on held-out scenes (--video: the video model on
            held-out clips)
  latency   per-token time of generation with streaming attribution against plain generate
  data      write scenes as a DATA folder for python -m headscope collect|eval
  answers   the model's answers to held-out scenes, labelled hallucinated or not, as a
            DATA folder for python -m headscope vas
  hallucination  AUROC of VASDetector and of the mean token log-probability on hard scenes
  faithfulness   LDS and R^2 against time per token: head, raw attention, gradients, ablation
  head-eval      the head against raw attention (and value-norm-weighted attention) on a
                 fixed seed range: per-image LDS with the paired difference's interval,
                 pointing
  clip-head      fit the video model's attribution head on training-stream clips
  clip-eval      the video head against raw attention, AttnLRP and the gradient norm on
                 held-out clips over space-time regions: LDS, deletion and insertion,
                 pointing in space and in time
  scorer-cost    what each scorer of headscope.explain costs per answer and per span
  heat-check     does the page paint the named object hotter than the rest of the picture,
                 without a head and with the shipped head
  heat-default   which scorer without a head takes the best deletion and insertion over
                 the layouts of head-eval runs (their --cache folders)
  mixer          the model with mixer vision attention against the softmax one: caption
                 accuracy with intervals, and the projection's iterations against time
  reproduce      every measurement above in one resumable run (results.json, results.md)

--model takes a model folder, or "mixer" for the shipped model with mixer vision attention.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


HEAD_FREE = ("attention", "attention*value_norm", "attnlrp", "gradient")  # explain's scorers
SIZES = ("steps", "batch", "seed", "hidden", "layers", "heads", "kv_heads", "intermediate",
         "vision_width", "vision_depth", "vision_mlp_ratio", "warmup", "max_objects", "mixer_rank")
PROG = "python -m headscope.shapes"
VIDEO_TOKENS = 144  # a clip's: 4 frame groups of 6 x 6 tokens


def _model_folder(text: str) -> Path:
    """An argparse type: a folder holding a shapes model (its config.json), or ``mixer``
    for the shipped model with mixer vision attention."""
    if text == "mixer":
        from .model import MIXER_DIR
        text = str(MIXER_DIR)
    if not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"must be a model folder (with config.json, as `{PROG} train --out` writes), "
            f"got {text!r}")
    return Path(text)


def _object_range(text: str) -> tuple:
    """An argparse type: ``LO-HI`` objects per scene, 1 <= LO <= HI <= 9."""
    from .world import MAX_OBJECTS
    try:
        lo, hi = (int(n) for n in text.split("-"))
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi <= MAX_OBJECTS:
        raise argparse.ArgumentTypeError(f"must be LO-HI with 1 <= LO <= HI <= "
                                         f"{MAX_OBJECTS} (e.g. 5-9), got {text!r}")
    return lo, hi


def _init_folder(text: str) -> str:
    """An argparse type: a model folder to start training from, or ``shapes`` (the shipped
    picture model)."""
    from .train import SHIPPED_INIT
    return text if text == SHIPPED_INIT else str(_model_folder(text))


def _head_file(text: str) -> Path:
    """An argparse type: an attribution head file (as `python -m headscope train` writes)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"must be a head file (head.safetensors, as `python "
                                         f"-m headscope train --out` writes), got {text!r}")
    return Path(text)


def main(argv=None) -> int:
    from ..commands.errors import (Parser, UsageError, check_output, grid, integer, number,
                                   reported)
    from ..features import FEATURE_SETS
    from ..explainer.scorers import SCORERS
    from .head_eval import SEED_RANGES
    from .clips import MAX_CLIP_OBJECTS
    from .processor import TOKEN_GRID
    parser = Parser(prog=PROG, description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=integer(1), default=None,
                        help="torch intra-op threads")
    sub = parser.add_subparsers(dest="command", required=True)
    count = integer(1)
    model = dict(type=_model_folder, default=None,
                 help="model folder, or 'mixer' (default: the one shipped with headscope)")
    image_tokens = f" (the images' {TOKEN_GRID}x{TOKEN_GRID} tokens)"

    from .train import SHIPPED_INIT, WORLDS, Settings
    defaults = Settings()
    p = sub.add_parser("train", help="train the shapes model from scratch")
    p.add_argument("--out", type=Path, required=True,
                   help="folder for the checkpoint and the trained model (from_pretrained)")
    for name in SIZES:
        kind = int if name == "seed" else integer(0 if name in ("warmup", "mixer_rank") else 1)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind,
                       default=None if name == "max_objects" else getattr(defaults, name))
    p.add_argument("--lr", type=number(0, above=True), default=defaults.lr)
    p.add_argument("--world", choices=sorted(WORLDS), default=defaults.world,
                   help="train on pictures (the shapes model) or clips (the video model)")
    p.add_argument("--init", type=_init_folder, default=None, metavar="FOLDER",
                   help=f"start from the weights of this model folder ('{SHIPPED_INIT}': the "
                        f"shipped picture model) instead of random ones")
    p.add_argument("--eval-scenes", type=count, default=200,
                   help="held-out scenes for the caption accuracy at the end")
    p.add_argument("--finish-at", type=count, default=None, metavar="STEP",
                   help="end the run at STEP of its --steps schedule and save it as done")
    p.add_argument("--stop-after", type=count, default=None, metavar="N",
                   help="leave after N steps of this call, with the checkpoint saved")
    p.add_argument("--checkpoint-every", type=count, default=100,
                   help="steps between checkpoints (and entries of the loss log)")

    region_parsers = {}  # the commands whose --regions is bounded by --video
    p = region_parsers["demo"] = sub.add_parser(
        "demo", help="describe held-out scenes (or clips) with span attributions")
    p.add_argument("--out", type=Path, default=Path("shapes-demo"), help="output folder")
    p.add_argument("--images", type=count, default=3, help="held-out scenes (default 3)")
    p.add_argument("--video", action="store_true",
                   help="the video model on held-out clips, each written as an MP4 file and "
                        "explained as `python -m headscope explain --video` explains one")
    p.add_argument("--clips", type=count, default=None,
                   help="with --video: held-out clips (default 3)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--grid", type=grid(TOKEN_GRID, TOKEN_GRID, image_tokens), default=None,
                       metavar="ROWSxCOLS",
                       help="regions: a grid of blocks of the image (default 3x3, the world's "
                            "cells; with --video in each quarter of the clip, at most 6x6)")
    which.add_argument("--regions", default=None, metavar="K",
                       help=f"regions: K Ward regions of the image instead of a grid (at most "
                            f"{TOKEN_GRID ** 2}; with --video over space and time, at most "
                            f"{VIDEO_TOKENS})")
    p.add_argument("--model", type=_model_folder, default=None,
                   help="model folder, or 'mixer' (default: the one shipped with headscope; "
                        "with --video, the shipped video model)")

    p = region_parsers["screenshot"] = sub.add_parser(
        "screenshot", help="the explain page of a held-out scene as a PNG")
    p.add_argument("--png", type=Path, required=True, help="the PNG file to write")
    p.add_argument("--video", action="store_true",
                   help="the page of a held-out clip explained by the video model")
    p.add_argument("--regions", default=None, metavar="K",
                   help=f"K Ward regions (default: the world's 3 x 3 cells; at most "
                        f"{TOKEN_GRID ** 2}, with --video {VIDEO_TOKENS} over space and time)")
    p.add_argument("--scores", choices=tuple(SCORERS), default=None,
                   help="the scorer (default: the shipped head)")

    p = sub.add_parser("accuracy", help="caption accuracy on held-out scenes (or clips)")
    p.add_argument("--model", type=_model_folder, default=None,
                   help="model folder, or 'mixer' (default: the one shipped with headscope; "
                        "with --video, the shipped video model)")
    p.add_argument("--video", action="store_true",
                   help="the video model on held-out clips (seeds from 1010000000)")
    p.add_argument("--scenes", type=count, default=None,
                   help="held-out scenes (default 200), or clips (default 300)")
    p.add_argument("--objects", type=_object_range, default=None, metavar="LO-HI",
                   help="objects per scene, cycling from LO to HI (default 1-4; clips: 1-3)")

    p = sub.add_parser("latency", help="per-token latency with streaming attribution")
    p.add_argument("--model", **model)
    p.add_argument("--rounds", type=count, default=7)
    p.add_argument("--tokens", type=count, default=40)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")

    p = sub.add_parser("data", help="scenes as a DATA folder (images + data.jsonl)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--first-seed", type=int, required=True,
                   help="scene seeds first-seed .. first-seed + count - 1 (held out: >= "
                        "1000000000)")
    p.add_argument("--count", type=count, required=True)
    p.add_argument("--noise", type=float, default=None, help="background noise (default: "
                   "drawn per scene)")

    p = sub.add_parser("answers", help="labelled answers to held-out scenes as a DATA "
                                       "folder for python -m headscope vas")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=count, required=True)
    p.add_argument("--start", type=integer(0), default=0,
                   help="first scene: seeds 1002000000 + start .. (the hallucination "
                        "measurement's scenes; default 0)")
    p.add_argument("--objects", type=_object_range, default=(1, 4), metavar="LO-HI",
                   help="objects per scene, cycling from LO to HI (default 1-4; 5-9: the "
                        "hard scenes)")
    p.add_argument("--model", **model)

    p = sub.add_parser("hallucination", help="hallucination detection from VAS (AUROC)")
    p.add_argument("--model", **model)
    p.add_argument("--fit", type=count, default=1000, help="answers to fit the detector on")
    p.add_argument("--test", type=count, default=1000, help="answers to measure AUROC on")
    p.add_argument("--objects", type=_object_range, default=(1, 4), metavar="LO-HI",
                   help="objects per scene, cycling from LO to HI (default 1-4; 5-9: the "
                        "hard scenes)")

    p = sub.add_parser("faithfulness", help="faithfulness against time per token (figure)")
    p.add_argument("--out", type=Path, required=True,
                   help="folder for faithfulness.png, .md and .json")
    p.add_argument("--model", **model)
    p.add_argument("--scenes", type=count, default=40, help="held-out scenes (default 40)")
    p.add_argument("--regions", type=integer(1, TOKEN_GRID ** 2, image_tokens), default=8,
                   help="Ward regions per image")
    p.add_argument("--rounds", type=count, default=7, help="latency rounds")
    p.add_argument("--tokens", type=count, default=40, help="tokens per latency round")

    p = sub.add_parser("head-eval", help="the head against raw attention, with intervals")
    p.add_argument("--seeds", choices=sorted(SEED_RANGES), default="dev",
                   help="seed range: dev (for choosing settings), reported (for the "
                        "reported numbers only), or one registered since (docs/shapes.md)")
    p.add_argument("--scenes", type=count, default=300)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--grid", type=grid(TOKEN_GRID, TOKEN_GRID, image_tokens),
                       default="3x3", metavar="ROWSxCOLS",
                       help="regions: a grid (default 3x3, the world's cells)")
    which.add_argument("--regions", type=integer(1, TOKEN_GRID ** 2, image_tokens),
                       default=None, metavar="K",
                       help="regions: K Ward regions of the image instead of a grid")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help="keep each scene's record in DIR as it is measured; a rerun with the "
                        "same settings resumes there")
    p.add_argument("--model", **model)
    p.add_argument("--head", type=_head_file, action="append", default=None,
                   help="head file (default: the model folder's head.safetensors); given "
                        "several times, the heads are compared on the same spans, each "
                        "labelled head:NAME by its file's name")
    p.add_argument("--features", choices=FEATURE_SETS, default=None,
                   help="the feature set to trace (default: the heads' own; 'both' for "
                        "heads of different sets): each of its blocks is scored as a raw "
                        "baseline, and it must hold every head's blocks")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")

    from .clip_eval import HEAD_CLIPS
    quarter_tokens = " (a quarter's 6x6 video tokens)"
    p = sub.add_parser("clip-head", help="fit the video model's head on training clips")
    p.add_argument("--out", type=Path, required=True, help="the head's file (.safetensors)")
    p.add_argument("--clips", type=count, default=HEAD_CLIPS,
                   help=f"training-stream clips per layout (default {HEAD_CLIPS})")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help="keep each clip's spans in DIR (one folder per layout); a rerun "
                        "resumes there")
    p.add_argument("--model", type=_model_folder, default=None,
                   help="video model folder (default: the shipped video model)")

    p = sub.add_parser("clip-eval", help="the video head against the baselines on clips")
    p.add_argument("--seeds", choices=("dev", "reported"), default="dev",
                   help="clip seed range: dev (for choosing settings) or reported (for the "
                        "reported numbers only)")
    p.add_argument("--clips", type=count, default=150,
                   help="the first clips of the range (default 150)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--grid", type=grid(6, 6, quarter_tokens), default=None,
                       metavar="ROWSxCOLS",
                       help="regions: a grid in each quarter (default: the world's 3 x 3 "
                            "cells in each quarter, 36 regions)")
    which.add_argument("--regions", type=integer(1, VIDEO_TOKENS, " (a clip's video tokens)"),
                       default=None,
                       metavar="K", help="regions: K Ward regions over space and time")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help="keep each clip's record in DIR as it is measured; a rerun with the "
                        "same settings resumes there")
    p.add_argument("--model", type=_model_folder, default=None,
                   help="video model folder (default: the shipped video model)")
    p.add_argument("--head", type=_head_file, action="append", default=None,
                   help="head file (default: the model folder's head.safetensors); several "
                        "are compared on the same spans")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")

    p = sub.add_parser("scorer-cost", help="what each scorer of headscope.explain costs")
    p.add_argument("--model", **model)
    p.add_argument("--rounds", type=count, default=9)
    p.add_argument("--regions", type=integer(1, TOKEN_GRID ** 2, image_tokens), default=8,
                   help="Ward regions per image")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")

    p = sub.add_parser("heat-check", help="the page paints the named object hotter than the "
                                          "rest: without a head and with the shipped head")
    p.add_argument("--seeds", choices=sorted(SEED_RANGES), default="dev")
    p.add_argument("--scenes", type=count, default=300)
    p.add_argument("--regions", type=integer(1, TOKEN_GRID ** 2, image_tokens), default=8,
                   help="Ward regions per image (default 8)")
    p.add_argument("--model", **model)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")

    p = sub.add_parser("heat-default", help="the best scorer without a head on deletion and "
                                            "insertion over head-eval runs' layouts")
    p.add_argument("--cache", type=Path, action="append", required=True, metavar="DIR",
                   help="a head-eval --cache folder, one per layout (give it again)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")

    p = sub.add_parser("mixer", help="mixer against softmax vision attention: accuracy, "
                                     "projection settings against time")
    p.add_argument("--scenes", type=count, default=300,
                   help="held-out scenes per object range (1-4 and 5-9)")
    p.add_argument("--sweep-scenes", type=count, default=100,
                   help="scenes of 1-4 objects per projection setting")
    p.add_argument("--rounds", type=count, default=5, help="timing rounds")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")

    p = sub.add_parser("reproduce", help="every measurement of docs/shapes.md, resumable")
    p.add_argument("--out", type=Path, required=True,
                   help="folder for results.json, results.md and each step's files")
    p.add_argument("--model", **model)
    p.add_argument("--quick", action="store_true", help="CI-sized: about a minute")

    args = parser.parse_args(argv)  # exits 2 on a bad argument
    if args.command in ("demo", "screenshot") and args.regions is not None:
        # the bound on --regions depends on --video: checked once both are known
        most, why = (VIDEO_TOKENS, " (a clip's video tokens)") if args.video else \
            (TOKEN_GRID ** 2, image_tokens)
        try:
            args.regions = integer(1, most, why)(args.regions)
        except argparse.ArgumentTypeError as e:
            region_parsers[args.command].error(f"argument --regions: {e}")

    def work() -> int:
        objects = getattr(args, "objects", None)
        if getattr(args, "video", False) and objects and objects[1] > MAX_CLIP_OBJECTS:
            raise UsageError(f"argument --objects: must be LO-HI with 1 <= LO <= HI <= "
                             f"{MAX_CLIP_OBJECTS} for clips, got {args.objects[0]}-"
                             f"{args.objects[1]}")
        for name in ("out", "json", "png"):  # before any work
            if getattr(args, name, None) is not None:
                check_output(getattr(args, name), f"--{name}", folder=name == "out")
        if args.threads is not None:
            import torch
            torch.set_num_threads(args.threads)
        _run(args)
        return 0
    return reported(f"{PROG} {args.command}", work)


def _run(args) -> None:
    from ..commands.errors import UsageError, refuse_ignored
    from ..io import write_json
    if args.command == "train":
        from .train import WORLDS, Settings, train
        if args.max_objects is None:  # the world's own: 9 for pictures, 3 for clips
            args.max_objects = WORLDS[args.world].objects
        settings = Settings(lr=args.lr, world=args.world, init=args.init or "",
                            **{k: getattr(args, k) for k in SIZES})
        try:
            settings.check()
        except ValueError as e:
            raise UsageError(str(e).split(": ", 1)[1]) from None
        report = train(args.out, settings, eval_scenes=args.eval_scenes,
                       checkpoint_every=args.checkpoint_every, finish_at=args.finish_at,
                       stop_after=args.stop_after)
        print(json.dumps(report, indent=2) if report is not None else
              f"stopped with the checkpoint in {args.out}; rerun to resume")
    elif args.command == "demo":
        from ..hf.regions import parse_grid
        regions = args.regions if args.regions is not None else parse_grid(args.grid or "3x3")
        if args.video:
            from .video_demo import run_video_demo
            refuse_ignored(args, ["images"], "with --video (--clips counts the clips)")
            run_video_demo(args.out, args.clips or 3, model_dir=args.model, regions=regions)
        else:
            from .demo import run_demo
            refuse_ignored(args, ["clips"], "without --video")
            run_demo(args.out, args.images, model_dir=args.model, regions=regions)
    elif args.command == "screenshot":
        import tempfile

        from ..explainer.screenshot import browser_missing, screenshot
        from .demo import WORLD_GRID, explain_page
        from .video_demo import video_page
        if browser_missing():
            raise UsageError(browser_missing())
        with tempfile.TemporaryDirectory() as folder:
            page = (video_page if args.video else explain_page)(
                Path(folder), args.regions or WORLD_GRID, args.scores)
            print(screenshot(page, args.png))
    elif args.command == "accuracy":
        from .accuracy import (CLIP_OBJECTS, caption_accuracy, clip_accuracy, held_out_clips,
                               held_out_scenes)
        from .model import VIDEO_DIR, load
        if args.video:
            model, processor, _ = load(args.model or VIDEO_DIR, head=False)
            clips = held_out_clips(args.scenes or 300, objects=args.objects or CLIP_OBJECTS)
            print(json.dumps(clip_accuracy(model, processor, clips)))
        else:
            model, processor, _ = load(args.model, head=False)
            scenes = held_out_scenes(args.scenes or 200, objects=args.objects or (1, 4))
            print(json.dumps(caption_accuracy(model, processor, scenes)))
    elif args.command == "hallucination":
        from .hallucination import measure_hallucination
        print(json.dumps(measure_hallucination(args.fit, args.test, args.model,
                                               objects=args.objects), indent=2))
    elif args.command == "faithfulness":
        from .faithfulness import measure_faithfulness, table
        from .faithfulness_figure import write_faithfulness
        result = measure_faithfulness(args.scenes, regions=args.regions,
                                      latency_rounds=args.rounds, latency_tokens=args.tokens,
                                      model_dir=args.model)
        print(table(result))
        print(json.dumps(write_faithfulness(args.out, result)))
    elif args.command == "head-eval":
        from ..hf.regions import parse_grid
        from .head_eval import evaluate_head, table
        result = evaluate_head(args.seeds, args.scenes,
                               regions=args.regions if args.regions is not None
                               else parse_grid(args.grid),
                               model_dir=args.model, head_path=args.head,
                               features=args.features, cache=args.cache)
        print(table(result))
        if args.json is not None:
            write_json(args.json, result)
    elif args.command == "clip-head":
        from .clip_eval import fit_clip_head
        head = fit_clip_head(args.model, args.clips, cache=args.cache)
        head.save(args.out)
        print(args.out)
    elif args.command == "clip-eval":
        from .clip_eval import CELLS, clip_table, evaluate_clips
        layout = args.regions if args.regions is not None else args.grid or CELLS
        result = evaluate_clips(args.seeds, args.clips, layout=layout, model_dir=args.model,
                                head_path=args.head, cache=args.cache)
        print(clip_table(result))
        if args.json is not None:
            write_json(args.json, result)
    elif args.command == "scorer-cost":
        from .scorer_cost import measure_scorer_cost, table
        result = measure_scorer_cost(args.rounds, args.regions, model_dir=args.model)
        print(table(result))
        if args.json is not None:
            write_json(args.json, result)
    elif args.command == "heat-check":
        from .heat_check import check_pages, table
        result = check_pages(args.seeds, args.scenes, args.regions, model_dir=args.model)
        print(table(result))
        if args.json is not None:
            write_json(args.json, result)
    elif args.command == "heat-default":
        from ..commands.errors import UsageError
        from .head_eval import RAW_NAMES, SETTINGS, SceneCache
        from .heat_eval import across_layouts, across_layouts_table
        layouts = {}
        for folder in args.cache:
            if not (folder / SETTINGS).is_file():
                raise UsageError(f"--cache {folder}: not a head-eval --cache folder (no "
                                 f"{SETTINGS})")
            regions = json.loads((folder / SETTINGS).read_text())["regions"]
            name = f"{regions} Ward regions" if isinstance(regions, int) else regions
            layouts[name] = SceneCache.records(folder)
        result = across_layouts(layouts, HEAD_FREE)
        print(across_layouts_table(result, lambda n: RAW_NAMES.get(n, n)))
        if args.json is not None:
            write_json(args.json, result)
    elif args.command == "mixer":
        from .mixer_eval import compare_models, projection_sweep, table
        result = {"accuracy": compare_models(args.scenes),
                  "sweep": projection_sweep(args.sweep_scenes, rounds=args.rounds)}
        print(table(result["accuracy"], result["sweep"]))
        if args.json is not None:
            write_json(args.json, result)
    elif args.command == "reproduce":
        from .reproduce import reproduce
        reproduce(args.out, quick=args.quick, model_dir=args.model)
    elif args.command == "data":
        from .dataset import write_dataset
        print(write_dataset(args.out, args.first_seed, args.count, args.noise))
    elif args.command == "answers":
        from .dataset import write_answers
        print(write_answers(args.out, args.count, args.start, args.objects, args.model))
    else:
        from .latency import format_latency, measure_latency
        result = measure_latency(args.rounds, args.tokens, args.model)
        format_latency(result)
        if args.json is not None:
            write_json(args.json, result)


if __name__ == "__main__":
    sys.exit(main())
