"""``python -m headscope synthetic``: the attribution head of each feature set against raw
attention on synthetic data whose true effects are known, built as Kobayashi et al. 2020
("Attention is not only a weight") describe a key's contribution: its attention weight
times its value norm ``||v_j W_O^h||``.

The data extend the generator of vStream's reference implementation
(``vstream_synth_repro.py``, docs/attribution.md: linear effects of L*H pooled features plus
noise) with what real pooled attention has. Per image, span, region k, layer l and head h:

- attention ``A``: the span's attention mass on each region, a softmax over the K regions
  of Gaussian logits (std 1; non-negative, summing to 1 per head);
- value norms ``N``: per image, region, layer and head, log-normal, each head with its own
  scale (log-scales of std 1.0 across heads, 0.5 across an image's regions); shared by the
  image's spans, as a region's keys are;
- true effect ``sum_{l,h} w[l,h] * A * N`` plus Gaussian noise of std 0.7 times the mean
  absolute deviation of that signal (the reference's rule, whose signal has mean 0), ``w``
  half-normal (ablating a region a head reads lowers the span's likelihood in proportion
  to what the head carries from it).

A head of each feature set (``"attention"``: A; ``"attention*value_norm"``: A*N; ``"both"``)
is fitted with ``AttributionHead.fit`` on the training images and scored on the test
images beside raw attention (A's mean over layers and heads), raw weighted attention (A*N's
mean) and the noiseless truth (the ceiling the noise leaves): per-image LDS (Spearman
across regions per span, averaged over the image's spans), each scorer's mean with its
standard error and bootstrap 95% interval over images, and its paired difference to raw
attention. ``--seed dev`` draws the data that served to develop the generator and the
command; ``reported`` (the default), the data of the numbers docs/attribution.md reports.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, NamedTuple

import torch

from ..features import FEATURE_SETS
from ..head import AttributionHead
from ..io import write_json
from ..metrics import lds_per_image, mean_with_interval
from .errors import check_output

SEEDS = {"dev": 1, "reported": 2}
HEAD_SPREAD = 1.0       # std of the heads' log value-norm scales
KEY_SPREAD = 0.5        # std of a head's log value norms across regions
ATTENTION_SPREAD = 1.0  # std of the attention logits over regions
NOISE = 0.7             # noise std over the signal's mean absolute deviation

# layers, heads, regions, spans per image, training images, test images
SIZES = {"full": dict(layers=12, heads=12, regions=16, spans=4, train=500, test=300),
         "quick": dict(layers=4, heads=4, regions=9, spans=2, train=120, test=60)}
RAW = ("raw attention", "raw attention*value_norm")
CEILING = "noiseless truth"  # what a scorer can at best expect under the noise
SCORERS = tuple(f"head: {s}" for s in FEATURE_SETS) + RAW + (CEILING,)


class Images(NamedTuple):
    attention: torch.Tensor     # (images, spans, K, L*H)
    value_norms: torch.Tensor   # (images, K, L*H)
    signal: torch.Tensor        # (images, spans, K): the effects without their noise
    effects: torch.Tensor       # (images, spans, K)

    def features(self, feature_set: str) -> torch.Tensor:
        """``(images, spans, K, F)``: the columns of a head of ``feature_set``."""
        weighted = self.attention * self.value_norms.unsqueeze(1)
        blocks = {"attention": (self.attention,), "attention*value_norm": (weighted,),
                  "both": (self.attention, weighted)}[feature_set]
        return torch.cat(blocks, -1)


def generate(seed: int, layers: int, heads: int, regions: int, spans: int, train: int,
             test: int) -> Dict[str, Images]:
    """The training and test images of one seed (float64), drawn from one truth: the
    heads' weights ``w`` and value-norm scales are the same for both."""
    g = torch.Generator().manual_seed(seed)
    LH = layers * heads
    weight = torch.randn(LH, generator=g, dtype=torch.float64).abs()
    weight /= weight.norm()
    head_scale = HEAD_SPREAD * torch.randn(LH, generator=g, dtype=torch.float64)

    def images(n: int) -> Images:
        logits = ATTENTION_SPREAD * torch.randn(n, spans, regions, LH, generator=g,
                                                dtype=torch.float64)
        attention = logits.softmax(2)
        value_norms = (head_scale + KEY_SPREAD * torch.randn(n, regions, LH, generator=g,
                                                             dtype=torch.float64)).exp()
        signal = (attention * value_norms.unsqueeze(1)) @ weight
        spread = (signal - signal.mean()).abs().mean()
        noise = NOISE * spread * torch.randn(signal.shape, generator=g, dtype=torch.float64)
        return Images(attention, value_norms, signal, signal + noise)

    return {"train": images(train), "test": images(test)}


