"""``python -m headscope train``: fits an :class:`~headscope.AttributionHead` to a
collection's span features and ablation effects (every span-region pair is a sample;
``--target ranks``: to each span's ranking of its regions), optionally holding images out
for a validation LDS. Spans made only of special tokens (the end-of-text span) are left out
unless ``--keep-special-spans`` or ``--special-span-weight``: they name nothing of the
image, and ``headscope.shapes head-eval`` leaves them out of its sentence-span scores."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..features import FEATURE_SETS, feature_columns
from ..head import AttributionHead
from .collection import Collection, check_feature_columns, feature_set, read_collection
from .errors import UsageError, check_output, integer, number, refuse_ignored
from .metrics import score


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="a folder written by `collect`")
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


def fit(data: Collection, args) -> AttributionHead:
    from tqdm.auto import tqdm
    t = data.tensors
    S, K, F = t["features"].shape
    check_feature_columns(data.manifest, F, "train")
    head = AttributionHead(int(data.manifest["num_layers"]), int(data.manifest["num_heads"]),
                           feature_set=feature_set(data.manifest))
    targets = t["effects"] if args.target == "effects" else \
        ranked_targets(t["effects"], args.effect_weight)
    weights = None if args.special_span_weight is None else \
        torch.where(t["special_only"], args.special_span_weight, 1.0).unsqueeze(1).expand(S, K)
    if args.loss == "lstsq":
        head.fit(t["features"], targets, ridge=args.ridge, weights=weights)
    else:
        batches = -(-S // args.batch_spans)
        with tqdm(total=batches * (args.epochs + 2), desc="train (pearson)",
                  unit="batch") as bar:
            loader = _Batches(t["features"], targets, args.batch_spans, bar)
            head.fit_pearson(loader, args.epochs, lr=args.lr)
    if args.target == "ranks":  # scores in nats again: predicted effects, same ranking
        head.calibrate(t["features"], t["effects"], weights)
    return head


def run(args) -> int:
    check_arguments(args)
    data = read_collection(Path(args.data))
    if args.features is not None:
        data = with_features(data, args.features, args.data)
    weighted = args.special_span_weight is not None
    if weighted and "special_only" not in data.tensors:
        raise UsageError(f"--special-span-weight {args.special_span_weight:g}: the collection "
                         f"{args.data} does not record which spans are only special tokens "
                         f"(collected by an older headscope); collect it again")
    kept = fitted_spans(data, args.data, args.keep_special_spans or weighted)
    train_spans, val_spans = split(data, args.val_fraction, args.seed)
    train_spans, val_spans = train_spans & kept, val_spans & kept
    train = subset(data, train_spans)
    if train.num_spans < 2:
        raise UsageError(f"{args.data}: {train.num_spans} training span(s); need at least 2")
    head = fit(train, args)
    head.save(args.out)
    with torch.no_grad():
        fitted = score(train, head(train.tensors["features"]))
    if args.keep_special_spans:
        left_out = ""
    elif weighted:
        left_out = (f" ({int(train.tensors['special_only'].sum())} special-token-only spans "
                    f"weighted {args.special_span_weight:g})")
    else:
        left_out = f" ({int((~kept).sum())} special-token-only spans left out)"
    print(f"fitted a {args.loss} head on {train.num_spans} spans x "
          f"{data.tensors['effects'].shape[1]} regions{left_out} -> {args.out}")
    print(f"train LDS {_fmt(fitted['lds'])}")
    if val_spans.any():
        val = subset(data, val_spans)
        with torch.no_grad():
            held = score(val, head(val.tensors["features"]))
        print(f"validation LDS {_fmt(held['lds'])} on {val.num_spans} spans of "
              f"{round(args.val_fraction * data.tensors['line'].shape[0])} held-out images")
    return 0


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
