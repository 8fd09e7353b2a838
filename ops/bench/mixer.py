"""Mixer benchmarks: kl_project against the reference implementation's ``project``
(kl_projection_reference.py, column ``seed``) looped over a batch and a batched
eager-PyTorch Newton; kl_project + thin_mix against scaled_dot_product_attention;
thin_mix against its eager formulation and the dense W @ X; the mixer inside a
Qwen2-VL-shaped vision tower (``mixer_tower``, needs transformers)."""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from ._util import load_seed, mib, peak_bytes, print_table
from ..timing import interleaved, round_ratios, timeit

ops = torch.ops.headscope


def eager_project(a, b, tol=1e-11, max_iter=80):
    """The reference implementation's Newton method in batched eager PyTorch: every
    problem of the batch steps together, with a per-problem backtracking line search."""
    P, n, r = a.shape

    def state(z):
        U = torch.softmax(a + z[:, None], -1)
        V = torch.softmax(b - z[:, None], -1)
        return U, V, U.sum(1) - V.sum(1)

    z = a.new_zeros(P, r)
    for _ in range(max_iter):
        U, V, g = state(z)
        active = g.abs().amax(-1) >= tol
        if not bool(active.any()):
            break
        H = torch.diag_embed(U.sum(1) + V.sum(1)) - U.mT @ U - V.mT @ V
        step = torch.linalg.solve(H[:, :-1, :-1], -g[:, :-1, None])[..., 0]
        old = (g * g).sum(-1)
        alpha = torch.ones(P, dtype=a.dtype)
        done = ~active
        while not bool(done.all()) and float(alpha.max()) > 1e-10:
            zn = z.clone()
            zn[:, :-1] += alpha[:, None] * step
            gn = state(zn)[2]
            ok = ((gn * gn).sum(-1) < old * (1 - 1e-4 * alpha)) & ~done
            z = torch.where(ok[:, None], zn, z)
            done |= ok
            alpha = torch.where(done, alpha, alpha / 2)
    return state(z)


def bench_projection(quick: bool):
    seed = load_seed("kl_projection_reference")
    P, n, r = (32 if quick else 256), 128, 8
    g = torch.Generator().manual_seed(0)
    a = torch.randn(P, n, r, generator=g, dtype=torch.float64)
    b = torch.randn(P, n, r, generator=g, dtype=torch.float64)
    fns = {"ours": lambda: ops.kl_project(a, b, 1e-11, 80), "eager": lambda: eager_project(a, b)}
    if seed is not None:
        A, B = a.exp().numpy(), b.exp().numpy()
        fns["seed"] = lambda: [seed.project(A[i], B[i]) for i in range(P)]
    # in alternating rounds: the ratios of one round compare like with like
    times = interleaved(fns, rounds=3 if quick else 5, calls={"ours": 5, "eager": 3})
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    row = {"problems": P, "n": n, "r": r, "headscope_ms": ms["ours"], "eager_torch_ms": ms["eager"],
           "vs_eager": round_ratios(times["eager"], times["ours"])[0],
           "headscope_peak_MiB": mib(peak_bytes(fns["ours"])),
           "eager_peak_MiB": mib(peak_bytes(fns["eager"]))}
    if seed is not None:
        row.update(seed_numpy_ms=ms["seed"], vs_seed=round_ratios(times["seed"], times["ours"])[0])
    cols = ["problems", "n", "r", "headscope_ms", "seed_numpy_ms", "vs_seed", "eager_torch_ms",
            "vs_eager", "headscope_peak_MiB", "eager_peak_MiB"]
    print_table("kl_project: batch of float64 problems (seed looped, batched eager torch)", [row], cols)
    return row


