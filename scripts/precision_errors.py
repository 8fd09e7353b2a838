"""The Tracer's VAS and span features against their float64 definitions, on the tiny model of
each family model type, as the family contract checks them (tests/python/
test_family_contract.py; the bound: headscope.hf.testing.precision, docs/hf.md "Half
precision"): ``python scripts/precision_errors.py [--types qwen3_5 gemma3 ...]``.

Per model type and dtype (float32, bfloat16, float16) it prints the largest error of the
per-head VAS statistics (sdpa: the Tracer recomputes the probabilities from q and k; eager:
it reads the weights the model formed; and those weights against the float64 softmax of
their q and k) and of the span features, each with its largest ratio to its bound. On a
gated family (Qwen3.5's output gate) it prints, in float32, how far the VAS features of the
writes before the gate are from those of the definition (the writes o_proj reads): the
error of reading a head's write before its gate."""
from __future__ import annotations

import argparse
import copy

import torch

import headscope
from headscope.hf import Tracer
from headscope.hf.testing import image_prompt, tiny_model, tiny_of
from headscope.hf.testing.models import FAMILIES
from headscope.hf.testing.precision import step_masses64, vas_head_stats64
from headscope.hf.testing.reference import GATED, recorded_attention


def prompt(model):
    """The contract's left-padded batch of two prompts of one picture each."""
    return image_prompt(model, grids=tiny_of(model).spec.grids[:2], text_before=(3, 2),
                        text_after=(5, 3))


def worst(got, want, bound):
    """(largest |got - want|, its largest ratio to the bound; an exact entry's is 0)."""
    err = (got.double().cpu() - want).abs()
    return float(err.max()), float((err / bound).masked_fill(err == 0, 0.0).max())


def vas_errors(model, inputs):
    """VAS statistics against float64 on the model's own tensors; and, where the model
    formed its weights (eager), those against the float64 softmax of their q and k."""
    with torch.no_grad(), recorded_attention(model) as calls, Tracer(model, vas=True) as tr:
        model(**inputs)
        stats, feats = tr.vas_head_stats(), tr.vas_features()
    want, bound = vas_head_stats64(calls, inputs["attention_mask"])
    rows = {"vas": worst(stats, want, bound)}
    if calls[0].weights is not None:
        exact, exact_bound = vas_head_stats64(calls, inputs["attention_mask"], exact=True)
        rows["vas of its weights vs float64 softmax"] = worst(stats, exact, exact_bound)
    ungated = None
    if model.config.model_type in GATED and model.dtype == torch.float32:
        for call in calls:
            call.writes = call.output.transpose(1, 2)
        ungated = headscope.vas_aggregate(vas_head_stats64(
            calls, inputs["attention_mask"])[0].float())
        defined = headscope.vas_aggregate(want.float())
        rows["features: traced vs definition"] = relative(feats, defined)
        rows["features: before the gate vs definition"] = relative(ungated, defined)
    return rows


def relative(got, want):
    """(largest |got - want| over the largest |want|, largest elementwise relative error
    over features of at least 1e-2)."""
    err = (got - want).abs()
    big = want.abs() >= 1e-2
    return float(err.max() / want.abs().max()), float((err[big] / want.abs()[big]).max())


def span_errors(model, inputs, steps=4):
    every2 = lambda ids: len(ids) % 2 == 0  # noqa: E731
    with torch.no_grad(), recorded_attention(model) as calls, \
            Tracer(model, regions=3, vas=False, splitter=every2) as tr:
        spans = list(tr.generate(**inputs, max_new_tokens=steps, do_sample=False,
                                 eos_token_id=None))
    masses, bounds = step_masses64(calls, tr.num_layers, inputs["input_ids"].shape[1],
                                   tr.region_ids, max(tr.num_regions))
    err, ratio = 0.0, 0.0
    for s in spans:
        K, rows = tr.num_regions[s.batch_index], slice(s.start, s.end)
        e, r = worst(s.features, masses[rows, s.batch_index, :K].mean(0),
                     bounds[rows, s.batch_index, :K].mean(0))
        err, ratio = max(err, e), max(ratio, r)
    return {"span features": (err, ratio)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=sorted(FAMILIES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    print(f"{'model type':16} {'dtype':9} {'attention':9} {'what':42} {'error':>9} {'/ bound':>9}")
    for model_type in args.types:
        try:
            base = {impl: tiny_model(model_type, attn_implementation=impl)
                    for impl in ("sdpa", "eager")}
        except Exception as e:  # noqa: BLE001 (a family whose tiny model fails: said, skipped)
            print(f"{model_type:16} skipped: {type(e).__name__}: {str(e)[:80]}")
            continue
        for dtype in args.dtypes:
            for impl, model in base.items():
                model = copy.deepcopy(model).to(getattr(torch, dtype))
                try:
                    rows = vas_errors(model, prompt(model))
                    if impl == "sdpa":
                        rows.update(span_errors(model, prompt(model)))
                except Exception as e:  # noqa: BLE001
                    print(f"{model_type:16} {dtype:9} {impl:9} failed: {type(e).__name__}: "
                          f"{str(e)[:80]}")
                    continue
                for what, (a, b) in rows.items():
                    if what.startswith("features:"):  # relative: to the largest, elementwise
                        print(f"{model_type:16} {dtype:9} {impl:9} {what:42} {a:9.2e} {b:9.2e}"
                              f" (relative: to the largest, elementwise)")
                    else:
                        print(f"{model_type:16} {dtype:9} {impl:9} {what:42} {a:9.2e} {b:9.3f}")


if __name__ == "__main__":
    main()
