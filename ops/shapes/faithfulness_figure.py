"""The faithfulness-against-time figure and its files: ``faithfulness.png`` (LDS and R^2
against ms per generated token, log time axis, one labelled point per method),
``faithfulness.md`` and ``faithfulness.json``, each written atomically."""
from __future__ import annotations

import math
from pathlib import Path

from ..io import atomic_path, write_json, write_text
from .faithfulness import table

COLOURS = {"head": "tab:green", "attention": "tab:blue", "gradient": "tab:orange",
           "gradient_norm": "tab:red", "attnlrp": "tab:purple", "perturbation": "black"}


def plot(path: Path, result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    methods = result["methods"]
    times = [m["ms_per_token"] for m in methods.values()]
    middle = (min(times) * max(times)) ** 0.5
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), dpi=100)
    for ax, key, name in ((axes[0], "lds", "LDS (Spearman per span, mean over scenes)"),
                          (axes[1], "r2", "R\u00b2 of predicted vs true effects")):
        placed = []  # (side, log time, value, label offset) of the labels so far
        for method, m in methods.items():
            x, y = m["ms_per_token"], m[key]
            ax.scatter(x, y, s=70, color=COLOURS[method], zorder=3)
            label = m["label"] + (" (affine fit)" if key == "r2" and
                                  m["r2_of"] == "best affine fit" else "")
            # labels point away from the middle of the time axis, into the free space,
            # and step past the labels of nearby points on the same side, away from them
            left = x > middle
            offset = 0
            near = [(ly, off) for side, lx, ly, off in placed
                    if side == left and abs(math.log10(x) - lx) < 0.5 and abs(y - ly) < 0.06]
            while any(off == offset for _, off in near):
                offset += 11 if y >= near[0][0] else -11
            placed.append((left, math.log10(x), y, offset))
            ax.annotate(label, (x, y), textcoords="offset points", va="center",
                        xytext=(-9 if left else 9, offset), ha="right" if left else "left",
                        fontsize=8.5)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("added time per generated token (ms, log scale)")
        ax.set_ylabel(name)
        values = [m[key] for m in methods.values()]
        ax.set_ylim(min(0.0, min(values)) - 0.1, 1.1)
        ax.set_xlim(min(times) / 3, max(times) * 3)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"Faithfulness against time per token: shapes model, {result['scenes']} "
                 f"held-out scenes, {result['spans']} spans, {result['regions']} regions "
                 f"(perturbation = the true effects: 1 by construction)", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def write_faithfulness(out: Path, result: dict) -> dict:
    """Writes ``out/faithfulness.{json,md,png}``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"faithfulness.{ext}" for ext in ("json", "md", "png")}
    write_json(paths["json"], result)
    first, last = result["seeds"]
    write_text(
        paths["md"],
        f"Faithfulness against time per token on {result['scenes']} held-out scenes "
        f"(seeds {first}..{last}), {result['spans']} spans, {result['tokens']} generated "
        f"tokens, {result['regions']} Ward regions, {result['threads']} threads.\n\n"
        + table(result) + "\n\nR^2 of attention and gradients: of the best affine fit "
        "(they are not in effect units). Perturbation: the true effects themselves "
        "(faithfulness 1 by construction). Head and attention time: the tracer's added "
        f"time per token ({result['tracer_added_ms_per_token']:.3f} ms, generate_with "
        "against plain generate, alternating rounds) plus computing the scores from the "
        "features (\"of which scoring\"); gradients, AttnLRP and perturbation: their whole "
        "computation after generation, per generated token; ms per span: each method's "
        "own time divided by the spans scored.\n")
    plot(paths["png"], result)
    return {k: str(v) for k, v in paths.items()}
