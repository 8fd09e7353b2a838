"""VAS benchmarks: the ops beside the reference NumPy code and the best eager PyTorch
formulation, in one run (ratios are for reading, never assertions).

* seed: ``extract_vas`` of the reference implementation, vas_reference.py in
  ../shared/seeds/ (skipped with a note when the folder is absent), against
  ``headscope.vas_features`` at B = 1, L = 4, H = 8, T = 512, Dh = 64, for dense and
  causal attention;
* eager: batched matmuls and reductions that materialise T x T per head, at T = 2048;
* growth: time and extra peak memory of vas_head_stats and vas_head_stats_qk (causal)
  from T = 512 to 8192;
* on the CPU: one grouped-query layer (H = 8, Hkv = 4) at T = 512 and 2048: the qk op beside
  vas_head_stats on the layer's attention and beside one SDPA call;
* window: vas_head_stats_qk at T = 8192 with a sliding window of 1024 keys beside no window
  and beside the best eager formulation with the materialised mask (headscope.pattern_mask,
  softmax, eager_head_stats): time and peak memory;
* aggregate: vas_aggregate beside the same statistics written as ATen ops (aten_aggregate),
  the composite it would be if the kernel were not faster;
* on CUDA: one Qwen2.5-VL-7B-sized layer (B = 1, H = 28, T = 4096, Dh = 128) against the
  roofline of the materialised-attention op, and vas_head_stats_qk against one SDPA call.
"""
from __future__ import annotations

import statistics
import types

import torch
import torch.nn.functional as F

from ..patterns import pattern_mask as headscope_pattern_mask
from ._util import load_seed, mib, peak_bytes, print_table, window_row
from ..timing import interleaved, round_ratios, timeit

ops = torch.ops.headscope


def _threads(n: int):
    class _Ctx:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)
    return _Ctx()


def _attention(B, H, T, causal, gen, device, sharpness=2.0):
    logits = torch.randn(B, H, T, T, generator=gen) * sharpness
    if causal:
        logits.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, -1).to(device)