def bench_mixer(device, quick: bool):
    heads, d = (32, 64) if device.type == "cuda" else (8, 64)
    ns = [256, 1024] if quick else ([1024, 4096, 8192, 32768] if device.type == "cuda"
                                    else [256, 1024, 4096, 8192])
    ranks = [16] if device.type == "cuda" else [8, 16, 32]
    rows = []
    for n in ns:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, heads, n, d, generator=g).to(device) for _ in range(3))
        fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}
        for r in ranks:
            def mixer(r=r):
                U, V, *_ = ops.kl_project(q[..., :r] / 3, k[..., :r] / 3, 1e-10, 80)
                return ops.thin_mix(U, V, v)
            fns[r] = mixer
        # SDPA and the mixers in alternating rounds: timed minutes apart, their ratio moved
        # by 2x with the machine's speed modes
        times = interleaved(fns, device, rounds=2 if quick else 5,
                            calls={r: 3 for r in ranks})
        m_sdpa = peak_bytes(fns["sdpa"], device)
        for r in ranks:
            speedup, low, high = round_ratios(times["sdpa"], times[r])
            rows.append({"n": n, "r": r, "heads": heads,
                         "mixer_ms": 1e3 * statistics.median(times[r]),
                         "sdpa_ms": 1e3 * statistics.median(times["sdpa"]),
                         "speedup_vs_sdpa": speedup, "speedup range": f"{low:.3g}-{high:.3g}",
                         "mixer_peak_MiB": mib(peak_bytes(fns[r], device)),
                         "sdpa_peak_MiB": mib(m_sdpa)})
    print_table(f"kl_project + thin_mix vs scaled_dot_product_attention ({device.type}, float32, "
                f"d={d}, projection included; speedup: the median over rounds timing SDPA and "
                f"the mixers in turn, and its range)", rows,
                ["n", "r", "heads", "mixer_ms", "sdpa_ms", "speedup_vs_sdpa", "speedup range",
                 "mixer_peak_MiB", "sdpa_peak_MiB"])
    crossover = {}
    for r in ranks:
        faster = [row["n"] for row in rows if row["r"] == r and row["speedup_vs_sdpa"] > 1]
        crossover[r] = min(faster) if faster else None
    print(f"crossover n (smallest n measured where the mixer beats SDPA), per r: {crossover}")
    return {"rows": rows, "crossover_n": crossover}


def bench_thin_mix(device, quick: bool):
    heads, r, d = (32, 16, 64) if device.type == "cuda" else (8, 16, 64)
    ns = [1024, 4096] if quick else [1024, 4096, 16384] + ([65536] if device.type == "cuda" else [])
    rows = []
    for n in ns:
        g = torch.Generator().manual_seed(n)
        U = torch.softmax(torch.randn(1, heads, n, r, generator=g), -1).to(device)
        V = torch.softmax(torch.randn(1, heads, n, r, generator=g), -1).to(device)
        X = torch.randn(1, heads, n, d, generator=g).to(device)
        ours = timeit(lambda: ops.thin_mix(U, V, X), device)
        eager = timeit(lambda: U @ ((V.mT @ X) / U.sum(-2)[..., None]), device)
        row = {"n": n, "r": r, "heads": heads, "thin_mix_ms": 1e3 * ours,
               "eager_ms": 1e3 * eager, "vs_eager": eager / ours,
               "peak_MiB": mib(peak_bytes(lambda: ops.thin_mix(U, V, X), device))}
        if n <= 4096:
            dense = timeit(lambda: ((U / U.sum(-2, keepdim=True)) @ V.mT) @ X, device,
                           min_time=0.0, max_repeat=3)
            row.update(dense_ms=1e3 * dense, vs_dense=dense / ours)
        if device.type == "cuda":
            moved = 4 * heads * n * (2 * r + 2 * d)  # U, V, X read and Y written once
            row["roofline_ratio"] = ours / (moved / 4.3e12)
        rows.append(row)
    print_table(f"thin_mix ({device.type}, float32): eager U @ ((V^T X) / g) and dense W @ X",
                rows, ["n", "r", "heads", "thin_mix_ms", "eager_ms", "vs_eager", "dense_ms",
                       "vs_dense", "peak_MiB", "roofline_ratio"])
    return rows


def run(device: torch.device, quick: bool = False, big: bool = False) -> dict:
    from . import mixer_tower
    return {"projection": bench_projection(quick) if device.type == "cpu" else None,
            "mixer_vs_sdpa": bench_mixer(device, quick),
            "thin_mix": bench_thin_mix(device, quick),
            **({"vision_tower": mixer_tower.bench_tower(device, quick, big),
                "tower_tolerance": mixer_tower.bench_tolerance(device, quick)}
               if _has_transformers() else {})}


def _has_transformers() -> bool:
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        print("(transformers not installed: the vision-tower cases are skipped)")
        return False
    return True
