"""``eval``'s heat-map yardsticks: per sentence span (spans not made only of special tokens),
the deletion and insertion AUC of each scorer's heat order (regions by score per image
token, hottest first; :func:`headscope.hf.heat_curves`), beside the true single-region
effects' order and random orders. Each example's answer is generated again (greedy, the
collection's regions; it must be the collection's), and the cumulative region sets of every
scorer are measured in one batched ``region_effects`` call. Results go to a sharded folder
of their own (``shards.py``'s writer, format ``headscope.curves``): a rerun resumes there,
and other settings are refused."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, List

import torch

from ..metrics import mean_with_interval, per_image
from .collection import Collection
from .shards import Layout, checked_shards, fill_shards, read_manifest, write_shard_bytes

CURVES = Layout("headscope.curves", 1, ".safetensors", "eval")
CURVE_NAMES = ("deletion", "insertion")
REFERENCES = ("effects", "random")
RANDOM_ORDERS = 2
WHO = "headscope eval"


def digest(scores: Dict[str, torch.Tensor]) -> str:
    """SHA-256 of every scorer's scores: which scores a curves folder measured."""
    h = hashlib.sha256()
    for name in sorted(scores):
        h.update(name.encode())
        h.update(scores[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _example_curves(model, processor, example, data: Collection, rows: torch.Tensor,
                    scores: Dict[str, torch.Tensor], batch_size: int
                    ) -> Dict[str, torch.Tensor]:
    """One example's curves on its sentence spans (``rows``: the collection's spans of
    the example)."""
    from ..hf import Tracer, grid_regions, heat_curves
    from ..hf.regions import parse_grid
    from .collect import prompt_inputs
    from .data import load_image
    m, t = data.manifest, data.tensors
    device = next(model.parameters()).device
    inputs = prompt_inputs(processor, example, load_image(example), device)
    regions = m["regions"] if m["grid"] is None else grid_regions(*parse_grid(m["grid"]))
    spans: List = []
    with torch.no_grad(), Tracer(model, regions=regions, vas=False,
                                 tokenizer=processor.tokenizer) as tracer:
        tracer.generate_with(spans.append, **inputs, max_new_tokens=m["max_new_tokens"],
                             do_sample=False)
    bounds = torch.tensor([[s.start, s.end] for s in spans])
    if not torch.equal(bounds, t["span_bounds"][rows]):
        raise RuntimeError(f"{WHO}: line {example.line}: the model's answer differs from the "
                           f"one the collection holds (another model, dtype or device?)")
    sentence = ~t["special_only"][rows] if "special_only" in t else \
        torch.ones(len(rows), dtype=torch.bool)
    out = {"sentence": sentence}
    kept = sentence.nonzero().squeeze(1).tolist()
    if kept:
        curves, total = heat_curves(
            model, inputs, tracer.sequences, [spans[i] for i in kept], tracer.region_ids,
            {name: s[rows][kept] for name, s in scores.items()},
            effects=t["effects"][rows][kept], random=RANDOM_ORDERS,
            seed=int(m["seed"]) * 1_000_003 + example.line, ablation=m["ablation"],
            batch_size=batch_size, progress=False)
        for name, pair in curves.items():
            for curve in CURVE_NAMES:
                out[f"{name}/{curve}"] = pair[curve]
        out["total"] = total
    return out


def measure(args, data: Collection, collection: Path, scores: Dict[str, torch.Tensor],
            folder: Path) -> Dict[str, torch.Tensor]:
    """Runs (or resumes) the curves of every example of ``data`` (the collection in the
    folder ``collection``) into ``folder`` (``args``: eval's, for the device and the
    ablations per forward); returns,
    per sentence span of the collection (in order), ``"<scorer>/<curve>"`` AUCs (NaN where
    removing every image token has no positive effect), ``"total"`` and ``"span_example"``."""
    from .data import read_examples
    from .models import device, load_model
    m = data.manifest
    examples = read_examples(Path(m["data"]))
    t = data.tensors
    if len(examples) != t["line"].shape[0]:
        raise RuntimeError(f"{WHO}: the collection holds {t['line'].shape[0]} examples and "
                           f"its DATA {m['data']} {len(examples)}")
    settings = {"collection": str(Path(collection).resolve()),
                "scores": digest(scores), "scorers": sorted(scores),
                "random_orders": RANDOM_ORDERS}
    names = [*scores, *REFERENCES]

    def start():
        model, processor = load_model(m["model"], m["dtype"], device(args))
        return lambda i: (i, _example_curves(model, processor, examples[i], data,
                                              (t["span_example"] == i).nonzero().squeeze(1),
                                              scores, args.batch_size))

    def write(shard: int, items: List) -> None:
        from safetensors.torch import save
        tensors = {"span_example": torch.cat([torch.full((int(o["sentence"].sum()),), i)
                                              for i, o in items]),
                   "sentence": torch.cat([o["sentence"] for _, o in items])}
        for key in [f"{n}/{c}" for n in names for c in CURVE_NAMES] + ["total"]:
            tensors[key] = torch.cat([o.get(key, torch.zeros(0, dtype=torch.float64))
                                      for _, o in items])
        write_shard_bytes(folder, shard, save({k: v.contiguous() for k, v in tensors.items()}),
                          CURVES)

    fill_shards(folder, CURVES, settings, len(examples), int(m["shard_size"]), start, write,
                "curves", "example")
    from safetensors.torch import load_file
    parts = [load_file(str(p)) for p in checked_shards(folder, read_manifest(folder, CURVES),
                                                        CURVES)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def summarise(curves: Dict[str, torch.Tensor], examples: int, heads: List[str],
              baselines: List[str]) -> Dict:
    """Per scorer and reference: deletion and insertion AUC (per image, the mean over its
    sentence spans with a defined AUC; then mean, standard error and bootstrap 95% interval
    over images), and each head's paired difference to each baseline."""
    out: Dict = {"spans": int(curves["total"].numel())}
    span_example = curves["span_example"]
    for curve in CURVE_NAMES:
        images = {n: per_image(curves[f"{n}/{curve}"], span_example, examples)
                  for n in [*heads, *baselines, *REFERENCES]}
        defined = ~torch.isnan(images[REFERENCES[0]])
        out[curve] = {n: mean_with_interval(v[defined]) for n, v in images.items()}
        out[f"{curve}_difference"] = {f"{h} - {b}": mean_with_interval(images[h][defined]
                                                                       - images[b][defined])
                                      for h in heads for b in baselines}
        out["images"] = int(defined.sum())
    return out


def folder_for(report: str) -> Path:
    """The curves folder beside a report: ``<report without suffix>.curves``."""
    return Path(str(Path(report).with_suffix("")) + ".curves")

