"""``python -m headscope collect``: span features and ground-truth ablation effects over a
data set, for fitting and scoring the attribution head.

For each example: the chat-templated prompt with its image goes through the processor;
``Tracer.generate_with`` generates greedily and cuts the answer into spans (sentence
ends) with their features over K Ward regions of the image; ``region_effects`` measures
the effect of ablating each region, and each of M random sets of K/2 regions, on each
span. Results go to shards (``shards.py``); a rerun skips the shards already written.
Under ``torchrun`` each process takes every world-size-th shard.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Dict, List

import torch

from .data import Example, load_image, read_examples
from .errors import UsageError
from .shards import remove_temporaries, shard_path, write_manifest, write_shard


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a collection (shared with ``eval``, which collects first)."""
    parser.add_argument("--regions", type=int, default=8, metavar="K",
                        help="Ward regions per image (default 8)")
    parser.add_argument("--grid", default=None, metavar="ROWSxCOLS",
                        help="regions that cut the image's token grid into ROWS x COLS "
                             "blocks, instead of Ward regions (e.g. 3x3; K = ROWS * COLS)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="tokens generated per example, greedily (default 64)")
    parser.add_argument("--subsets", type=int, default=8, metavar="M",
                        help="random sets of K/2 regions per example whose joint effect is "
                             "measured, for the subset-level LDS (default 8; 0: none)")
    parser.add_argument("--ablation", choices=("mask", "mean", "zero"), default="mask",
                        help="how a region is ablated (default mask: its tokens are removed "
                             "from every query's attention in every layer)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="ablations per forward (default 8)")
    parser.add_argument("--shard-size", type=int, default=8,
                        help="examples per shard file (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random region sets")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        default="float32", help="model dtype (default float32)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N (default: the process's GPU if any, else cpu)")


def check_arguments(args) -> None:
    if args.grid is not None:
        from ..hf.regions import parse_grid
        try:
            rows, cols = parse_grid(args.grid)
        except ValueError as e:
            raise UsageError(f"--grid: {e}") from None
        args.grid, args.regions = f"{rows}x{cols}", rows * cols
    for name, low in (("regions", 1), ("max_new_tokens", 1), ("subsets", 0),
                      ("batch_size", 1), ("shard_size", 1)):
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got "
                             f"{getattr(args, name)}")
    if args.subsets and args.regions < 2:
        raise UsageError("--subsets needs --regions >= 2 (sets of K/2 regions)")


def _world() -> tuple:
    """(rank, world size, distributed module or None) under torchrun, else (0, 1, None)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world, dist


def _device(args) -> torch.device:
    if args.device:
        return torch.device(args.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _model_folder(folder: str) -> Path:
    if not Path(folder).is_dir():
        raise UsageError(f"--model {folder}: no such folder (a local transformers model "
                         f"folder, as save_pretrained writes)")
    return Path(folder)


def load_model(folder: str, dtype: str, device: torch.device):
    """Model and processor of a local transformers folder (no network)."""
    import transformers as tf
    path = _model_folder(folder)
    try:
        processor = tf.AutoProcessor.from_pretrained(path, local_files_only=True)
        model = tf.AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, dtype), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {folder}: cannot be loaded with from_pretrained: {e}") from e
    if getattr(processor, "chat_template", None) is None:
        raise UsageError(f"--model {folder}: its processor has no chat template")
    return model.to(device).eval(), processor


def text_sizes(folder: str) -> tuple:
    """(layers, attention heads) of the model's text decoder, from its config."""
    import transformers as tf
    try:
        config = tf.AutoConfig.from_pretrained(_model_folder(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {folder}: no readable config.json: {e}") from e
    text = config.get_text_config(decoder=True)
    return int(text.num_hidden_layers), int(text.num_attention_heads)


def prompt_inputs(processor, example: Example, image, device) -> Dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": example.prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    return {k: v.to(device) for k, v in inputs.items()}


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
                                 tokenizer=processor.tokenizer) as tracer:
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
    return {"features": torch.stack([s.features for s in spans]),
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
               ("span_bounds", "features", "effects", "subset_effects", "labels")},
            **{k: torch.stack([r[k] for r in records]) for k in
               ("subsets", "grid", "image_size", "seconds")}}


def collect(args) -> Path:
    """Runs (or resumes) the collection of ``args.data`` into ``args.out``; returns it."""
    from tqdm.auto import tqdm
    check_arguments(args)
    examples = read_examples(Path(args.data))
    out = Path(args.out)
    rank, world, dist = _world()
    if rank == 0:
        L, H = text_sizes(args.model)
        out.mkdir(parents=True, exist_ok=True)
        remove_temporaries(out)
        write_manifest(out, {"model": str(Path(args.model).resolve()),
                             "num_layers": L, "num_heads": H,
                             "data": str(Path(args.data).resolve()),
                             "examples": len(examples), "regions": args.regions,
                             "grid": args.grid,
                             "max_new_tokens": args.max_new_tokens, "subsets": args.subsets,
                             "ablation": args.ablation, "seed": args.seed,
                             "shard_size": args.shard_size, "dtype": args.dtype})
    if dist is not None:
        dist.barrier()
    shards = math.ceil(len(examples) / args.shard_size)
    todo = [s for s in range(rank, shards, world) if not shard_path(out, s).exists()]
    if todo:
        model, processor = load_model(args.model, args.dtype, _device(args))
        total = sum(len(examples[s * args.shard_size:(s + 1) * args.shard_size]) for s in todo)
        with tqdm(total=total, desc=f"collect (rank {rank})" if world > 1 else "collect",
                  unit="example", position=rank) as bar:
            for s in todo:
                records = []
                for example in examples[s * args.shard_size:(s + 1) * args.shard_size]:
                    records.append(collect_example(model, processor, example, args))
                    bar.update(1)
                write_shard(shard_path(out, s), _shard_tensors(records),
                            [t for r in records for t in r["texts"]],
                            [r["boxes"] for r in records])
    if dist is not None:
        dist.barrier()
    return out


def run(args) -> int:
    out = collect(args)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        from .shards import read_collection
        data = read_collection(out)
        seconds = data.tensors["seconds"]
        n = seconds.shape[0]
        print(f"collected {n} examples, {data.num_spans} spans into {out}; per example: "
              f"generation with features {seconds[:, 0].mean():.3f} s, ablations "
              f"{seconds[:, 1].mean():.3f} s")
    return 0