def eager_head_stats(A: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Best eager formulation for full-length sequences: (B, H, 3), materialising the value
    Gram and the centred matrices (T x T per head)."""
    Vn = V / V.norm(dim=-1, keepdim=True).clamp_min(1e-9)
    S = torch.matmul(Vn, Vn.transpose(-1, -2)).add_(1.0).mul_(0.5)

    def center(K):
        return K - K.mean(-2, keepdim=True) - K.mean(-1, keepdim=True) + K.mean((-2, -1), keepdim=True)

    Ac, Sc = center(A), center(S)
    na, ns = A.flatten(-2).norm(dim=-1), S.flatten(-2).norm(dim=-1)
    d = (Ac - Sc).flatten(-2).norm(dim=-1) / (na * ns).clamp_min(1e-9)
    num = (Ac * Sc).sum((-2, -1))
    c = num / ((Ac * Ac).sum((-2, -1)) * (Sc * Sc).sum((-2, -1))).sqrt().clamp_min(1e-12)
    p = (A / A.sum(-1).amax(-1)[..., None, None].clamp_min(1e-12)).clamp_min(1e-12)
    q = (S / S.sum(-1).amax(-1)[..., None, None].clamp_min(1e-12)).clamp_min(1e-12)
    r = (p * (p / q).log()).sum(-1).mean(-1)
    return torch.stack([d, c, r], -1)


def _seed_section(device, quick, results):
    seed = load_seed("vas_reference")
    B, L, H, T, Dh = 1, (2 if quick else 4), 8, 512, 64
    gen = torch.Generator().manual_seed(0)
    rows = []
    for causal in (False, True):
        attn = [_attention(B, H, T, causal, gen, "cpu") for _ in range(L)]
        hw = [torch.randn(B, H, T, Dh, generator=gen) for _ in range(L)]
        mask = torch.ones(B, T, dtype=torch.long)
        attn_d, hw_d, mask_d = [a.to(device) for a in attn], [v.to(device) for v in hw], mask.to(device)
        op = lambda: ops.vas_aggregate(torch.stack(  # noqa: E731
            [ops.vas_head_stats(a, v, mask_d.sum(-1)) for a, v in zip(attn_d, hw_d)], 1))
        fns = {"op": op}
        if device.type == "cpu":
            def op_1_thread():
                with _threads(1):
                    return op()
            fns["op 1-thread"] = op_1_thread
        if seed is not None:
            cache = types.SimpleNamespace(attn_weights=attn, head_writes=hw)
            ids = torch.zeros(B, T, dtype=torch.long)
            fns["seed"] = lambda: seed.extract_vas(None, ids, mask, cache)
        # the reference and the op in alternation: a ratio of one round compares like with like
        times = interleaved(fns, device, rounds=3 if quick else 7, calls={"op": 5, "op 1-thread": 3})
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row = {"attention": "causal" if causal else "dense", "op ms": ms["op"],
               "op ms/head": ms["op"] / (L * H)}
        if "op 1-thread" in ms:
            row["op 1-thread ms/head"] = ms["op 1-thread"] / (L * H)
        if seed is not None:
            feats_seed, _ = fns["seed"]()
            import headscope
            feats, _ = headscope.vas_features(attn_d, hw_d, mask_d)
            f, e = feats.cpu().double(), torch.from_numpy(feats_seed).double()
            err = (f - e).abs()
            big = e.abs() >= 1e-3
            rel = (err[big] / e.abs()[big]).max().item() if big.any() else 0.0
            tol = (err / (1e-6 + 1e-4 * e.abs())).max().item()  # <= 1: within the tolerance
            speedup, lo, hi = round_ratios(times["seed"], times["op"])
            row.update({"seed ms": ms["seed"], "seed ms/head": ms["seed"] / (L * H),
                        "speedup": speedup, "speedup range": f"{lo:.1f}-{hi:.1f}",
                        "max rel err": rel, "err/tol": tol})
            if "op 1-thread" in times:
                row["speedup 1-thread"] = round_ratios(times["seed"], times["op 1-thread"])[0]
        rows.append(row)
    print_table(f"vas vs seed extract_vas (B={B}, L={L}, H={H}, T={T}, Dh={Dh}, {device}; speedup: the "
                f"median over rounds timing seed and op in turn, and its range; max rel err "
                f"over features >= 1e-3, err/tol = max |err| / (1e-6 + 1e-4 |seed|))", rows,
                ["attention", "seed ms", "op ms", "seed ms/head", "op ms/head", "op 1-thread ms/head",
                 "speedup", "speedup range", "speedup 1-thread", "max rel err", "err/tol"])
    results["seed"] = rows


def _eager_section(device, quick, results):
    B, H, Dh = 1, (2 if quick else 4), 64
    rows = []
    for T in ((1024,) if quick else (2048,)):
        for causal in (True, False):
            gen = torch.Generator().manual_seed(T)
            A = _attention(B, H, T, causal, gen, device)
            V = torch.randn(B, H, T, Dh, generator=gen).to(device)
            lengths = torch.full((B,), T, device=device)
            op = lambda: ops.vas_head_stats(A, V, lengths)  # noqa: E731
            eager = lambda: eager_head_stats(A, V)  # noqa: E731
            t_op, t_eager = timeit(op, device), timeit(eager, device, min_time=0.0)
            m_op, m_eager = peak_bytes(op, device), peak_bytes(eager, device)
            err = (op() - eager()).abs().max().item()
            rows.append({"T": T, "attention": "causal" if causal else "dense", "op ms": t_op * 1e3,
                         "eager ms": t_eager * 1e3, "speedup": t_eager / t_op,
                         "op MiB": mib(m_op), "eager MiB": mib(m_eager),
                         "memory ratio": m_eager / max(m_op, 1), "max abs diff": err})
    print_table(f"vas_head_stats vs eager PyTorch (B={B}, H={H}, Dh={Dh}, {device}; "
                f"input attention {mib(B * H * rows[0]['T'] ** 2 * 4):.0f} MiB)", rows,
                ["T", "attention", "op ms", "eager ms", "speedup", "op MiB", "eager MiB",
                 "memory ratio", "max abs diff"])
    results["eager"] = rows


def _growth_row(B, H, T, Dh, D, device):
    """One row of the growth table (its T x T input freed on return)."""
    gen = torch.Generator().manual_seed(T)
    A = _attention(B, H, T, True, gen, device)
    V = torch.randn(B, H, T, Dh, generator=gen).to(device)
    q = torch.randn(B, H, T, D, generator=gen).to(device)
    k = torch.randn(B, H, T, D, generator=gen).to(device)
    lengths = torch.full((B,), T, device=device)
    op = lambda: ops.vas_head_stats(A, V, lengths)  # noqa: E731
    op_qk = lambda: ops.vas_head_stats_qk(q, k, V, lengths, D ** -0.5, True)  # noqa: E731
    t, t_qk = timeit(op, device, min_time=0.0), timeit(op_qk, device, min_time=0.0)
    m, m_qk = peak_bytes(op, device), peak_bytes(op_qk, device)
    return {"T": T, "attn ms": t * 1e3, "qk ms": t_qk * 1e3,
            "attn ns/entry": t * 1e9 / T ** 2, "qk ns/entry": t_qk * 1e9 / T ** 2,
            "attn extra MiB": mib(m), "qk extra MiB": mib(m_qk), "input attn MiB": mib(T * T * 4)}


def _growth_section(device, quick, results):
    B, H, Dh, D = 1, 1, 64, 64
    Ts = (512, 1024, 2048) if quick else (512, 1024, 2048, 4096, 8192)
    rows = [_growth_row(B, H, T, Dh, D, device) for T in Ts]
    print_table(f"growth with T (causal, B={B}, H={H}, Dh={Dh}, D={D}, {device})", rows,
                ["T", "attn ms", "qk ms", "attn ns/entry", "qk ns/entry", "attn extra MiB",
                 "qk extra MiB", "input attn MiB"])
    results["growth"] = rows


def _layer_row(B, H, Hkv, T, D, device, quick):
    """One row of the one-layer table (its T x T attention freed on return)."""
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(B, H, T, D, generator=gen).to(device)
    k, v = (torch.randn(B, Hkv, T, D, generator=gen).to(device) for _ in range(2))
    V = torch.randn(B, H, T, D, generator=gen).to(device)
    lengths = torch.full((B,), T, device=device)
    A = torch.softmax((q @ k.repeat_interleave(H // Hkv, 1).transpose(-1, -2)) * D ** -0.5
                      + torch.full((T, T), float("-inf"), device=device).triu(1), -1)
    times = interleaved({
        "qk": lambda: ops.vas_head_stats_qk(q, k, V, lengths, D ** -0.5, True),
        "attn": lambda: ops.vas_head_stats(A, V, lengths),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }, device, rounds=3 if quick else 5, calls={"qk": 3, "attn": 3, "sdpa": 3}, pause=0.0)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"T": T, "qk ms/head": ms["qk"] / H, "attn op ms/head": ms["attn"] / H,
            "qk / attn op": round_ratios(times["qk"], times["attn"])[0], "sdpa ms": ms["sdpa"],
            "qk / sdpa": round_ratios(times["qk"], times["sdpa"])[0]}


def _layer_section(device, quick, results):
    """One grouped-query layer (the qk op's whole-heads path: H >= 2 x threads): the qk op
    beside vas_head_stats on the same layer's attention and one SDPA call on q, k, v."""
    B, H, Hkv, D = 1, 8, 4, 64
    rows = [_layer_row(B, H, Hkv, T, D, device, quick) for T in ((512,) if quick else (512, 2048))]
    print_table(f"one layer, causal, float32 (B={B}, H={H}, Hkv={Hkv}, D=Dh={D}, {device}; ratios: "
                f"medians over rounds timing the three in turn)", rows,
                list(rows[0]))
    results["layer"] = rows


def eager_masked_head_stats(q, k, V, keep, scale):
    """The best eager formulation under an attention pattern: logits of every (query, key)
    pair, the materialised mask (B, T, T), softmax, eager_head_stats."""
    logits = torch.matmul(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2))
    A = torch.softmax(logits.mul_(scale).masked_fill_(~keep[:, None], float("-inf")), -1)
    return eager_head_stats(A, V)


def _window_section(device, quick, results):
    """A sliding window (Gemma's sliding layers, Mistral): the qk op's cost grows with
    T * window, not T^2, and nothing of size T x T is formed."""
    B, H, D, Dh = 1, 2, 64, 64
    T, window = (1024, 128) if quick else (8192, 1024)
    gen = torch.Generator().manual_seed(T)
    q, k, V = (torch.randn(B, H, T, d, generator=gen).to(device) for d in (D, D, Dh))
    lengths = torch.full((B,), T, device=device)
    keep = headscope_pattern_mask(T, T, window=window, device=device)
    fns = {
        "window": lambda: ops.vas_head_stats_qk(q, k, V, lengths, D ** -0.5, True, None, None,
                                                window),
        "no window": lambda: ops.vas_head_stats_qk(q, k, V, lengths, D ** -0.5, True),
        "eager": lambda: eager_masked_head_stats(q, k, V, keep, D ** -0.5),
    }
    err = (fns["window"]() - fns["eager"]()).abs().max().item()
    times = interleaved(fns, device, rounds=2 if quick else 3, pause=0.0)
    mem = {name: peak_bytes(fn, device) for name, fn in fns.items()}
    row = dict(window_row(T, window, times, mem), **{"max abs diff": err})
    print_table(f"vas_head_stats_qk with a sliding window (causal, B={B}, H={H}, D=Dh={D}, "
                f"{device}; eager: the materialised mask, softmax and eager_head_stats; time "
                f"ratios: medians over rounds timing the three in turn)", [row], list(row))
    results["window"] = row


def aten_aggregate(head_stats: torch.Tensor) -> torch.Tensor:
    """vas_aggregate as ATen ops (every backend): the per-layer mean, population std, max and
    min over heads, stored as float32 as the reference does, then their mean, std and max
    over layers, (B, 36)."""
    x = head_stats.double()
    std, mean = torch.std_mean(x, 2, correction=0)
    layer = torch.stack([mean, std, x.amax(2), x.amin(2)], -1).float().double()  # (B, L, 3, 4)
    std_l, mean_l = torch.std_mean(layer, 1, correction=0)
    return torch.stack([mean_l, std_l, layer.amax(1)], -1).reshape(x.shape[0], 36).float()


def _aggregate_section(device, quick, results):
    rows = []
    for B, L, H in ((1, 28, 28), (64, 28, 28)):
        stats = torch.rand(B, L, H, 3, generator=torch.Generator().manual_seed(B)).to(device)
        diff = (ops.vas_aggregate(stats) - aten_aggregate(stats)).abs().max().item()
        times = interleaved({"kernel": lambda: ops.vas_aggregate(stats),
                             "aten": lambda: aten_aggregate(stats)},
                            device, rounds=3 if quick else 7, calls={"kernel": 20, "aten": 20})
        rows.append({"B": B, "L": L, "H": H,
                     "kernel us": statistics.median(times["kernel"]) * 1e6,
                     "aten us": statistics.median(times["aten"]) * 1e6,
                     "aten / kernel": round_ratios(times["aten"], times["kernel"])[0],
                     "max abs diff": diff})
    print_table(f"vas_aggregate: the kernel beside the same statistics as ATen ops ({device}; ratio: "
                f"median over rounds timing both in turn)", rows, list(rows[0]))
    results["aggregate"] = rows


def _cuda_layer_section(device, quick, results):
    B, H, T, Dh = 1, 28, (1024 if quick else 4096), 128
    gen = torch.Generator(device=device).manual_seed(0)
    A = torch.softmax(torch.randn(B, H, T, T, device=device, generator=gen), -1)
    V = torch.randn(B, H, T, Dh, device=device, generator=gen)
    q = torch.randn(B, H, T, Dh, device=device, generator=gen)
    k = torch.randn(B, 4, T, Dh, device=device, generator=gen)
    v = torch.randn(B, 4, T, Dh, device=device, generator=gen)
    lengths = torch.full((B,), T, device=device)
    flops = 2 * B * H * T * T * Dh  # the Gram tiles (once per unordered pair: half of it is the bound)
    # float32 inputs: the tensor-core peak that applies is TF32 (H100/H200 SXM: ~495 TFLOP/s
    # dense); 4.3 TB/s is the H200 bandwidth. The Gram tiles need half of `flops`.
    name = torch.cuda.get_device_name()
    peak = 495e12 if ("H100" in name or "H200" in name) else 100e12
    rows = []
    for Ad in (A, A.bfloat16()):
        t = timeit(lambda: ops.vas_head_stats(Ad, V, lengths), device)
        t_read = timeit(lambda: Ad.sum(), device)  # one read of A: the bandwidth this card reaches
        roofline = max((Ad.numel() * Ad.element_size() + V.numel() * 4) / 4.3e12, flops / 2 / peak)
        rows.append({"attn dtype": str(Ad.dtype).replace("torch.", ""), "op ms": t * 1e3,
                     "roofline ms": roofline * 1e3, "x roofline": t / roofline,
                     "A.sum() ms": t_read * 1e3})
    print_table(f"vas_head_stats, one layer on {name} (B={B}, H={H}, T={T}, Dh={Dh})", rows, list(rows[0]))
    t_qk = timeit(lambda: ops.vas_head_stats_qk(q, k, V, lengths, Dh ** -0.5, True), device)
    t_sdpa = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), device)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    t_sdpa_bf16 = timeit(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True),
                         device)
    qk_row = {"qk ms": t_qk * 1e3, "sdpa ms": t_sdpa * 1e3, "qk / sdpa": t_qk / t_sdpa,
              "sdpa bf16 ms": t_sdpa_bf16 * 1e3}
    print_table("vas_head_stats_qk (float32, causal, Hkv=4) against one SDPA call on the same q, k, v",
                [qk_row], list(qk_row))
    results["cuda_layer"] = {"attn": rows, "qk": qk_row}


def run(device: torch.device, quick: bool) -> dict:
    device = torch.device(device)
    results: dict = {}
    print(f"\n# vas on {device} ({torch.get_num_threads()} CPU threads)")
    _seed_section(device, quick, results)
    _eager_section(device, quick, results)
    _growth_section(device, quick, results)
    _window_section(device, quick, results)
    _aggregate_section(device, quick, results)
    if device.type == "cpu":
        _layer_section(device, quick, results)
    if device.type == "cuda":
        _cuda_layer_section(device, quick, results)
    return results
