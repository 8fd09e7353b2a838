"""Attribution benchmarks (vStream), per generated token at one decode step:

* region_pool_qk (all layers, from q and the key cache) against the best eager PyTorch
  formulation (grouped heads without copying K, one matmul, softmax, index_add over
  regions) and against one scaled_dot_product_attention decode call per layer;
* region_pool (from given attention probabilities) against its eager formulation;
* features and scores for all layers (region_pool_qk per layer + linear_attribution);
* key_weights (per-key factors such as value norms, one (1, H, Tk) tensor per layer) against
  none: region_pool_qk_layers and region_pool, the ratio of their times;
* linear_attribution against ``((f - mean) / std) @ w + b`` written out and, on the CPU,
  against the ATen composite that is its forward on the other backends;
* ward_regions against scikit-learn's AgglomerativeClustering (grid connectivity);
* region_pool_qk over a whole prefill (every query of T = 8192 in the span) with a sliding
  window of 1024 keys, beside no window and beside the best eager formulation with the
  materialised mask (headscope.pattern_mask): time and peak memory.

Sizes: L = 28 layers, H = 28 query heads, Hkv = 4, D = 128, Tk = 4096
keys of which 1024 are image tokens in K = 64 regions; one K/V cache per layer.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from ..patterns import pattern_mask
from ._util import mib, peak_bytes, print_table, window_row
from ..timing import interleaved, round_ratios, timeit

ops = torch.ops.headscope


def _decode_setup(device, quick: bool, dtype=torch.float32):
    L, H, Hkv, D, Tk, n_img, K = (4, 28, 4, 128, 4096, 1024, 64) if quick else \
        (28, 28, 4, 128, 4096, 1024, 64)
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(1, H, 1, D, generator=g, dtype=dtype).to(device) for _ in range(L)]
    ks = [torch.randn(1, Hkv, Tk, D, generator=g, dtype=dtype).to(device) for _ in range(L)]
    vs = [torch.randn(1, Hkv, Tk, D, generator=g, dtype=dtype).to(device) for _ in range(L)]
    # image tokens: a contiguous block after a short system prompt, regions of 16 tokens
    rid = torch.full((1, Tk), -1, dtype=torch.long)
    start = 64
    rid[0, start:start + n_img] = torch.arange(n_img) * K // n_img
    rid = rid.to(device)
    w = torch.ones(1, 1, device=device)
    return dict(L=L, H=H, Hkv=Hkv, D=D, Tk=Tk, n_img=n_img, K=K, qs=qs, ks=ks, vs=vs, rid=rid,
                w=w, scale=1.0 / math.sqrt(D))


def eager_pool_qk(q, k, rid_img_pos, rid_img_reg, K, scale):
    """Best eager formulation: (B, Hkv, G, D) @ (B, Hkv, D, Tk) (K not repeated), softmax,
    index_add of the image tokens' probabilities into their regions."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    s = torch.matmul(q.view(B, Hkv, G * Tq, D), k.transpose(-1, -2)) * scale
    p = torch.softmax(s, -1)
    pooled = p.new_zeros(B, Hkv, G * Tq, K).index_add_(-1, rid_img_reg, p[..., rid_img_pos])
    return pooled.view(B, H, K).transpose(1, 2)  # (B, K, H), Tq = 1


def eager_pool(attn, rid_img_pos, rid_img_reg, K):
    B, H, Tq, Tk = attn.shape
    pooled = attn.new_zeros(B, H, Tq, K).index_add_(-1, rid_img_reg, attn[..., rid_img_pos])
    return pooled.mean(2).transpose(1, 2)