def measure(seed: int, layers: int, heads: int, regions: int, spans: int, train: int,
            test: int) -> dict:
    """Per-image LDS of every scorer on the test images, with intervals and the paired
    difference to raw attention (see the module's documentation)."""
    data = generate(seed, layers, heads, regions, spans, train, test)
    fit, held = data["train"], data["test"]
    scores = {}
    for feature_set in FEATURE_SETS:
        head = AttributionHead(layers, heads, dtype=torch.float64, feature_set=feature_set)
        head.fit(fit.features(feature_set), fit.effects)
        with torch.no_grad():
            scores[f"head: {feature_set}"] = head(held.features(feature_set))
    scores["raw attention"] = held.attention.mean(-1)
    scores["raw attention*value_norm"] = held.features("attention*value_norm").mean(-1)
    scores[CEILING] = held.signal
    span_image = torch.arange(test).repeat_interleave(spans)
    per_image = {name: lds_per_image(s.reshape(-1, regions), held.effects.reshape(-1, regions),
                                     span_image, test) for name, s in scores.items()}
    base, attention_head = per_image["raw attention"], per_image["head: attention"]
    return {"seed": seed, "sizes": dict(layers=layers, heads=heads, regions=regions,
                                         spans=spans, train=train, test=test),
            "generator": dict(head_spread=HEAD_SPREAD, key_spread=KEY_SPREAD,
                              attention_spread=ATTENTION_SPREAD, noise=NOISE),
            "lds": {name: mean_with_interval(v) for name, v in per_image.items()},
            "lds_vs_raw_attention": {name: mean_with_interval(v - base)
                                     for name, v in per_image.items() if v is not base},
            # does weighting by value norms make the head itself more faithful?
            "lds_vs_attention_head": {name: mean_with_interval(per_image[name] - attention_head)
                                      for name in SCORERS[1:len(FEATURE_SETS)]},
            "lds_per_image": {name: v.tolist() for name, v in per_image.items()}}


def table(result: dict) -> str:
    """Per-image LDS of each scorer and its paired difference to raw attention, markdown."""
    def cell(m) -> str:
        low, high = m["interval95"]
        return f"{m['mean']:.3f} ± {m['se']:.3f} [{low:.3f}, {high:.3f}]"

    s = result["sizes"]
    lines = [f"seed {result['seed']}: L = {s['layers']}, H = {s['heads']}, K = {s['regions']} "
             f"regions, {s['spans']} spans per image; heads fitted on {s['train']} images, "
             f"scored on {s['test']}", "",
             "| scores | per-image LDS (mean ± s.e. [bootstrap 95%]) | minus raw attention "
             "(paired) |", "| --- | --- | --- |"]
    for name in SCORERS:
        diff = result["lds_vs_raw_attention"].get(name)
        lines.append(f"| {name} | {cell(result['lds'][name])} | "
                     f"{'' if diff is None else cell(diff)} |")
    lines.append("")
    for name, diff in result["lds_vs_attention_head"].items():
        lines.append(f"{name} minus head: attention (paired): {cell(diff)}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", choices=sorted(SEEDS), default="reported",
                        help="dev: the data for developing; reported (default): the data "
                             "of the reported numbers")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (L = H = 4, K = 9, 60 test images), seconds")
    parser.add_argument("--report", default=None,
                        help="also write the results (per-image LDS included) to this JSON "
                             "file")


def run(args) -> int:
    if args.report is not None:
        check_output(args.report, "--report")
    result = measure(SEEDS[args.seed], **SIZES["quick" if args.quick else "full"])
    result["seed_name"] = args.seed
    print(table(result))
    if args.report is not None:
        write_json(Path(args.report), result)
        print(f"report written to {args.report}")
    return 0
