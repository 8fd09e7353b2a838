"""The mixer inside a vision tower: a Qwen2-VL-2B-shaped tower (width 1280, 16 heads of
80, MLP ratio 4; two of its 32 blocks, random weights) with its attention swapped by
``headscope.hf.use_mixer`` against the same tower on SDPA and on eager attention, one
image of n patches; and how the projection's tolerance and iteration cap trade the
tower's accuracy against its time."""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from ._util import mib, peak_bytes, print_table
from ..timing import interleaved, round_ratios

WIDTH, HEADS, BLOCKS, RANK = 1280, 16, 2, 16
MEMORY_BUDGET = 8 * 2**30  # a case whose estimated peak exceeds this is skipped
PATCH_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch


def tower_model(dtype: torch.dtype, device):
    """A Qwen2-VL model whose vision tower has the 2B checkpoint's shape (``BLOCKS``
    blocks) and whose text model is negligible: only ``model.model.visual`` runs."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    text = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                     mrope_section=[4, 6, 6]))
    vision = dict(depth=BLOCKS, embed_dim=WIDTH, num_heads=HEADS, hidden_size=64,
                  mlp_ratio=4, patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision)
    config.vision_config._attn_implementation_internal = "sdpa"
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).to(device, dtype).eval()


def _image(side: int, dtype, device):
    g = torch.Generator().manual_seed(side)
    pixels = torch.randn(side * side, PATCH_DIM, generator=g).to(device, dtype)
    return pixels, torch.tensor([[1, side, side]], device=device)


def _eager_bytes(n: int, dtype) -> int:
    """Eager attention's scores, their float32 softmax and its cast back, one head batch."""
    return HEADS * n * n * (2 * torch.finfo(dtype).bits // 8 + 4)


class IterationCounter:
    """Records, through forward hooks on the handle's mixers, the Newton iterations of
    each call's projections (recomputed from the mixer's inputs: the op reports them,
    FactorMixer does not return them)."""

    def __init__(self, handle):
        self.iters = {index: [] for index in handle.mixers}
        self._hooks = [m.register_forward_hook(self._hook(i)) for i, m in handle.mixers.items()]

    def _hook(self, index):
        def record(mixer, args, out):
            q, k, _ = args
            log_u = q.float() @ mixer.w_q.float() / mixer.temperature
            log_v = k.float() @ mixer.w_k.float() / mixer.temperature
            iters = torch.ops.headscope.kl_project(log_u, log_v, mixer.tol, mixer.max_iter)[3]
            self.iters[index].append(iters.float().mean().item())
        return record

    def remove(self):
        for h in self._hooks:
            h.remove()


def captured_qkv(handle, run) -> tuple:
    """The (q, k, v) the first swapped layer's mixer receives during ``run()``."""
    seen = []
    hook = handle.mixers[min(handle.mixers)].register_forward_hook(
        lambda mixer, args, out: seen.append(args))
    try:
        run()
    finally:
        hook.remove()
    return seen[0]


def attention_fns(mixer, q, k, v) -> dict:
    """One layer's attention on its own q, k, v: the mixer, SDPA and eager softmax."""
    scale = q.shape[-1] ** -0.5

    def eager():
        weights = torch.softmax((q @ k.mT).float() * scale, -1).to(q.dtype)
        return weights @ v
    return {"mixer": lambda: mixer(q, k, v),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
            "eager": eager}


def _mean_iters(handle, run) -> dict:
    counter = IterationCounter(handle)
    try:
        run()
    finally:
        counter.remove()
    return {index: statistics.mean(v) for index, v in counter.iters.items()}


def _ratio_row(prefix: str, times: dict, peak: dict) -> dict:
    """Median times, mixer-relative ratios of rounds and peak memory of ``times``' entries."""
    row = {}
    for name in times:
        row[f"{prefix}{name}_ms"] = 1e3 * statistics.median(times[name])
        row[f"{prefix}{name}_MiB"] = mib(peak[name])
        if name != "mixer":
            row[f"{prefix}{name} / mixer"] = round_ratios(times[name], times["mixer"])[0]
            row[f"{prefix}{name} / mixer memory"] = peak[name] / max(peak["mixer"], 1)
    return row


def _columns(prefix: str) -> list:
    return [f"{prefix}{c}" for c in ("mixer_ms", "sdpa_ms", "eager_ms", "sdpa / mixer",
                                     "eager / mixer", "mixer_MiB", "sdpa_MiB", "eager_MiB",
                                     "sdpa / mixer memory", "eager / mixer memory")]


def bench_tower(device, quick: bool, big: bool) -> dict:
    """The whole tower (patch embedding, blocks, merger) and its first layer's attention
    alone (on the q, k, v that layer computes), at each image size."""
    from ..hf import use_mixer
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sides = [16] if quick else ([32, 64, 96, 128] if device.type == "cuda" or big else [32, 64])
    model = tower_model(dtype, device)
    tower, config = model.model.visual, model.config.vision_config
    mixed_model = tower_model(dtype, device)  # same seed: the same weights
    handle = use_mixer(mixed_model, rank=RANK)
    rows, layer_rows, skipped = [], [], []
    for side in sides:
        n = side * side
        pixels, thw = _image(side, dtype, device)

        def softmax(impl):
            def call():
                config._attn_implementation_internal = impl
                with torch.no_grad():
                    return tower(pixels, grid_thw=thw)
            return call

        def mixer():
            with torch.no_grad():
                return mixed_model.model.visual(pixels, grid_thw=thw)
        fns = {"mixer": mixer, "sdpa": softmax("sdpa")}
        with torch.no_grad():
            layer = attention_fns(handle.mixers[0], *captured_qkv(handle, mixer))
        if _eager_bytes(n, dtype) <= MEMORY_BUDGET:
            fns["eager"] = softmax("eager")
        else:
            del layer["eager"]
            skipped.append(n)
            print(f"(n = {n}: eager skipped, its {_eager_bytes(n, dtype) / 2**30:.1f} GiB of "
                  f"scores exceed the {MEMORY_BUDGET / 2**30:.0f} GiB budget)")
        rounds = 2 if quick or n >= 4096 else 3
        row = {"n": n, **_ratio_row("", interleaved(fns, device, rounds=rounds),
                                    {name: peak_bytes(fn, device) for name, fn in fns.items()}),
               "newton iters per layer": " ".join(f"{v:.1f}" for v in
                                                  _mean_iters(handle, mixer).values())}
        rows.append(row)
        with torch.no_grad():
            layer_rows.append({"n": n, **_ratio_row(
                "", interleaved(layer, device, rounds=3, calls={"mixer": 3}),
                {name: peak_bytes(fn, device) for name, fn in layer.items()})})
    config._attn_implementation_internal = "sdpa"
    handle.undo()
    what = (f"Qwen2-VL-2B's vision-tower shape ({BLOCKS} of its 32 blocks, width {WIDTH}, "
            f"{HEADS} heads, random weights; {device.type}, {str(dtype)[6:]}), one image of n "
            f"patches, use_mixer at r = {RANK}, tol 1e-10 vs SDPA vs eager; ratios: medians "
            f"over alternating rounds; MiB: extra peak memory of one call")
    print_table(f"the whole tower: {what}", rows,
                ["n", *_columns(""), "newton iters per layer"])
    print_table(f"one layer's attention on its own q, k, v: {what}", layer_rows,
                ["n", *_columns("")])
    crossover = {}
    for name, table in (("tower", rows), ("layer", layer_rows)):
        faster = [row["n"] for row in table if row["sdpa / mixer"] > 1]
        crossover[name] = min(faster) if faster else None
    print(f"crossover n (smallest n measured where the mixer beats SDPA): {crossover}")
    return {"rows": rows, "layer_rows": layer_rows, "crossover_n": crossover,
            "eager_skipped_n": skipped}


#: (tol, max_iter) settings of the accuracy sweep, from loosest to the default; max_iter
#: counts states examined, as kl_project's iters (1: the references' row softmaxes, no
#: Newton step); tol 0: exactly max_iter states unless the line search stalls.
SETTINGS = [(0.0, 1), (0.0, 2), (0.0, 3), (0.0, 5), (1e-4, 50), (1e-6, 50), (1e-8, 50),
            (1e-10, 50)]
#: Multipliers of the mixer's initial W_q, W_k: at 1 (random weights) the log-references
#: barely vary and every setting is exact; larger ones spread them as a trained mixer's.
SPREADS = (1.0, 8.0, 32.0)


def bench_tolerance(device, quick: bool) -> list:
    """One layer's mixer output (on the q, k, v the tower's first layer computes) under
    each projection setting against the most accurate solution (tol 1e-13, 100 states:
    float64's floor, about 1e-12 at these sizes): relative Frobenius error, time, Newton
    states (mean over heads) and the heads left above tol, at each spread."""
    from ..mixer import FactorMixer, kl_project
    from ..hf import use_mixer
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    side = 32 if quick else 64
    model = tower_model(dtype, device)
    pixels, thw = _image(side, dtype, device)
    with use_mixer(model, rank=RANK) as handle:
        with torch.no_grad():
            q, k, v = captured_qkv(handle, lambda: model.model.visual(pixels, grid_thw=thw))
    rows = []
    for spread in SPREADS:
        mixer = FactorMixer(HEADS, WIDTH // HEADS, RANK, tol=1e-13, max_iter=100,
                            check=False).to(device)
        with torch.no_grad():
            mixer.w_q.mul_(spread)
            mixer.w_k.mul_(spread)
            reference = mixer(q, k, v).float()
            log_u = q.float() @ mixer.w_q / mixer.temperature
            log_v = k.float() @ mixer.w_k / mixer.temperature
        fns = {}
        for tol, max_iter in SETTINGS:
            def configured(tol=tol, max_iter=max_iter):
                mixer.tol, mixer.max_iter = tol, max_iter
                with torch.no_grad():
                    return mixer(q, k, v)
            fns[(tol, max_iter)] = configured
        times = interleaved(fns, device, rounds=3, calls={key: 3 for key in fns})
        for (tol, max_iter), fn in fns.items():
            out = fn().float()
            solved = kl_project(log_u, log_v, tol, max_iter, log_space=True, check=False)
            rows.append({"w scale": spread, "log-ref std": log_u.std().item(),
                         "tol": tol if tol else "none", "max_iter": max_iter,
                         "ms": 1e3 * statistics.median(times[(tol, max_iter)]),
                         "rel. error": ((out - reference).norm() / reference.norm()).item(),
                         "states": solved.iters.float().mean().item(),
                         "heads above tol": int((solved.residual > tol).sum()) if tol else "",
                         "max residual": solved.residual.max().item()})
    print_table(f"one layer's mixer, accuracy against time ({device.type}, {str(dtype)[6:]}, "
                f"n = {side * side}, {HEADS} heads, r = {RANK}; q, k, v of the tower's first "
                f"layer): each projection setting against the most accurate solution "
                f"(relative Frobenius error); tol 'none': a fixed number of states; states: "
                f"kl_project's iters, mean over heads; w scale multiplies the initial W_q, W_k",
                rows, ["w scale", "log-ref std", "tol", "max_iter", "ms", "rel. error", "states",
                       "heads above tol", "max residual"])
    return rows