def bench_decode(device, quick: bool) -> dict:
    s = _decode_setup(device, quick)
    L, K, rid, w, scale = s["L"], s["K"], s["rid"], s["w"], s["scale"]
    img_pos = (rid[0] >= 0).nonzero().squeeze(1)
    img_reg = rid[0, img_pos]
    qs, ks, vs = s["qs"], s["ks"], s["vs"]
    # correctness of what is timed
    ref = eager_pool_qk(qs[0], ks[0], img_pos, img_reg, K, scale)
    got = ops.region_pool_qk(qs[0], ks[0], w, rid, K, scale, False, None, "sum")
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)

    def run_qk():
        return [ops.region_pool_qk(qs[i], ks[i], w, rid, K, scale, False, None, "sum")
                for i in range(L)]

    def run_layers():
        return ops.region_pool_qk_layers(qs, ks, w, rid, K, [scale] * L, False, None, "sum")

    assert torch.equal(run_layers(), torch.cat(run_qk(), 2))

    def run_eager_qk():
        return [eager_pool_qk(qs[i], ks[i], img_pos, img_reg, K, scale) for i in range(L)]

    def run_sdpa():
        return [F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True)
                for i in range(L)]

    head_w = torch.randn(L * s["H"], device=device)
    head_mu = torch.zeros(L * s["H"], device=device)
    head_sd = torch.ones(L * s["H"], device=device)

    def run_features_and_scores():
        return ops.linear_attribution(run_layers(), head_w, head_mu, head_sd)  # (1, K)

    kw = dict(warmup=2, min_time=1.0 if not quick else 0.3, max_repeat=30)
    t_qk = timeit(run_qk, device, **kw)
    t_layers = timeit(run_layers, device, **kw)
    t_eager = timeit(run_eager_qk, device, **kw)
    t_sdpa = timeit(run_sdpa, device, **kw)
    t_full = timeit(run_features_and_scores, device, **kw)
    # region_pool from given probabilities (eager attention keeps them)
    attns = [torch.softmax(torch.matmul(qs[i].view(1, s["Hkv"], -1, s["D"]),
                                        ks[i].transpose(-1, -2)) * scale, -1)
             .view(1, s["H"], 1, s["Tk"]) for i in range(L)]
    torch.testing.assert_close(ops.region_pool(attns[0], w, rid, K, "sum"),
                               eager_pool(attns[0], img_pos, img_reg, K), rtol=1e-5, atol=1e-7)
    t_pool = timeit(lambda: [ops.region_pool(a, w, rid, K, "sum") for a in attns], device, **kw)
    t_pool_eager = timeit(lambda: [eager_pool(a, img_pos, img_reg, K) for a in attns], device,
                          **kw)
    one = lambda f: (lambda: f(0))  # noqa: E731
    m_qk = peak_bytes(one(lambda i: ops.region_pool_qk(qs[i], ks[i], w, rid, K, scale, False,
                                                       None, "sum")), device)
    m_eager = peak_bytes(one(lambda i: eager_pool_qk(qs[i], ks[i], img_pos, img_reg, K, scale)),
                         device)
    m_sdpa = peak_bytes(one(lambda i: F.scaled_dot_product_attention(qs[i], ks[i], vs[i],
                                                                     enable_gqa=True)), device)
    rows = [
        {"what": "region_pool_qk", "ms_per_token": 1e3 * t_qk, "eager_ms": 1e3 * t_eager,
         "vs_eager": t_eager / t_qk, "sdpa_ms": 1e3 * t_sdpa, "vs_sdpa": t_sdpa / t_qk,
         "peak_MiB_1_layer": mib(m_qk), "eager_peak_MiB": mib(m_eager),
         "sdpa_peak_MiB": mib(m_sdpa)},
        {"what": "region_pool_qk_layers (one call)", "ms_per_token": 1e3 * t_layers,
         "eager_ms": 1e3 * t_eager, "vs_eager": t_eager / t_layers, "sdpa_ms": 1e3 * t_sdpa,
         "vs_sdpa": t_sdpa / t_layers},
        {"what": "region_pool (given probs)", "ms_per_token": 1e3 * t_pool,
         "eager_ms": 1e3 * t_pool_eager, "vs_eager": t_pool_eager / t_pool},
        {"what": "features+scores (qk, all layers)", "ms_per_token": 1e3 * t_full},
    ]
    print_table(f"decode step, per generated token: L={L} layers, H={s['H']}, Hkv={s['Hkv']}, "
                f"D={s['D']}, Tk={s['Tk']}, {s['n_img']} image tokens, K={K} "
                f"({device.type}, float32)", rows,
                ["what", "ms_per_token", "eager_ms", "vs_eager", "sdpa_ms", "vs_sdpa",
                 "peak_MiB_1_layer", "eager_peak_MiB", "sdpa_peak_MiB"])
    return {"layers": L, "region_pool_qk_ms": 1e3 * t_qk, "eager_qk_ms": 1e3 * t_eager,
            "qk_vs_eager": t_eager / t_qk, "sdpa_ms": 1e3 * t_sdpa, "qk_vs_sdpa": t_sdpa / t_qk,
            "region_pool_qk_layers_ms": 1e3 * t_layers, "layers_vs_per_layer": t_qk / t_layers,
            "region_pool_ms": 1e3 * t_pool, "eager_pool_ms": 1e3 * t_pool_eager,
            "pool_vs_eager": t_pool_eager / t_pool, "features_and_scores_ms": 1e3 * t_full,
            "qk_peak_MiB": mib(m_qk), "eager_peak_MiB": mib(m_eager), "sdpa_peak_MiB": mib(m_sdpa)}


