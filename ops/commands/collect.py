"""``python -m headscope collect``: span features and ground-truth ablation effects over a
data set, for fitting and scoring the attribution head.

For each example: the chat-templated prompt with its image goes through the processor;
``Tracer.generate_with`` generates greedily and cuts the answer into spans (sentence
ends) with their features over K Ward regions of the image; ``region_effects`` measures
the effect of ablating each region, and each of M random sets of K/2 regions, on each
span; with ``--attnlrp``, ``attnlrp_scores`` scores each span's regions too (the post-hoc
baseline ``eval`` reports beside the head). Results go to shards (``collection.py``); a rerun
skips the shards already written. Under ``torchrun`` each process takes every
world-size-th shard.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from ..features import FEATURE_SETS
from .collection import COLLECTION, read_collection, write_shard
from .data import Example, image_size, load_image, read_examples
from .errors import UsageError, check_output, given, grid, integer, refuse_ignored
from .models import (chat_inputs, device, load_config, load_model, load_processor,
                     model_folder, text_sizes)
from .shards import fill_shards
from .torchrun import rank


def add_arguments(parser: argparse.ArgumentParser) -> List[str]:
    """The options of a collection (shared with ``eval``, which collects first); returns
    their destinations."""
    return [a.dest for a in (
        parser.add_argument("--regions", type=integer(1), default=8, metavar="K",
                            help="Ward regions per image (default 8; at most the image's "
                                 "tokens)"),
        parser.add_argument("--grid", type=grid(), default=None, metavar="ROWSxCOLS",
                            help="regions that cut the image's token grid into ROWS x COLS "
                                 "blocks, instead of Ward regions (e.g. 3x3; K = ROWS * COLS; "
                                 "not with --regions)"),
        parser.add_argument("--max-new-tokens", type=integer(1), default=64, metavar="N",
                            help="tokens generated per example, greedily (default 64)"),
        parser.add_argument("--subsets", type=integer(0), default=8, metavar="M",
                            help="random sets of K/2 regions per example whose joint effect "
                                 "is measured, for the subset-level LDS (default 8; 0: none)"),
        parser.add_argument("--ablation", choices=("mask", "mean", "zero"), default="mask",
                            help="how a region is ablated (default mask: its tokens are "
                                 "removed from every query's attention in every layer)"),
        parser.add_argument("--batch-size", type=integer(1), default=8,
                            help="ablations per forward (default 8)"),
        parser.add_argument("--shard-size", type=integer(1), default=8,
                            help="examples per shard file (default 8)"),
        parser.add_argument("--features", choices=FEATURE_SETS, default="attention",
                            help="the span features (default attention: the attention mass "
                                 "on each region, L*H columns; attention*value_norm: each "
                                 "key's weight times its value norm, L*H; both: 2*L*H)"),
        parser.add_argument("--attnlrp", action="store_true",
                            help="also score each span's regions with AttnLRP (the post-hoc "
                                 "baseline eval reports, with its time per span)"),
        parser.add_argument("--seed", type=int, default=0,
                            help="seed of the random region sets"),
        parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                            default="float32", help="model dtype (default float32)"),
        parser.add_argument("--device", default=None,
                            help="cpu, cuda, cuda:N (default: the process's GPU if any, "
                                 "else cpu)"))]


def check_arguments(args) -> None:
    """Options that conflict or would have no effect; sets ``args.regions`` to K."""
    if args.grid is not None:
        if "regions" in given(args):
            raise UsageError(f"--regions {args.regions}: conflicts with --grid {args.grid} "
                             f"(which gives its blocks as regions); give one of them")
        from ..hf.regions import parse_grid
        rows, cols = parse_grid(args.grid)
        args.regions = rows * cols
    if args.subsets and args.regions < 2:
        raise UsageError(f"--subsets {args.subsets}: needs K >= 2 regions (sets of K/2), got "
                         f"K = {args.regions}; allowed with K = 1: --subsets 0")
    if not args.subsets:
        refuse_ignored(args, ["seed"], "with --subsets 0 (it draws the random region sets)")


def check_regions(args, examples: List[Example], config, processor) -> None:
    """The regions asked for fit every image's token grid: K Ward regions at most its
    tokens, a grid at most its rows and columns. Images of one size share a grid, so the
    processor sees one blank image per size."""
    from PIL import Image

    from ..hf.families import family_of
    from ..hf.regions import parse_grid
    sizes: Dict[tuple, Example] = {}
    for example in examples:
        sizes.setdefault(image_size(example), example)
    grids = []
    for size, example in sizes.items():
        inputs = prompt_inputs(processor, example, Image.new("RGB", size), "cpu")
        try:
            found = family_of(config, "headscope collect").images(config, inputs)[0]
        except ValueError as e:
            raise UsageError(f"--model {args.model}: {e}") from e
        if len(found) != 1:
            raise UsageError(f"--model {args.model}: its processor gives {len(found)} images "
                             f"for a prompt of one; allowed: a VLM whose chat template places "
                             f"the image")
        grids.append((found[0].rows, found[0].cols, example))
    if args.grid is None:
        rows, cols, example = min(grids, key=lambda g: g[0] * g[1])
        if args.regions > rows * cols:
            raise UsageError(f"--regions {args.regions}: more regions than the {rows}x{cols} "
                             f"image tokens of {example.image.name} (line {example.line}); "
                             f"allowed: 1 to {rows * cols}")
        return
    R, C = parse_grid(args.grid)
    for rows, cols, example in grids:
        if R > rows or C > cols:
            raise UsageError(f"--grid {args.grid}: more blocks than the {rows}x{cols} image "
                             f"tokens of {example.image.name} (line {example.line}); allowed: "
                             f"at most {min(g[0] for g in grids)}x{min(g[1] for g in grids)}")


def prompt_inputs(processor, example: Example, image, device) -> Dict[str, torch.Tensor]:
    return chat_inputs(processor, example.prompt, [image], device)


def random_subsets(count: int, regions: int, seed: int, line: int) -> torch.Tensor:
    """``count`` random sets of ``regions // 2`` regions, (count, regions) bool, drawn
    from the seed and the example's line (the same in any process)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + line)
    sets = torch.zeros(count, regions, dtype=torch.bool)
    for i in range(count):
        sets[i, torch.randperm(regions, generator=g)[:regions // 2]] = True
    return sets


def collect_example(model, processor, example: Example, args) -> Dict:
    """Generation, span features and ablation effects of one example."""
    from ..hf import Tracer, grid_regions, region_effects
    from ..hf.regions import parse_grid
    image = load_image(example)
    device = next(model.parameters()).device
    inputs = prompt_inputs(processor, example, image, device)
    K = args.regions
    regions = K if args.grid is None else grid_regions(*parse_grid(args.grid))
    spans: List = []
    t0 = time.perf_counter()
    with torch.no_grad(), Tracer(model, regions=regions, vas=False,
                                 tokenizer=processor.tokenizer,
                                 features=args.features) as tracer:
        tracer.generate_with(spans.append, **inputs, max_new_tokens=args.max_new_tokens,
                             do_sample=False)
    t1 = time.perf_counter()
    region_ids = tracer.region_ids
    if tracer.num_regions != [K]:
        raise RuntimeError(f"headscope collect: line {example.line}: expected one image of "
                           f"{K} regions, got regions {tracer.num_regions}")
    subsets = random_subsets(args.subsets, K, args.seed, example.line)
    effects, subset_effects = region_effects(
        model, inputs, tracer.sequences, spans, region_ids, subsets=subsets,
        ablation=args.ablation, batch_size=args.batch_size, progress=False)
    t2 = time.perf_counter()
    (img,) = tracer.images[0]
    posthoc = {}
    if args.attnlrp:
        from ..hf import attnlrp_scores
        scores = attnlrp_scores(model, inputs, tracer.sequences, spans, region_ids)
        posthoc = {"attnlrp": scores.cpu(), "attnlrp_seconds": torch.tensor(
            [time.perf_counter() - t2], dtype=torch.float64)}
    return {**posthoc,"features": torch.stack([s.features for s in spans]),
            "special_only": torch.tensor([s.special for s in spans], dtype=torch.bool),
            "effects": effects.cpu(), "subset_effects": subset_effects.cpu(),
            "span_bounds": torch.tensor([[s.start, s.end] for s in spans]),
            "subsets": subsets, "grid": torch.tensor([img.rows, img.cols]),
            "labels": region_ids[0, img.grid.positions.to(region_ids.device)].cpu(),
            "image_size": torch.tensor(image.size), "seconds": torch.tensor([t1 - t0, t2 - t1],
                                                                            dtype=torch.float64),
            "texts": [s.text for s in spans], "boxes": example.boxes, "line": example.line}


def _shard_tensors(records: List[Dict]) -> Dict[str, torch.Tensor]:
    spans = [r["span_bounds"].shape[0] for r in records]
    return {"line": torch.tensor([r["line"] for r in records], dtype=torch.int64),
            "span_example": torch.repeat_interleave(torch.arange(len(records)),
                                                    torch.tensor(spans)),
            **{k: torch.cat([r[k] for r in records]) for k in
               ("span_bounds", "features", "effects", "subset_effects", "labels",
                "special_only", "attnlrp", "attnlrp_seconds") if k in records[0]},
            **{k: torch.stack([r[k] for r in records]) for k in
               ("subsets", "grid", "image_size", "seconds")}}


def collect(args) -> Tuple[Path, int]:
    """Runs (or resumes) the collection of ``args.data`` into ``args.out``; returns the
    folder and how many examples this run collected (on rank 0: in every process).
    Everything is checked before the folder is created."""
    check_arguments(args)
    check_output(args.out, "--out", folder=True)
    args.model = str(model_folder(args.model))
    examples = read_examples(Path(args.data))
    config = load_config(args.model)
    check_regions(args, examples, config, load_processor(args.model))
    L, H = text_sizes(config)
    out = Path(args.out)

    def start():
        model, processor = load_model(args.model, args.dtype, device(args))
        return lambda i: collect_example(model, processor, examples[i], args)

    def write(shard: int, records: List[Dict]) -> None:
        write_shard(out, shard, _shard_tensors(records),
                    [t for r in records for t in r["texts"]], [r["boxes"] for r in records])

    before = fill_shards(out, COLLECTION, {
        "model": str(Path(args.model).resolve()), "num_layers": L, "num_heads": H,
        "feature_set": args.features, "data": str(Path(args.data).resolve()),
        "regions": args.regions, "grid": args.grid, "max_new_tokens": args.max_new_tokens,
        "subsets": args.subsets, "ablation": args.ablation, "seed": args.seed,
        "attnlrp": args.attnlrp, "dtype": args.dtype}, len(examples), args.shard_size, start, write, "collect",
        "example")
    return out, len(examples) - before


def run(args) -> int:
    out, now = collect(args)
    if rank() == 0:
        data = read_collection(out)
        seconds = data.tensors["seconds"]
        n = seconds.shape[0]
        print(f"collected {now} examples now, {n} in total ({n - now} were there), "
              f"{data.num_spans} spans into {out}; per example: generation with features "
              f"{seconds[:, 0].mean():.3f} s, ablations {seconds[:, 1].mean():.3f} s")
    return 0
