"""``python -m headscope train``: fits an :class:`~headscope.AttributionHead` to a
collection's span features and ablation effects (every span-region pair is a sample;
``--target ranks``: to each span's ranking of its regions), optionally holding images out
for a validation LDS. Spans made only of special tokens (the end-of-text span) are left out
unless ``--keep-special-spans`` or ``--special-span-weight``: they name nothing of the
image, and ``headscope.shapes head-eval`` leaves them out of its sentence-span scores."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Union

import torch

from ..features import FEATURE_SETS, feature_columns
from ..head import AttributionHead
from .collection import Collection, check_feature_columns, feature_set, read_collection
from .errors import UsageError, check_output, integer, number, refuse_ignored
from .metrics import score


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, action="append", metavar="FOLDER",
                        help="a folder written by `collect`; give --data again to fit one head "
                             "on several collections (of the same model and feature set), such "
                             "as one per region layout, so that it serves any regions")
    parser.add_argument("--out", required=True, help="the head's file (.safetensors)")
    parser.add_argument("--loss", choices=("lstsq", "pearson"), default="lstsq",
                        help="lstsq: closed-form least squares on standardised features and "
                             "targets (default); pearson: minibatch Adam on -Pearson")
    parser.add_argument("--epochs", type=integer(1), default=20,
                        help="pearson: passes (default 20)")
    parser.add_argument("--lr", type=number(0, above=True), default=1e-2,
                        help="pearson: Adam step (default 0.01)")
    parser.add_argument("--batch-spans", type=integer(1), default=256,
                        help="pearson: spans per minibatch (default 256)")
    parser.add_argument("--ridge", type=number(0), default=0.0,
                        help="lstsq: ridge penalty in standardised units (default 0)")
    parser.add_argument("--val-fraction", type=number(0, below=1), default=0.0,
                        help="share of images held out; their LDS is reported (default 0)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the held-out choice (with --val-fraction)")
    parser.add_argument("--features", choices=FEATURE_SETS, default=None,
                        help="the feature set to fit on: the collection's (default) or one "
                             "whose blocks it holds (attention or attention*value_norm out "
                             "of a collection made with --features both)")
    parser.add_argument("--target", choices=("effects", "ranks"), default="effects",
                        help="what the head is fitted to: the measured effects (default), or "
                             "per span the standardised ranks of its regions' effects plus "
                             "--effect-weight times its standardised effects (closer to the "
                             "LDS, a within-span ranking)")
    parser.add_argument("--effect-weight", type=number(0), default=0.5,
                        help="ranks: the weight of the standardised effects beside the ranks "
                             "(default 0.5)")
    parser.add_argument("--keep-special-spans", action="store_true",
                        help="fit on spans made only of special tokens (the end-of-text "
                             "span) too; by default they are left out")
    parser.add_argument("--special-span-weight", type=number(0, above=True), default=None,
                        help="fit on spans made only of special tokens too, each weighing "
                             "this much against 1 for the others (--keep-special-spans: 1)")
    parser.add_argument("--data-weight", type=number(0, above=True), action="append",
                        default=None, metavar="W",
                        help="with several --data: how much each collection weighs, one "
                             "--data-weight per --data in their order (default 1 each)")
    parser.add_argument("--span-weights", choices=("pairs", "spans"), default="pairs",
                        help="pairs: every (span, region) pair weighs 1 (default); spans: every "
                             "span weighs 1, shared by its regions, so that collections of many "
                             "regions do not outweigh those of few")
    parser.add_argument("--calibration", choices=("affine", "origin"), default="affine",
                        help="how the scores are put in the effects' units, on every (span, "
                             "region) pair as collected (--data-weight and --span-weights "
                             "weigh the fit only): affine (slope and offset, default; --target "
                             "ranks only) or origin (a slope through the origin: a region "
                             "without attention is predicted no effect, so that the score "
                             "divided by a region's image tokens is a per-token attribution, "
                             "and regions of unequal size compare)")


PEARSON_ONLY = ("epochs", "lr", "batch_spans")


def check_arguments(args) -> None:
    """Options that would have no effect, and the head's file (before any work)."""
    if args.loss == "lstsq":
        refuse_ignored(args, PEARSON_ONLY, "with --loss lstsq (the closed form)")
    else:
        refuse_ignored(args, ["ridge", "special_span_weight"], "with --loss pearson")
    if not args.val_fraction:
        refuse_ignored(args, ["seed"], "without --val-fraction (it picks the held-out images)")
    if args.target == "effects":
        refuse_ignored(args, ["effect_weight"], "with --target effects")
    if args.keep_special_spans:
        refuse_ignored(args, ["special_span_weight"], "with --keep-special-spans (weight 1)")
    if args.data_weight is not None and len(args.data_weight) != len(args.data):
        raise UsageError(f"--data-weight: given {len(args.data_weight)} times for "
                         f"{len(args.data)} --data; allowed: one per --data, in their order")
    if args.loss == "pearson":
        refuse_ignored(args, ["data_weight", "span_weights", "calibration"],
                       "with --loss pearson")
    check_output(args.out, "--out")