def bench_key_weights(device, quick: bool) -> list[dict]:
    """The cost of key_weights at one decode step: region_pool_qk_layers (all layers) and
    region_pool (one layer's probabilities) with per-head factors against without, timed
    in alternating rounds; the ratio is the median of the rounds' ratios."""
    s = _decode_setup(device, quick)
    L, H, K, rid, w, scale = s["L"], s["H"], s["K"], s["rid"], s["w"], s["scale"]
    qs, ks = s["qs"], s["ks"]
    g = torch.Generator().manual_seed(2)
    factors = [torch.rand(1, H, s["Tk"], generator=g).to(device) for _ in range(L)]
    attn = torch.softmax(torch.randn(1, H, 1, s["Tk"], generator=g), -1).to(device)
    cases = {
        "region_pool_qk_layers": (
            lambda: ops.region_pool_qk_layers(qs, ks, w, rid, K, [scale] * L, False, None, "sum"),
            lambda: ops.region_pool_qk_layers(qs, ks, w, rid, K, [scale] * L, False, None, "sum",
                                              None, None, None, None, True, factors)),
        "region_pool (1 layer)": (
            lambda: ops.region_pool(attn, w, rid, K, "sum"),
            lambda: ops.region_pool(attn, w, rid, K, "sum", factors[0])),
    }
    rows = []
    for what, (plain, weighted) in cases.items():
        times = interleaved({"plain": plain, "weighted": weighted}, device,
                            rounds=3 if quick else 7, pause=0.05)
        ratio, low, high = round_ratios(times["weighted"], times["plain"])
        rows.append({"what": what, "ms": 1e3 * statistics.median(times["plain"]),
                     "key_weights_ms": 1e3 * statistics.median(times["weighted"]),
                     "ratio": ratio, "ratio_range": f"{low:.2f}-{high:.2f}"})
    print_table(f"key_weights vs none, decode step: L={L}, H={H}, Hkv={s['Hkv']}, Tk={s['Tk']}, "
                f"{s['n_img']} image tokens, K={K} ({device.type}, float32; ratio: median over "
                "alternating rounds)", rows,
                ["what", "ms", "key_weights_ms", "ratio", "ratio_range"])
    return rows


def bench_linear(device, quick: bool) -> list[dict]:
    """linear_attribution on the scores of one decode step (K = 64 regions of a 28-layer,
    28-head model) and of many rows (a fit's or an evaluation's batch), against the eager
    formula and, on the CPU, against the ATen composite that the other backends run."""
    F = 28 * 28
    g = torch.Generator().manual_seed(1)
    w, mu = torch.randn(F, generator=g).to(device), torch.randn(F, generator=g).to(device)
    sd = (torch.rand(F, generator=g) + 0.5).to(device)
    b = torch.tensor(0.5, device=device)
    op = ops.linear_attribution.default
    rows = []
    for shape, calls in (((1, 64, F), 200), ((1, 4096, F), 10), ((8, 512, F), 10)):
        f = torch.randn(*shape, generator=g).to(device)
        fns = {"op": lambda: op(f, w, mu, sd, b), "eager": lambda: ((f - mu) / sd) @ w + b}
        if device.type == "cpu":  # elsewhere the composite is the op's forward
            fns["composite"] = lambda: op._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd,
                                                 f, w, mu, sd, b)
        for fn in fns.values():
            torch.testing.assert_close(fn(), fns["op"](), rtol=1e-5, atol=1e-4)
        times = interleaved(fns, device, rounds=3 if quick else 7,
                            calls={name: calls for name in fns}, pause=0.05)
        row = {"features": "x".join(map(str, shape)),
               "ms": 1e3 * statistics.median(times["op"]),
               "eager_ms": 1e3 * statistics.median(times["eager"]),
               "vs_eager": round_ratios(times["eager"], times["op"])[0]}
        if "composite" in times:
            ratio, low, high = round_ratios(times["composite"], times["op"])
            row.update({"composite_ms": 1e3 * statistics.median(times["composite"]),
                        "vs_composite": ratio, "vs_composite_range": f"{low:.2f}-{high:.2f}"})
        rows.append(row)
    print_table(f"linear_attribution, F = {F} ({device.type}, float32; ratios: median over "
                "alternating rounds)", rows,
                ["features", "ms", "eager_ms", "vs_eager", "composite_ms", "vs_composite",
                 "vs_composite_range"])
    return rows


