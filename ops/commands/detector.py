"""``python -m headscope detector fit|eval``: a hallucination detector on the tables
``python -m headscope vas`` writes.

``fit`` fits a :class:`~headscope.VASDetector` (logistic regression on standardised
features, L-BFGS) to the labelled records of a table, on ``--features``: ``vas`` (the 36
VAS features), ``vas+logprob`` (and the answer's mean log-probability) or ``logprob``
(that alone). The file is VASDetector's (safetensors) and names its columns.

``eval`` scores the labelled records of another table (held out: not the fitting one):
the AUROC of the detector's probability and of the baseline, minus the mean
log-probability (less confident, more likely hallucinated), each with a bootstrap 95%
interval (``--rounds`` resamples of the records, seeded). ``--group COLUMN`` adds the
comparison within groups: the AUROC over the pairs of a positive and a negative record of
the same group only (the shapes model's answers to scenes of one object count, say), with
its interval, the AUROC of the group value alone when it is a number, and the AUROC
within each group. Records without a label are left out of both commands.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..detector import VASDetector
from ..io import write_json
from ..metrics import auroc, auroc_interval, auroc_within
from ..vas import VAS_COLUMNS
from .errors import UsageError, check_output, integer, number
from .vas_table import read_table

FEATURES = {"vas": list(VAS_COLUMNS), "vas+logprob": [*VAS_COLUMNS, "answer_logprob"],
            "logprob": ["answer_logprob"]}
BASELINE = "mean_logprob"  # the score -answer_logprob


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="{fit,eval}")
    fit = sub.add_parser("fit", help="fit a VASDetector to a table's labelled records",
                         description=__doc__.replace("``", ""),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    fit.add_argument("--data", required=True, help="a folder written by `vas`")
    fit.add_argument("--out", required=True,
                     help="the detector's file (.safetensors, headscope.VASDetector)")
    fit.add_argument("--features", choices=FEATURES, default="vas",
                     help="vas: the 36 VAS features (default); vas+logprob: and the mean "
                          "log-probability; logprob: that alone")
    fit.add_argument("--l2", type=number(0), default=1e-3,
                     help="ridge penalty on the weights in standardised units (default 1e-3)")
    ev = sub.add_parser("eval", help="AUROC of a detector against the log-probability "
                                     "baseline, overall and within groups",
                        description=__doc__.replace("``", ""),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("--detector", required=True, help="a file written by `detector fit`")
    ev.add_argument("--data", required=True,
                    help="a folder written by `vas` (held out from the fit)")
    ev.add_argument("--report", default=None, help="also write the results here (JSON)")
    ev.add_argument("--group", default=None, metavar="COLUMN",
                    help="a column of the table: AUROC within its groups too")
    ev.add_argument("--rounds", type=integer(10), default=1000,
                    help="bootstrap resamples of the records (default 1000)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the resamples (default 0)")


def run(args) -> int:
    return fit(args) if args.action == "fit" else evaluate(args)


def _labelled(table, columns: List[str], folder: str) -> tuple:
    """``(features (N, F) float64, labels (N,) bool, rows (N,))`` of the records with a
    label; both classes must be there, and every feature finite."""
    have = set(table.column_names)
    missing = [c for c in columns if c not in have]
    if missing:
        raise UsageError(f"--data {folder}: the table has no column {missing[0]!r} (the "
                         f"detector reads {len(columns)} columns)")
    labels = table.column("label").to_pylist()
    rows = [i for i, v in enumerate(labels) if v is not None]
    y = torch.tensor([labels[i] for i in rows], dtype=torch.bool)
    if not 0 < int(y.sum()) < len(rows):
        raise UsageError(f"--data {folder}: {len(rows)} labelled records, {int(y.sum())} of "
                         f"them positive; both classes are needed")
    X = torch.tensor([table.column(c).to_pylist() for c in columns],
                     dtype=torch.float64).t()[rows]
    bad = (~torch.isfinite(X)).any(1)
    if bool(bad.any()):
        lines = table.column("line").to_pylist()
        raise UsageError(f"--data {folder}: NaN or Inf features in the records of lines "
                         f"{[lines[rows[i]] for i in bad.nonzero()[:, 0].tolist()][:5]}")
    return X, y, rows


def fit(args) -> int:
    check_output(args.out, "--out")
    _, table = read_table(Path(args.data))
    columns = FEATURES[args.features]
    X, y, rows = _labelled(table, columns, args.data)
    detector = VASDetector(len(columns), columns).fit(X, y, l2=args.l2)
    detector.save(args.out)
    left_out = table.num_rows - len(rows)
    print(f"fitted a VASDetector on {args.features} ({len(columns)} columns) of {len(rows)} "
          f"labelled records ({int(y.sum())} positive"
          + (f"; {left_out} without a label left out" if left_out else "") + f") -> {args.out}")
    print(f"AUROC on the fitting records: {auroc(detector.predict_proba(X), y):.4f}")
    return 0


def _load(path: str) -> VASDetector:
    if not Path(path).is_file():
        raise UsageError(f"--detector {path}: no such file; allowed: a file written by "
                         f"`python -m headscope detector fit`")
    try:
        detector = VASDetector.load(path)
    except ValueError as e:
        raise UsageError(f"--detector {path}: {e}") from e
    if detector.columns is None:
        raise UsageError(f"--detector {path}: saved without the names of its columns; "
                         f"allowed: a file written by `python -m headscope detector fit`")
    return detector


def _strata(values: list) -> torch.Tensor:
    """Each value's group as an integer (-1: none, for a null)."""
    codes: Dict = {}
    return torch.tensor([-1 if v is None else codes.setdefault(v, len(codes)) for v in values])