class _Batches:
    """Re-iterable minibatches of (features, effects) that advance a progress bar."""

    def __init__(self, features, effects, size: int, bar):
        self.features, self.effects, self.size, self.bar = features, effects, size, bar

    def __len__(self) -> int:
        return -(-self.features.shape[0] // self.size)

    def __iter__(self):
        for lo in range(0, self.features.shape[0], self.size):
            yield self.features[lo:lo + self.size], self.effects[lo:lo + self.size]
            self.bar.update(1)


def split(data: Collection, fraction: float, seed: int) -> tuple:
    """Boolean masks over spans (train, validation): whole images are held out."""
    examples = data.tensors["line"].shape[0]
    held = round(fraction * examples)
    if fraction and not 1 <= held < examples:
        raise UsageError(f"--val-fraction {fraction} of {examples} images leaves "
                         f"{held} for validation and {examples - held} for training; both "
                         f"need at least one")
    order = torch.randperm(examples, generator=torch.Generator().manual_seed(seed))
    is_val = torch.zeros(examples, dtype=torch.bool)
    is_val[order[:held]] = True
    val = is_val[data.tensors["span_example"]]
    return ~val, val


def subset(data: Collection, spans: torch.Tensor) -> Collection:
    """The collection restricted to the spans ``spans`` (bool mask); examples kept."""
    t = dict(data.tensors)
    for k in ("span_example", "span_bounds", "features", "effects", "subset_effects",
              "special_only"):
        if k in t:
            t[k] = t[k][spans]
    texts = [x for x, keep in zip(data.texts, spans.tolist()) if keep]
    return Collection(data.manifest, t, texts, data.boxes)


def with_features(data: Collection, wanted: str, folder: str) -> Collection:
    """The collection with only the columns of feature set ``wanted``."""
    have = feature_set(data.manifest)
    try:
        features = feature_columns(data.tensors["features"], have, wanted)
    except ValueError as e:
        raise UsageError(f"--features {wanted}: the collection {folder} holds feature set "
                         f"{have!r}, without the columns of {wanted!r}; collect with "
                         f"--features {wanted} or both") from e
    return Collection({**data.manifest, "feature_set": wanted},
                      {**data.tensors, "features": features}, data.texts, data.boxes)


def fitted_spans(data: Collection, folder: str, keep_special: bool) -> torch.Tensor:
    """Boolean mask over spans: the ones to fit and validate on (all with
    ``keep_special``, else those not made only of special tokens)."""
    if keep_special:
        return torch.ones(data.num_spans, dtype=torch.bool)
    if "special_only" not in data.tensors:
        raise UsageError(f"--data {folder}: the collection does not record which spans are "
                         f"only special tokens (collected by an older headscope); collect it "
                         f"again, or pass --keep-special-spans to fit on every span")
    return ~data.tensors["special_only"]


def standardised(values: torch.Tensor) -> torch.Tensor:
    """``(S, K)`` -> each row centred and divided by its standard deviation (a constant row
    gives zeros)."""
    centred = values - values.mean(-1, keepdim=True)
    std = centred.pow(2).mean(-1, keepdim=True).sqrt()
    return torch.where(std > 0, centred / std.clamp_min(torch.finfo(values.dtype).tiny),
                       torch.zeros_like(centred))


def ranked_targets(effects: torch.Tensor, effect_weight: float) -> torch.Tensor:
    """``(S, K)`` effects -> targets for ``--target ranks``: per span, the standardised
    ranks of its regions' effects (ties share their average rank, as Spearman's) plus
    ``effect_weight`` times its standardised effects. The ranks make the fit follow the
    order the LDS scores; the effects keep the largest effect on top, where pointing reads
    it."""
    effects = effects.double()
    above = (effects.unsqueeze(-1) > effects.unsqueeze(-2)).sum(-1)
    ties = (effects.unsqueeze(-1) == effects.unsqueeze(-2)).sum(-1)
    ranks = (above + (ties - 1) / 2).double()
    return standardised(ranks) + effect_weight * standardised(effects)


def fit(data: Union[Collection, List[Collection]], args) -> AttributionHead:
    """The head fitted to one collection's (span, region) pairs, or to every pair of
    several collections at once (each of its own regions: ranks are taken within each
    span of each collection)."""
    from tqdm.auto import tqdm
    datas = data if isinstance(data, list) else [data]
    first = datas[0]
    F = first.tensors["features"].shape[-1]
    for d in datas:
        check_feature_columns(d.manifest, d.tensors["features"].shape[-1], "train")
    head = AttributionHead(int(first.manifest["num_layers"]), int(first.manifest["num_heads"]),
                           feature_set=feature_set(first.manifest))
    data_weights = args.data_weight or [1.0] * len(datas)
    per_span = args.span_weights == "spans"
    features, effects, targets, spans, weights = [], [], [], [], []
    for d, data_weight in zip(datas, data_weights):
        t = d.tensors
        S, K, _ = t["features"].shape
        features.append(t["features"].reshape(-1, F))
        effects.append(t["effects"].reshape(-1))
        targets.append((t["effects"] if args.target == "effects" else
                        ranked_targets(t["effects"], args.effect_weight)).reshape(-1))
        span = (torch.ones(S) if args.special_span_weight is None else
                torch.where(t["special_only"], args.special_span_weight, 1.0)
                ).unsqueeze(1).expand(S, K).reshape(-1)
        spans.append(span)
        weights.append(span * data_weight / (K if per_span else 1))
    features, effects, targets = torch.cat(features), torch.cat(effects), torch.cat(targets)
    # the fit's weights; the calibration weighs every pair as collected (special-token-only
    # spans by --special-span-weight): it puts the scores in nats on the data itself
    spans = None if args.special_span_weight is None else torch.cat(spans)
    weighted = spans is not None or per_span or any(w != 1.0 for w in data_weights)
    weights = torch.cat(weights) if weighted else None
    if args.loss == "lstsq":
        head.fit(features, targets, ridge=args.ridge, weights=weights)
    else:
        t = first.tensors
        S = t["features"].shape[0]
        batches = -(-S // args.batch_spans)
        with tqdm(total=batches * (args.epochs + 2), desc="train (pearson)",
                  unit="batch") as bar:
            loader = _Batches(t["features"], targets.reshape(t["effects"].shape),
                              args.batch_spans, bar)
            head.fit_pearson(loader, args.epochs, lr=args.lr)
    if args.calibration == "origin":
        calibrate_through_origin(head, features, effects, spans)
    elif args.target == "ranks":  # scores in nats again: predicted effects, same ranking
        head.calibrate(features, effects, spans)
    return head


def calibrate_through_origin(head: AttributionHead, features: torch.Tensor,
                             effects: torch.Tensor, weights=None) -> AttributionHead:
    """Puts ``head``'s scores in the effects' units with a slope through the origin: the
    score's value at zero features is dropped and the least-squares slope of the effects
    on what remains (weighted by ``weights``) is folded into the weight, so that a region
    without attention is predicted no effect and a region's score is the sum of its image
    tokens' shares (the ranking within a span is unchanged). A slope that is not positive is
    an error, as it would reverse the ranking."""
    X = features.reshape(-1, features.shape[-1]).double()
    y = effects.reshape(-1).double()
    w = torch.ones_like(y) if weights is None else weights.reshape(-1).double()
    std = head.std.double()
    raw = (X / std) @ head.weight.detach().double()  # the score less its value at 0
    slope = float((w * raw * y).sum() / (w * raw * raw).sum())
    if not slope > 0:
        raise ValueError(f"headscope train: the effects do not rise with the scores through the "
                         f"origin (slope {slope:g}); calibrating would reverse the ranking")
    head._store(head.weight.detach().double() * slope, torch.zeros_like(std), std, 0.0)
    return head


def check_together(datas: List[Collection], folders: List[str]) -> None:
    """Collections fitted together hold the same model's layers, heads and feature set."""
    def sizes(d):
        return (int(d.manifest["num_layers"]), int(d.manifest["num_heads"]),
                feature_set(d.manifest))
    for d, folder in zip(datas[1:], folders[1:]):
        if sizes(d) != sizes(datas[0]):
            raise UsageError(f"--data {folder}: {sizes(d)[0]} layers x {sizes(d)[1]} heads of "
                             f"feature set {sizes(d)[2]!r}, but --data {folders[0]} holds "
                             f"{sizes(datas[0])[0]} x {sizes(datas[0])[1]} of "
                             f"{sizes(datas[0])[2]!r}; allowed: collections of one model and "
                             f"feature set (--features picks one out of 'both')")


def run(args) -> int:
    check_arguments(args)
    if args.loss == "pearson" and len(args.data) > 1:
        raise UsageError(f"--data {args.data[1]}: --loss pearson fits one collection; allowed: "
                         f"one --data, or --loss lstsq")
    weighted = args.special_span_weight is not None
    datas, trains, vals, kepts = [], [], [], []
    for folder in args.data:
        data = read_collection(Path(folder))
        if args.features is not None:
            data = with_features(data, args.features, folder)
        if weighted and "special_only" not in data.tensors:
            raise UsageError(f"--special-span-weight {args.special_span_weight:g}: the "
                             f"collection {folder} does not record which spans are only "
                             f"special tokens (collected by an older headscope); collect it "
                             f"again")
        kept = fitted_spans(data, folder, args.keep_special_spans or weighted)
        train_spans, val_spans = split(data, args.val_fraction, args.seed)
        train = subset(data, train_spans & kept)
        if train.num_spans < 2:
            raise UsageError(f"{folder}: {train.num_spans} training span(s); need at least 2")
        datas.append(data)
        trains.append(train)
        vals.append(val_spans & kept)
        kepts.append(kept)
    check_together(datas, args.data)
    head = fit(trains, args)
    head.save(args.out)
    for data, train, val_spans, kept, folder in zip(datas, trains, vals, kepts, args.data):
        with torch.no_grad():
            fitted = score(train, head(train.tensors["features"]))
        if args.keep_special_spans:
            left_out = ""
        elif weighted:
            left_out = (f" ({int(train.tensors['special_only'].sum())} special-token-only "
                        f"spans weighted {args.special_span_weight:g})")
        else:
            left_out = f" ({int((~kept).sum())} special-token-only spans left out)"
        named = f" of {folder}" if len(datas) > 1 else ""
        print(f"fitted a {args.loss} head on {train.num_spans} spans{named} x "
              f"{data.tensors['effects'].shape[1]} regions{left_out} -> {args.out}")
        print(f"train LDS {_fmt(fitted['lds'])}")
        if val_spans.any():
            val = subset(data, val_spans)
            with torch.no_grad():
                held = score(val, head(val.tensors["features"]))
            print(f"validation LDS {_fmt(held['lds'])} on {val.num_spans} spans of "
                  f"{round(args.val_fraction * data.tensors['line'].shape[0])} held-out "
                  f"images")
    return 0


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