def bench_ward(quick: bool) -> dict:
    try:
        from sklearn.cluster import AgglomerativeClustering
        from sklearn.feature_extraction.image import grid_to_graph
        from sklearn.metrics import adjusted_rand_score
    except ImportError:
        print("\n== ward_regions: scikit-learn not installed, skipped")
        return {}
    h = w = 16 if quick else 32
    C, K = 256, 32
    g = torch.Generator().manual_seed(0)
    X = torch.randn(h * w, C, generator=g)
    conn = grid_to_graph(h, w)
    Xn = X.numpy()

    def sk():
        return AgglomerativeClustering(n_clusters=K, linkage="ward", connectivity=conn).fit(Xn)

    # in alternating rounds: the ratios of one round compare like with like
    times = interleaved({"ours": lambda: ops.ward_regions(X, h, w, K), "sklearn": sk},
                        rounds=3 if quick else 5, calls={"ours": 5, "sklearn": 3})
    ari = adjusted_rand_score(sk().labels_, ops.ward_regions(X, h, w, K).numpy())
    row = {"grid": f"{h}x{w}", "C": C, "K": K,
           "headscope_ms": 1e3 * statistics.median(times["ours"]),
           "sklearn_ms": 1e3 * statistics.median(times["sklearn"]),
           "vs_sklearn": round_ratios(times["sklearn"], times["ours"])[0], "ARI": ari,
           "headscope_peak_MiB": mib(peak_bytes(lambda: ops.ward_regions(X, h, w, K))),
           "sklearn_peak_MiB": mib(peak_bytes(sk))}
    print_table("ward_regions vs scikit-learn AgglomerativeClustering(ward, grid_to_graph)",
                [row], list(row))
    return row


def eager_masked_pool(q, k, keep, rid_img_pos, rid_img_reg, K, scale):
    """The best eager formulation under an attention pattern: grouped heads without
    repeating K, one matmul, the materialised mask (B, Tq, Tk), softmax, index_add of the
    image tokens' probabilities into their regions, the mean over the span's queries."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    s = torch.matmul(q.view(B, Hkv, H // Hkv * Tq, D), k.transpose(-1, -2)).mul_(scale)
    s = s.view(B, Hkv, H // Hkv, Tq, -1).masked_fill_(~keep[:, None, None], float("-inf"))
    p = torch.softmax(s, -1).view(B, H, Tq, -1)
    pooled = p.new_zeros(B, H, Tq, K).index_add_(-1, rid_img_reg, p[..., rid_img_pos])
    return pooled.mean(2).transpose(1, 2)


def bench_window(device, quick: bool) -> dict:
    """A sliding window: the pooled attention of every query of a prefill; the op's cost
    grows with T * window."""
    H, Hkv, D, K = 4, 2, 64, 16
    T, window = (1024, 128) if quick else (8192, 1024)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, H, T, D, generator=g).to(device)
    k = torch.randn(1, Hkv, T, D, generator=g).to(device)
    rid = torch.full((1, T), -1, dtype=torch.long)
    rid[0, T // 8:T // 8 + T // 4] = torch.arange(T // 4) * K // (T // 4)  # an image
    rid = rid.to(device)
    img_pos = (rid[0] >= 0).nonzero().squeeze(1)
    img_reg = rid[0, img_pos]
    w = torch.ones(1, T, device=device)
    keep = pattern_mask(T, T, window=window, device=device)
    scale = D ** -0.5
    fns = {
        "window": lambda: ops.region_pool_qk(q, k, w, rid, K, scale, True, None, "sum", window),
        "no window": lambda: ops.region_pool_qk(q, k, w, rid, K, scale, True, None, "sum"),
        "eager": lambda: eager_masked_pool(q, k, keep, img_pos, img_reg, K, scale),
    }
    torch.testing.assert_close(fns["window"](), fns["eager"](), rtol=1e-4, atol=1e-6)
    times = interleaved(fns, device, rounds=2 if quick else 3, pause=0.0)
    mem = {name: peak_bytes(fn, device) for name, fn in fns.items()}
    row = window_row(T, window, times, mem)
    print_table(f"region_pool_qk of a whole prefill with a sliding window (causal, H={H}, "
                f"Hkv={Hkv}, D={D}, K={K}, {device.type}, float32; eager: the materialised "
                f"mask, softmax, index_add; time ratios: medians over rounds timing the three "
                f"in turn)", [row], list(row))
    return row


def run(device: torch.device, quick: bool) -> dict:
    t0 = time.perf_counter()
    out = {"decode": bench_decode(device, quick),
           "key_weights": bench_key_weights(device, quick),
           "linear": bench_linear(device, quick),
           "ward": bench_ward(quick), "window": bench_window(device, quick)}
    print(f"\nattribution benchmarks: {time.perf_counter() - t0:.1f} s")
    return out
