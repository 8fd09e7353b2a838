"""The cost of attributing a span (``python -m headscope.bench --family cost [--big]``):
streaming attribution (``headscope.hf.Tracer`` with an attribution head) against AttnLRP
(``headscope.hf.attnlrp_scores``) and input x gradient (``headscope.hf.gradient_scores``),
in one process: plain ``generate``, ``Tracer.generate`` with the head, then AttnLRP and
input x gradient on the spans that generation gave, in turn, round after round.

What a span costs each method (``per_span_ms``):

* the head (``head work``): the tracer's own work during the generation, timed inside it
  (the prompt's Ward regions; at the prefill, the value norms of the picture's keys and
  the last query row; each decode step's rows; each span's pooled features and the head's
  scores), over the generation's spans: its extra time per generated token times the
  span's tokens, plus the span's share of the prefill's work, plus its scoring. Beside
  it, ``Tracer.generate - plain``: the whole call's extra time over plain ``generate`` in
  the same round, which holds every overhead but is the difference of two runs and
  carries their noise (on a shared CPU, tens of percent of a generation);
* AttnLRP and input x gradient: their call on the generation's spans (one forward over the
  prompt and the answer, one backward per span) over the spans.

``vs_head``: a method's time per span over the head's, the median of the rounds' ratios
(``range``: lowest and highest); ``vs_head_diff``: over ``Tracer.generate - plain``, where
that was positive in every round. ``per_token_ms``: per generated token. ``peak_MiB``: the
extra peak memory of one call (the whole generation for plain generate and the tracer).

The head's work has a part per picture (the Ward regions), parts that grow with the
layers (the prefill's value norms and rows, each step's rows, each span's pooling) and
the head's scoring; AttnLRP's and input x gradient's passes grow with the layers and the
sequence. How peak memory grows with the sequence (last table): plain generate and the
tracer hold the key/value cache and the prefill's activations, linear in the prompt's
length T (the tracer adds the prompt's region ids and value norms and a few rows per
layer); input x gradient keeps the whole sequence's activations for its backward, linear
in T too; AttnLRP keeps, besides, every layer's attention probabilities (heads x T x T),
so its peak grows with T squared.

Models:

* the shapes model (``headscope.shapes.load``, its shipped head, one held-out 4-object
  scene, 8 Ward regions, 40 new tokens; 7 rounds after an untimed one, which measures
  peak memory). On a model this small (4 layers of width 128, a 42-token prompt) a
  backward pass is cheap, and the head is only some tens of times cheaper than AttnLRP;
* a Qwen2-VL-2B-shaped decoder (hidden 1536, 12 heads, 2 KV heads, intermediate 8960,
  vocabulary 151936, embeddings tied; random weights, a one-block vision tower), one
  1,024-token picture, 64 new tokens, 16 Ward regions, a random head on the
  value-norm-weighted features (its scoring costs what a fitted head's does); each call
  warmed up on a short prompt, then two rounds, the first measuring peak memory too. By
  default 4 of its 28 layers in float32; ``--big`` adds all 28 layers in float32 and in
  bfloat16 (hours on a CPU without bfloat16 units; AttnLRP's peak is about 0.5 GiB per
  layer at this length in float32, about 14 GiB over the model's 6 GiB);
* ``--quick``: the tiny Qwen2-VL test model in bfloat16, a 64-token picture, 8 new tokens;
* last, peak memory against the picture's size, on the tiny test model.

``--device cuda`` runs the same code on a GPU, the device synced around each timed call
of the tracer's.
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import time

import torch

from ._util import mib, peak_bytes, print_table
from ..timing import round_ratios, sync

REGIONS = 16


#: The tracer's calls that compute what streaming attribution adds, by part of its work
#: (the owner given by name: the "tracer", the Generation class, or the SpanRows class).
WORK_PARTS = {"prompt's regions": [("tracer", "_start_forward")],
              "prefill's rows": [("tracer", "_prefill")],
              "decode steps' rows": [("rows", "add"), ("rows", "begin_step")],
              "spans' features, scores": [("generation", "_make_span")]}


@contextlib.contextmanager
def tracer_work_clock(tracer, device):
    """Yields a dict that the tracer's own work adds its seconds to, by part
    (:data:`WORK_PARTS`), the device synced around each call."""
    from ..hf.generation import Generation
    from ..hf.rows import SpanRows
    owners = {"tracer": tracer, "generation": Generation, "rows": SpanRows}
    spent = dict.fromkeys(WORK_PARTS, 0.0)

    def timed(fn, part):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            sync(device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(device)
                spent[part] += time.perf_counter() - start
        return wrapper

    calls = [(owners[owner], name, part) for part, names in WORK_PARTS.items()
             for owner, name in names]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in calls]
    for owner, name, part in calls:
        setattr(owner, name, timed(getattr(owner, name), part))
    try:
        yield spent
    finally:
        for owner, name, fn in saved:
            if fn is None:
                delattr(owner, name)  # an instance's: the class's method again
            else:
                setattr(owner, name, fn)


def compare(model, inputs, head, tokenizer, regions: int, new_tokens: int, device,
            rounds: int, warm_inputs=None) -> list[dict]:
    """One model's rows: plain generate, the head (work inside the tracer, and the paired
    difference), AttnLRP and input x gradient per span, ``rounds`` alternating rounds; the
    first call of each measures its peak memory. Lazy initialisation (the tracer's value
    norm factors, computed once per model) is left out: by an untimed first round, or,
    given ``warm_inputs`` (a short prompt), by one call of each on those, two new tokens."""
    from ..hf import Tracer, attnlrp_scores, gradient_scores
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    prompt = {"inputs": inputs, "gen": gen}  # what the calls run on
    tracer = Tracer(model, regions=regions, vas=False, head=head, tokenizer=tokenizer)
    tracer.detach()
    times = {name: [] for name in ("plain", "traced", "work", "attnlrp", "gradient",
                                   *WORK_PARTS)}
    spans = []

    def clocked(name, fn):
        def run():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
        return run

    @torch.no_grad()
    def plain():
        model.generate(**prompt["inputs"], **prompt["gen"])

    @torch.no_grad()
    def traced():
        with tracer.attach(), tracer_work_clock(tracer, device) as work:
            got = list(tracer.generate(**prompt["inputs"], **prompt["gen"]))
        assert got[-1].end == prompt["gen"]["max_new_tokens"] and all(s.scores is not None for s in got)
        spans[:] = [(s.start, s.end) for s in got]
        times["work"].append(sum(work.values()))
        for part, seconds in work.items():
            times[part].append(seconds)

    def attnlrp():
        attnlrp_scores(model, prompt["inputs"], tracer.sequences, spans, tracer.region_ids)

    def gradient():
        gradient_scores(model, prompt["inputs"], tracer.sequences, spans, tracer.region_ids)

    runs = {name: clocked(name, fn) for name, fn in
            (("plain", plain), ("traced", traced), ("attnlrp", attnlrp), ("gradient", gradient))}
    if warm_inputs is not None:
        prompt.update(inputs=warm_inputs, gen=dict(gen, max_new_tokens=2, min_new_tokens=2))
        for fn in runs.values():
            fn()
        prompt.update(inputs=inputs, gen=gen)
        for values in times.values():
            values.clear()
    peaks = {name: peak_bytes(fn, device, warmup=False) for name, fn in runs.items()}
    if warm_inputs is None:
        for values in times.values():
            values.clear()
    for _ in range(rounds if warm_inputs is None else rounds - 1):
        for name, fn in runs.items():
            time.sleep(0.2)  # the previous call's worker threads go idle
            fn()
    S = len(spans)
    work = times["work"]
    diff = [t - p for t, p in zip(times["traced"], times["plain"])]

    def median_ms(values, per=1):
        return 1e3 * statistics.median(values) / per

    rows = [{"what": "plain generate", "spans": S, "per_token_ms": median_ms(times["plain"],
                                                                              new_tokens),
             "peak_MiB": mib(peaks["plain"])},
            {"what": "head work (in the tracer)", "per_span_ms": median_ms(work, S),
             "per_token_ms": median_ms(work, new_tokens), "vs_head": 1.0,
             "peak_MiB": mib(peaks["traced"])},
            *({"what": f"  of which {part}", "per_span_ms": median_ms(times[part], S),
               "per_token_ms": median_ms(times[part], new_tokens)} for part in WORK_PARTS),
            {"what": "head: Tracer.generate - plain", "per_span_ms": median_ms(diff, S),
             "per_token_ms": median_ms(diff, new_tokens),
             "range": f"{1e3 * min(diff) / S:.3g}-{1e3 * max(diff) / S:.3g} ms per span"}]
    for name, label in (("attnlrp", "AttnLRP"), ("gradient", "input x gradient")):
        ratio = round_ratios(times[name], work)
        row = {"what": label, "per_span_ms": median_ms(times[name], S), "vs_head": ratio[0],
               "range": f"{ratio[1]:.3g}-{ratio[2]:.3g}", "peak_MiB": mib(peaks[name])}
        if min(diff) > 0:  # a ratio to a difference that noise made negative means nothing
            row["vs_head_diff"] = round_ratios(times[name], diff)[0]
        rows.append(row)
    return rows


COLUMNS = ["what", "spans", "per_span_ms", "per_token_ms", "vs_head", "range", "vs_head_diff",
           "peak_MiB"]


def bench_shapes(device) -> dict:
    """The shapes model, its shipped head, one held-out 4-object scene."""
    from ..shapes.accuracy import held_out_scenes
    from ..shapes.demo import DEFAULT_REGIONS
    from ..shapes.model import load, prompt
    model, processor, head = load()
    model = model.to(device)
    _, image, _ = held_out_scenes(4)[3]
    inputs = {k: v.to(device) for k, v in prompt(processor, image).items()}
    new = 40
    rows = compare(model, inputs, head, processor.tokenizer, DEFAULT_REGIONS, new, device,
                   rounds=7)
    P = inputs["input_ids"].shape[1]
    print_table(f"cost per span, shapes model ({P}-token prompt, {new} new tokens; "
                f"{device.type}, float32)", rows, COLUMNS)
    return {"rows": rows}


def _random_head(model):
    """An attribution head with random weights on the model's value-norm-weighted
    features: scoring costs what a fitted head's does."""
    from ..head import AttributionHead
    text = model.config.text_config
    head = AttributionHead(text.num_hidden_layers, text.num_attention_heads,
                           feature_set="attention*value_norm")
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.num_features, generator=torch.Generator().manual_seed(0)))
    return head


