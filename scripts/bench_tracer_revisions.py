"""The Tracer's timings at this checkout's Python sources against another revision's, in one
process and alternating rounds: ``python scripts/bench_tracer_revisions.py REV``.

REV's ``ops/`` is unpacked to a temporary folder and imported beside ``headscope`` under
another package name (the packages import each other relatively; both load the one library
``headscope`` loads). One tiny model serves both tracers, attached in turn: a traced forward
with VAS, and ``tr.generate`` of spans over its regions (with features ``"attention"`` and
``"both"``). Prints, per case, the median seconds of each and the ratio this checkout / REV
as the median, lowest and highest over the rounds (each round's time of a case: the median
of ``--calls`` calls)."""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
OTHER = "headscope_rev"  # the package name REV's sources are imported under


def import_revision(rev: str, folder: Path):
    """REV's ``ops/`` as the package :data:`OTHER`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "ops"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    spec = importlib.util.spec_from_file_location(
        OTHER, folder / "ops" / "__init__.py", submodule_search_locations=[str(folder / "ops")])
    package = importlib.util.module_from_spec(spec)
    sys.modules[OTHER] = package
    spec.loader.exec_module(package)
    importlib.import_module(f"{OTHER}.hf")
    return sys.modules[f"{OTHER}.hf"]


def cases(hf, model, inputs, new_tokens: int) -> dict:
    """The timed calls of one package's tracer, each attaching it for its call."""
    def forward(tr):
        def run():
            tr.attach()
            try:
                with torch.no_grad():
                    model(**inputs)
                tr.vas_features()
            finally:
                tr.detach()
        return run

    def generate(tr):
        def run():
            tr.attach()
            try:
                list(tr.generate(**inputs, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False))
            finally:
                tr.detach()
        return run

    def detached(**kwargs):
        tr = hf.Tracer(model, **kwargs)
        tr.detach()
        return tr

    every4 = lambda ids: len(ids) % 4 == 0  # noqa: E731
    return {"forward, VAS + regions": forward(detached(regions=8, vas=True)),
            "generate, spans": generate(detached(regions=8, vas=False, splitter=every4)),
            'generate, spans, "both"': generate(detached(regions=8, vas=False, splitter=every4,
                                                         features="both"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the revision to compare with (e.g. main)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5, help="calls per round (their median)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    import headscope.hf as hf
    from headscope.bench.timing import interleaved, round_ratios
    from headscope.hf.testing import image_prompt, tiny_model
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        other = import_revision(args.rev, Path(folder))
        model = tiny_model("qwen2_vl", layers=args.layers, hidden=args.hidden,
                           intermediate=2 * args.hidden)
        model.generation_config.eos_token_id = None
        inputs = image_prompt(model, grids=((8, 8), (8, 6)), text_before=(3, 2),
                              text_after=(5, 3))
        mine = cases(hf, model, inputs, args.new_tokens)
        theirs = cases(other, model, inputs, args.new_tokens)
        fns = {}
        for name in mine:
            fns[("this", name)] = mine[name]
            fns[(args.rev, name)] = theirs[name]
        times = interleaved(fns, rounds=args.rounds, pause=0.05,
                            calls=dict.fromkeys(fns, args.calls))
    print(f"{'case':28} {'this ms':>9} {args.rev + ' ms':>9}  this / {args.rev}: median "
          f"[lowest, highest] over {args.rounds} rounds")
    for name in mine:
        a, b = times[("this", name)], times[(args.rev, name)]
        ratio, low, high = round_ratios(a, b)
        print(f"{name:28} {1e3 * sorted(a)[len(a) // 2]:9.2f} {1e3 * sorted(b)[len(b) // 2]:9.2f}"
              f"  {ratio:.3f} [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