def scored(scores: torch.Tensor, labels: torch.Tensor, rounds: int, seed: int,
           strata: Optional[torch.Tensor]) -> Dict:
    """AUROC and its interval, and within the strata when given (records without a
    stratum, -1, are left out of that comparison)."""
    out = {"auroc": auroc(scores, labels),
           "interval95": auroc_interval(scores, labels, rounds, seed)}
    if strata is not None:
        keep = strata >= 0
        s, y, g = scores[keep], labels[keep], strata[keep]
        out["auroc_within_groups"] = auroc_within(s, y, g)
        out["within_groups_interval95"] = auroc_interval(s, y, rounds, seed, strata=g)
    return out


def evaluate(args) -> int:
    if args.report is not None:
        check_output(args.report, "--report")
    detector = _load(args.detector)
    _, table = read_table(Path(args.data))
    if args.group is not None and args.group not in table.column_names:
        raise UsageError(f"--group {args.group}: not a column of the table {args.data}; "
                         f"allowed: {', '.join(c for c in table.column_names if c not in VAS_COLUMNS)}")
    X, y, rows = _labelled(table, detector.columns, args.data)
    logprob = torch.tensor(table.column("answer_logprob").to_pylist(),
                           dtype=torch.float64)[rows]
    group = None if args.group is None else \
        [table.column(args.group).to_pylist()[i] for i in rows]
    strata = None if group is None else _strata(group)
    scores = {"detector": detector.predict_proba(X), BASELINE: -logprob}
    results = {"records": len(rows), "positive": int(y.sum()),
               "left_out_unlabelled": table.num_rows - len(rows),
               "detector_file": str(args.detector), "columns": detector.columns,
               "data": str(args.data), "rounds": args.rounds, "seed": args.seed,
               **{name: scored(s, y, args.rounds, args.seed, strata)
                  for name, s in scores.items()}}
    if group is not None:
        results["group"] = args.group
        numeric = all(isinstance(v, (int, float)) for v in group)  # bools are ints too
        results["auroc_group_alone"] = auroc(torch.tensor(group, dtype=torch.float64), y) \
            if numeric else None
        results["groups"] = [
            {"value": value, "records": int(same.sum()), "positive": int(y[same].sum()),
             **{name: auroc(s[same], y[same]) for name, s in scores.items()}}
            for value, same in ((v, strata == code) for code, v in
                                enumerate(dict.fromkeys(v for v in group if v is not None)))]
    print(table_text(results))
    if args.report is not None:
        write_json(Path(args.report), results)
        print(f"report written to {args.report}")
    return 0


def _cell(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _interval(value: Optional[list]) -> str:
    return "n/a" if value is None else f"{value[0]:.3f}-{value[1]:.3f}"


def table_text(results: Dict) -> str:
    """The results as a plain-text table."""
    within = "group" in results
    lines = [f"{results['records']} labelled records, {results['positive']} positive"
             + (f"; groups by {results['group']}" if within else ""),
             f"{'':22}{'AUROC':>8}{'95% interval':>15}"
             + (f"{'within groups':>15}{'95% interval':>15}" if within else "")]
    for name, label in (("detector", "detector"), (BASELINE, "-mean log-prob")):
        r = results[name]
        lines.append(f"{label:22}{_cell(r['auroc']):>8}{_interval(r['interval95']):>15}"
                     + (f"{_cell(r['auroc_within_groups']):>15}"
                        f"{_interval(r['within_groups_interval95']):>15}" if within else ""))
    if within:
        lines.append(f"{results['group'] + ' alone':22}{_cell(results['auroc_group_alone']):>8}")
        lines.append(f"per group ({results['group']}: records, positive, AUROC detector / "
                     f"-mean log-prob):")
        for g in results["groups"]:
            lines.append(f"  {str(g['value']):>10}: {g['records']:5} {g['positive']:5}  "
                         f"{_cell(g['detector'])} / {_cell(g[BASELINE])}")
    return "\n".join(lines)