def bench_decoder(device, dtype: torch.dtype, layers: int) -> dict:
    """The Qwen2-VL-2B-shaped decoder with ``layers`` layers, one 1,024-token picture, 64
    new tokens (``layers`` 0: the tiny test model, a 64-token picture, 8 new tokens)."""
    from ..hf.testing import tiny_model

    from .hf import _inputs, _model
    if layers:
        model, side, new = _model(False, "sdpa", layers=layers, dtype=dtype), 32, 64
    else:
        model, side, new = tiny_model("qwen2_vl", dtype=dtype), 8, 8
    model = model.to(device)
    inputs = _inputs(model, side, device)
    # the 2B shape's calls take minutes: warmed up on a short prompt, two rounds in all
    rows = compare(model, inputs, _random_head(model).to(device), None, REGIONS, new, device,
                   rounds=2 if layers else 1,
                   warm_inputs=_inputs(model, 4, device) if layers else None)
    text = model.config.text_config
    P = inputs["input_ids"].shape[1]
    name = "Qwen2-VL-2B-shaped" if layers else "tiny Qwen2-VL"
    print_table(f"cost per span, {name}, {text.num_hidden_layers} layers, one {side * side}-token "
                f"picture ({P}-token prompt), {new} new tokens ({device.type}, "
                f"{str(dtype).removeprefix('torch.')})", rows, COLUMNS)
    return {"rows": rows}


def bench_growth(device, quick: bool) -> dict:
    """Peak memory of one call of each against the picture's size, on the tiny test model
    (a span of 8 tokens)."""
    from ..hf import Tracer, attnlrp_scores, gradient_scores
    from ..hf.testing import tiny_model

    from .hf import _inputs
    model = tiny_model("qwen2_vl").to(device)
    head = _random_head(model).to(device)
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    rows = []
    for side in (4, 8) if quick else (8, 16, 32):
        inputs = _inputs(model, side, device)
        tracer = Tracer(model, regions=REGIONS, vas=False, head=head)

        @torch.no_grad()
        def traced():
            list(tracer.generate(**inputs, **gen))

        traced_peak = peak_bytes(traced, device)
        tracer.detach()
        spans = [(0, 8)]
        rows.append({"picture_tokens": side * side, "T": inputs["input_ids"].shape[1] + 8,
                     "plain_MiB": mib(peak_bytes(torch.no_grad()(
                         lambda: model.generate(**inputs, **gen)), device)),
                     "tracer_MiB": mib(traced_peak),
                     "attnlrp_MiB": mib(peak_bytes(lambda: attnlrp_scores(
                         model, inputs, tracer.sequences, spans, tracer.region_ids), device)),
                     "gradient_MiB": mib(peak_bytes(lambda: gradient_scores(
                         model, inputs, tracer.sequences, spans, tracer.region_ids), device))})
    print_table(f"peak memory against the picture's size, tiny Qwen2-VL, 8 new tokens "
                f"({device.type}, float32)", rows,
                ["picture_tokens", "T", "plain_MiB", "tracer_MiB", "attnlrp_MiB", "gradient_MiB"])
    return {"rows": rows}


def run(device, quick: bool = False, big: bool = False) -> dict:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install headscope[hf]): cost family skipped")
        return {}
    transformers.logging.set_verbosity_error()
    # --quick: the tiny model in bfloat16 (the path the others take too); by default the
    # shapes model and 4 of the 2B shape's layers in float32; --big: also all 28 of them,
    # in float32 and bfloat16
    results = {} if quick else {"shapes": bench_shapes(device)}
    sizes = [(torch.bfloat16, 0)] if quick else [(torch.float32, 4)]
    if big and not quick:
        sizes += [(torch.float32, 28), (torch.bfloat16, 28)]
    for dtype, layers in sizes:
        name = f"decoder_{layers or 'tiny'}_{str(dtype).removeprefix('torch.')}"
        results[name] = bench_decoder(device, dtype, layers)
    results["growth"] = bench_growth(device, quick)
    return results
