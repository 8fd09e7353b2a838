"""Attention patterns of the q/k ops (vas_head_stats_qk, region_pool_qk,
region_pool_qk_layers): sliding windows, chunks, bidirectional blocks and logit
soft-capping, against the materialised mask (headscope.pattern_mask), which is itself
checked against transformers' masking_utils; bad pattern arguments; opcheck and
torch.compile with pattern arguments."""
from __future__ import annotations

import pytest
import torch

import headscope
import vas_reference_impl as ref
from test_attribution import random_regions, ref_region_pool
from test_vas import assert_close

OPS = torch.ops.headscope


def two_blocks(B, T, gen, device="cpu"):
    """Block ids with two blocks per row at random places (Gemma 3's image blocks), -1
    elsewhere; the second block of row 1 is split by a gap (ids need not be contiguous)."""
    ids = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        s = int(torch.randint(0, T // 3, (1,), generator=gen))
        n = int(torch.randint(T // 8, T // 3, (1,), generator=gen))
        ids[b, s:s + n] = 0
        s2 = min(T - 4, s + n + int(torch.randint(1, T // 4, (1,), generator=gen)))
        ids[b, s2:s2 + T // 5] = 1
    if B > 1:
        ids[1, -3:] = 1  # later keys of block 1 after a gap
    return ids.to(device)


def chunk_origins(B, T, gen):
    """Where each row's chunks start: drawn before the keys (a cache past the first chunk),
    among them or past them."""
    return torch.randint(-3 * T, 3 * T, (B,), generator=gen)


# name -> pattern keyword arguments for a sequence of T keys (blocks drawn per call)
PATTERNS = {
    "window": lambda T, B, gen: dict(window=37),
    "window_past_T": lambda T, B, gen: dict(window=T + 5),
    "chunk": lambda T, B, gen: dict(chunk=50),
    "blocks": lambda T, B, gen: dict(block_ids=two_blocks(B, T, gen)),
    "window_blocks": lambda T, B, gen: dict(window=20, block_ids=two_blocks(B, T, gen)),
    "chunk_blocks": lambda T, B, gen: dict(chunk=T // 5, block_ids=two_blocks(B, T, gen)),
    "chunk_origin": lambda T, B, gen: dict(chunk=50, chunk_origin=chunk_origins(B, T, gen)),
    "softcap": lambda T, B, gen: dict(softcap=2.5),
    "all": lambda T, B, gen: dict(window=45, chunk=70, block_ids=two_blocks(B, T, gen),
                                  softcap=4.0),
    # PaliGemma 2's sliding layers: the block (its prefix) OR-ed after the window
    "window_unbounded_blocks": lambda T, B, gen: dict(window=20, block_ids=two_blocks(B, T, gen),
                                                      window_bounds_blocks=False),
    "all_unbounded_blocks": lambda T, B, gen: dict(window=45, chunk=70,
                                                   block_ids=two_blocks(B, T, gen), softcap=4.0,
                                                   window_bounds_blocks=False),
    "all_chunk_origin": lambda T, B, gen: dict(window=45, chunk=70,
                                               chunk_origin=chunk_origins(B, T, gen),
                                               block_ids=two_blocks(B, T, gen), softcap=4.0),
}


def on(device, pattern):
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in pattern.items()}


# ---- the definition: transformers' masking_utils ------------------------------------------

def transformers_mask(B, Tq, Tk, causal, window, chunk, block_ids, pad, window_bounds_blocks,
                      chunk_origin=None):
    """The mask transformers builds, from its own mask functions: Gemma 3's
    and(sliding_window_overlay, or(causal, blockwise_overlay)) (create_masks_for_vision_model),
    or PaliGemma 2's or(and(sliding_window_overlay, causal), blockwise_overlay)
    (create_sliding_window_causal_mask with block_sequence_ids), Llama 4's chunked_overlay
    with left padding (chunk_origin: chunks counted from it instead), AND padding; queries
    at cache positions Tk - Tq + i."""
    mu = pytest.importorskip("transformers.masking_utils")
    fn = mu.causal_mask_function if causal else mu.bidirectional_mask_function
    blocks = block_ids is not None and causal
    if blocks and window_bounds_blocks:
        fn = mu.or_masks(fn, mu.blockwise_overlay(block_ids))
    if window:
        fn = mu.and_masks(mu.sliding_window_overlay(window), fn)
    if chunk:
        am = torch.ones(B, Tk, dtype=torch.long) if pad is None else (~pad).long()
        left = (am.cumsum(dim=-1) == torch.zeros_like(am)).sum(dim=-1)  # as create_chunked_causal_mask
        fn = mu.and_masks(mu.chunked_overlay(chunk, left if chunk_origin is None
                                             else chunk_origin), fn)
    if blocks and not window_bounds_blocks:
        fn = mu.or_masks(fn, mu.blockwise_overlay(block_ids))
    if pad is not None:
        fn = mu.and_masks(fn, mu.padding_mask_function(~pad))
    b = torch.arange(B)[:, None, None]
    qi = (torch.arange(Tq) + Tk - Tq)[None, :, None]
    kv = torch.arange(Tk)[None, None, :]
    return fn(b, torch.zeros(()), qi, kv).expand(B, Tq, Tk)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("Tq", [60, 1, 7])
def test_pattern_mask_is_transformers_mask(name, causal, Tq):
    gen = torch.Generator().manual_seed(1)
    B, Tk = 2, 60
    pattern = PATTERNS[name](Tk, B, gen)
    pattern.pop("softcap", None)
    pad = torch.zeros(B, Tk, dtype=torch.bool)
    pad[0, :9] = True  # left padding: the chunks start after it
    pad[1, 40:43] = True
    got = headscope.pattern_mask(Tq, Tk, causal=causal, key_padding_mask=pad, **pattern)
    want = transformers_mask(B, Tq, Tk, causal, pattern.get("window"), pattern.get("chunk"),
                             pattern.get("block_ids"), pad, pattern.get("window_bounds_blocks", True),
                             pattern.get("chunk_origin"))
    assert torch.equal(got, want)
    if Tq == Tk:  # the pattern matters (a window past T does not, nor blocks without causal)
        plain = headscope.pattern_mask(Tq, Tk, causal=causal, key_padding_mask=pad)
        same = name in ("window_past_T", "softcap") or (name == "blocks" and not causal)
        assert torch.equal(got, plain) == same


@pytest.mark.parametrize("Tq", [1, 5, 40])
def test_chunk_origin_is_transformers_chunks_over_a_cache(Tq):
    """Over a key cache that holds absolute positions [kv_offset, kv_offset + Tk) (a
    chunked layer's cache in decode keeps the last chunk - 1 keys), transformers' chunks
    (chunked_overlay counting from each row's left padding, in absolute positions) are the
    ops' chunks with chunk_origin = left_padding - kv_offset, whatever the offset."""
    mu = pytest.importorskip("transformers.masking_utils")
    chunk, Tk = 8, 40
    left = torch.tensor([0, 3, 11])
    for kv_offset in (0, 2, 7, 13, 64, 101):
        fn = mu.and_masks(mu.chunked_overlay(chunk, left), mu.causal_mask_function)
        b = torch.arange(3)[:, None, None]
        qi = (torch.arange(Tq) + kv_offset + Tk - Tq)[None, :, None]
        kv = (torch.arange(Tk) + kv_offset)[None, None, :]
        want = fn(b, torch.zeros(()), qi, kv).expand(3, Tq, Tk)
        got = headscope.pattern_mask(Tq, Tk, batch=3, chunk=chunk,
                                     chunk_origin=left - kv_offset)
        assert torch.equal(got, want), kv_offset
        if kv_offset % chunk:  # the chunks counted from the cache's first key differ
            assert not torch.equal(headscope.pattern_mask(Tq, Tk, batch=3, chunk=chunk,
                                                          key_padding_mask=None), want)


def test_window_keeps_one_meaning_during_decode():
    """A decode step (one query against the cache) sees what the same query saw in the
    prefill: the last `window` keys up to itself."""
    T, w = 50, 8
    full = headscope.pattern_mask(T, T, window=w)
    for t in (1, 7, 8, 30, 50):
        step = headscope.pattern_mask(1, t, window=w)
        assert torch.equal(step[0, 0], full[0, t - 1, :t])
        assert int(step.sum()) == min(w, t)


# ---- region_pool_qk ---------------------------------------------------------------------------

def ref_pool(q, k, w, rid, K, scale, causal, pad, reduce, pattern, key_weights=None):
    A = ref.attention_from_qk(q, k, scale, causal, pad, dtype=torch.float64, **pattern)
    return ref_region_pool(A, w, rid, K, reduce, key_weights)


def random_key_weights(B, H, Hkv, Tk, gen, dtype=torch.float32, device="cpu"):
    """(B, Hw, Tk) factors of either sign, Hw drawn among H, Hkv and 1."""
    Hw = (H, Hkv, 1)[int(torch.randint(0, 3, (1,), generator=gen))]
    return (torch.randn(B, Hw, Tk, generator=gen, dtype=dtype) * 2).to(device)


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300, 16), (2, 4, 1, 1, 300, 8),
                                   (1, 6, 3, 5, 600, 8)],
                         ids=["prefill", "decode", "span"])
def test_region_pool_qk_pattern_equals_materialised_softmax(name, causal, shape, device):
    B, H, Hkv, Tq, Tk, D = shape
    gen = torch.Generator().manual_seed(Tq + Tk)
    K = 6
    q = (torch.randn(B, H, Tq, D, generator=gen) * 2).to(device)
    k = torch.randn(B, Hkv, Tk, D, generator=gen).to(device)
    w = torch.rand(B, Tq, generator=gen)
    if Tq > 2:
        w[:, 1] = 0
    w = w.to(device)
    rid = random_regions(B, Tk, K, gen, device=device)
    pad = torch.zeros(B, Tk, dtype=torch.bool)
    pad[0, :13] = True
    pad = pad.to(device)
    pattern = on(device, PATTERNS[name](Tk, B, gen))
    kw = random_key_weights(B, H, Hkv, Tk, gen, device=device)
    for reduce in ("sum", "mean"):
        out = headscope.region_pool_qk(q, k, w, rid, K, 0.3, causal, pad, reduce, **pattern)
        want = ref_pool(q, k, w, rid, K, 0.3, causal, pad, reduce, pattern)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        out = headscope.region_pool_qk(q, k, w, rid, K, 0.3, causal, pad, reduce, **pattern,
                                       key_weights=kw)
        want = ref_pool(q, k, w, rid, K, 0.3, causal, pad, reduce, pattern, kw)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_region_pool_qk_pattern_float64(device):
    gen = torch.Generator().manual_seed(3)
    B, H, T, D, K = 2, 2, 200, 8, 4
    q, k = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    w = torch.rand(B, T, generator=gen, dtype=torch.float64).to(device)
    rid = random_regions(B, T, K, gen, device=device)
    pattern = on(device, PATTERNS["all"](T, B, gen))
    out = headscope.region_pool_qk(q, k, w, rid, K, 0.4, True, None, "sum", **pattern)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref_pool(q, k, w, rid, K, 0.4, True, None, "sum", pattern),
                               rtol=1e-10, atol=1e-12)
    kw = random_key_weights(B, H, H, T, gen, torch.float64, device)
    out = headscope.region_pool_qk(q, k, w, rid, K, 0.4, True, None, "sum", **pattern,
                                   key_weights=kw)
    torch.testing.assert_close(out, ref_pool(q, k, w, rid, K, 0.4, True, None, "sum", pattern, kw),
                               rtol=1e-10, atol=1e-12)


def test_keys_no_query_sees_are_never_read(device):
    """Keys before every weighted query's window, or in other chunks, may hold NaN: they
    are skipped, not read (the tile skipping a window brings)."""
    gen = torch.Generator().manual_seed(4)
    B, H, Tq, Tk, D, K = 1, 2, 4, 400, 8, 3
    q = torch.randn(B, H, Tq, D, generator=gen).to(device)
    k = torch.randn(B, H, Tk, D, generator=gen)
    k[:, :, :290] = float("nan")  # the queries (positions 396..399) see keys from 297 on
    k = k.to(device)
    w = torch.ones(B, Tq, device=device)
    rid = random_regions(B, Tk, K, gen, device=device)
    # chunks of 100 from key 0, or from key -3 (a cache past the first chunk): the queries'
    # chunks start at 300 and at 297, 397
    for pattern in (dict(window=100), dict(chunk=100),
                    dict(chunk=100, chunk_origin=torch.tensor([-3], device=device))):
        out = headscope.region_pool_qk(q, k, w, rid, K, None, True, None, "sum", **pattern)
        assert torch.isfinite(out).all()
        kk = torch.nan_to_num(k.cpu())
        torch.testing.assert_close(out.cpu().double(),
                                   ref_pool(q.cpu(), kk, w.cpu(), rid.cpu(), K, D ** -0.5, True,
                                            None, "sum", on("cpu", pattern)),
                                   rtol=1e-5, atol=1e-6)
    # without the window the NaN keys are seen: NaN features
    assert torch.isnan(headscope.region_pool_qk(q, k, w, rid, K)).all()


def test_only_the_chunk_origin_modulo_chunk_matters(device):
    """chunk_origin o and o + m * chunk give the same chunks, bitwise the same results in
    every op, for any m: origins at the ends of int64 do not overflow; o + 1 moves every
    chunk boundary and changes the results."""
    gen = torch.Generator().manual_seed(15)
    B, H, Hkv, T, D, K, chunk = 2, 4, 2, 90, 8, 4, 16
    q = torch.randn(B, H, T, D, generator=gen).to(device)
    k = torch.randn(B, Hkv, T, D, generator=gen).to(device)
    V = torch.randn(B, H, T, 6, generator=gen).to(device)
    lengths = torch.tensor([T, T - 7], device=device)
    w = (torch.rand(B, T, generator=gen) + 0.1).to(device)
    rid = random_regions(B, T, K, gen, device=device)
    pad = torch.zeros(B, T, dtype=torch.bool, device=device)
    pad[1, :9] = True
    base = torch.tensor([-5, 37])
    big = (2 ** 63 - 1) // chunk * chunk  # a multiple of chunk near the end of int64

    def run(origin):
        o = origin.to(device)
        return (headscope.region_pool_qk(q, k, w, rid, K, None, True, pad, chunk=chunk,
                                         chunk_origin=o),
                headscope.region_pool_qk_layers([q, q], [k, k], w, rid, K, None, True, pad,
                                                chunk=[chunk, 0], chunk_origin=o),
                headscope.vas_head_stats_qk(q, k, V, lengths, None, True, None, pad,
                                            chunk=chunk, chunk_origin=o))

    ends = [-2 ** 63, 2 ** 63 - 1]
    for origin, same in ((base + 7 * chunk, base), (base - 300 * chunk, base),
                         (base + big, base), (base - big - chunk, base),
                         (torch.tensor(ends), torch.tensor([e % chunk for e in ends]))):
        for got, want in zip(run(origin), run(same)):
            assert torch.equal(got, want), origin
    want = run(base)
    for got, ref_out in zip(run(base + 1), want):
        assert not torch.equal(got, ref_out)
    # and each op is the materialised reference at that origin
    torch.testing.assert_close(want[0].double(), ref_pool(q, k, w, rid, K, D ** -0.5, True, pad,
                                                          "sum", dict(chunk=chunk,
                                                                      chunk_origin=base.to(device))),
                               rtol=1e-5, atol=1e-6)


def test_softcap_of_an_infinite_logit_is_nan(device):
    """NaN policy as without a cap: an infinity in q makes the span's features NaN (the cap
    would otherwise turn it into a finite logit)."""
    q = torch.randn(1, 2, 3, 8)
    q[0, 1, 2, 0] = float("inf")
    k = torch.rand(1, 2, 10, 8) + 0.1
    w = torch.ones(1, 3)
    rid = torch.zeros(1, 10, dtype=torch.long)
    out = headscope.region_pool_qk(q.to(device), k.to(device), w.to(device), rid.to(device), 1,
                                   softcap=5.0)
    assert torch.isnan(out[0, 0, 1]) and torch.isfinite(out[0, 0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_region_pool_qk_layers_per_layer_patterns(device, dtype):
    """Gemma's alternation: sliding layers with a window, global ones without, chunked ones
    (Llama 4), one call equal to region_pool_qk of each layer with its own pattern."""
    gen = torch.Generator().manual_seed(5)
    B, H, Hkv, Tq, Tk, D, K, L = 2, 4, 2, 6, 260, 16, 5, 4
    q = [torch.randn(B, H, Tq, D, generator=gen).to(device, dtype) for _ in range(L)]
    k = [torch.randn(B, Hkv, Tk, D, generator=gen).to(device, dtype) for _ in range(L)]
    w = (torch.rand(B, Tq, generator=gen) + 0.1).to(device)
    rid = random_regions(B, Tk, K, gen, device=device)
    ids = two_blocks(B, Tk, gen, device)
    pad = torch.zeros(B, Tk, dtype=torch.bool, device=device)
    pad[1, :20] = True
    windows, chunks = [30, None, 0, 30], [None, None, 40, 0]
    out = headscope.region_pool_qk_layers(q, k, w, rid, K, None, True, pad, "sum", windows,
                                          chunks, ids, 3.0)
    per_layer = [headscope.region_pool_qk(q[l], k[l], w, rid, K, None, True, pad, "sum",
                                          windows[l], chunks[l], ids, 3.0) for l in range(L)]
    assert torch.equal(out, headscope.stack_layers(per_layer))
    # the layers' patterns differ, and one int is every layer's window
    assert not torch.equal(per_layer[0], headscope.region_pool_qk(q[0], k[0], w, rid, K, None,
                                                                  True, pad, "sum", None, None,
                                                                  ids, 3.0))
    assert torch.equal(headscope.region_pool_qk_layers(q, k, w, rid, K, window=30),
                       headscope.region_pool_qk_layers(q, k, w, rid, K, window=[30] * L))


def test_region_pool_qk_layers_positional_calls_unchanged():
    """The Tracer's positional call (no pattern) is the call with every pattern off."""
    gen = torch.Generator().manual_seed(6)
    q = [torch.randn(1, 2, 3, 8, generator=gen) for _ in range(2)]
    k = [torch.randn(1, 2, 30, 8, generator=gen) for _ in range(2)]
    w, rid = torch.ones(1, 3), random_regions(1, 30, 3, gen)
    plain = OPS.region_pool_qk_layers(q, k, w, rid, 3, [0.3, 0.3], True, None)
    off = OPS.region_pool_qk_layers(q, k, w, rid, 3, [0.3, 0.3], True, None, "sum", [0, 0],
                                    [0, 0], None, None)
    assert torch.equal(plain, off)


# ---- vas_head_stats_qk --------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("causal", [True, False])
def test_vas_head_stats_qk_pattern_equals_materialised_softmax(name, causal, device):
    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, T, D, Dh = 2, 4, 2, 300, 16, 8
    q = torch.randn(B, H, T, D, generator=gen)
    k = torch.randn(B, Hkv, T, D, generator=gen)
    V = torch.randn(B, H, T, Dh, generator=gen)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, :20] = True  # left padding, the window moved by offsets
    lengths, offsets = torch.tensor([T - 20, 250]), torch.tensor([20, 0])
    pattern = PATTERNS[name](T, B, gen)
    A = ref.attention_from_qk(q, k, 0.3, causal, pad, dtype=torch.float64, **pattern).float()
    want = ref.head_stats(A, V, lengths, offsets)
    args = [t.to(device) for t in (q, k, V, lengths)]
    out = headscope.vas_head_stats_qk(*args, 0.3, causal, offsets.to(device), pad.to(device),
                                      **on(device, pattern))
    assert_close(out, want, what=f"qk {name}")
    assert_close(out, headscope.vas_head_stats(A.to(device), V.to(device), lengths.to(device),
                                               offsets.to(device)), what=f"qk {name} vs attn op")


def test_the_two_compositions_differ_only_past_the_window():
    """Gemma 3 bounds a block by the window, PaliGemma 2 does not: they differ exactly on
    block keys more than `window` positions before the query."""
    gen = torch.Generator().manual_seed(2)
    B, T, w = 2, 80, 10
    ids = two_blocks(B, T, gen)
    gemma = headscope.pattern_mask(T, T, batch=B, window=w, block_ids=ids)
    pali = headscope.pattern_mask(T, T, batch=B, window=w, block_ids=ids, window_bounds_blocks=False)
    p, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    assert torch.equal(pali & ~gemma, same & (j <= p - w))
    assert not (gemma & ~pali).any() and (pali & ~gemma).any()


@pytest.mark.parametrize("name", ["window", "all", "blocks", "all_unbounded_blocks",
                                  "all_chunk_origin"])
def test_vas_head_stats_qk_pattern_whole_heads_and_chunked_paths(name):
    """Whole heads per thread (each tile row of A held for its pairs) and heads split into
    chunks (every tile recomputed): both skip the tiles the pattern leaves empty."""
    from test_vas import chunked_threads, num_threads
    gen = torch.Generator().manual_seed(8)
    B, H, T, D, Dh = 1, 3, 520, 8, 12
    q, k, V = (torch.randn(B, H, T, d, generator=gen) for d in (D, D, Dh))
    lengths = torch.tensor([500])
    pattern = PATTERNS[name](T, B, gen)
    A = ref.attention_from_qk(q, k, 0.4, True, None, dtype=torch.float64, **pattern).float()
    want = ref.head_stats(A, V, lengths)
    for n in (1, chunked_threads(B * H)):
        with num_threads(n):
            out = headscope.vas_head_stats_qk(q, k, V, lengths, 0.4, True, None, None, **pattern)
        assert_close(out, want, what=f"{name} with {n} threads")


def test_vas_keys_before_the_window_are_never_read(device):
    gen = torch.Generator().manual_seed(9)
    B, H, T, D = 1, 2, 200, 8
    q, k, V = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
    k[:, :, :50] = float("nan")  # the window starts at 80: its first row sees keys 61..80
    lengths, offsets = torch.tensor([120]), torch.tensor([80])
    args = [t.to(device) for t in (q, k, V, lengths)]
    out = headscope.vas_head_stats_qk(*args, 0.3, True, offsets.to(device), None, window=20)
    assert torch.isfinite(out).all()
    A = ref.attention_from_qk(q, torch.nan_to_num(k), 0.3, True, window=20)
    assert_close(out, ref.head_stats(A, V, lengths, offsets), what="window after NaN keys")
    assert torch.isnan(headscope.vas_head_stats_qk(*args, 0.3, True, offsets.to(device))).all()


def test_vas_nan_in_a_block_key_counts_only_where_seen(device):
    """Keys after the window are seen through a block of a window row: NaN there makes the
    head NaN; NaN in later keys no window row sees (other blocks, past the window's blocks)
    does not."""
    gen = torch.Generator().manual_seed(10)
    B, H, T, D = 1, 2, 200, 8
    q, k, V = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
    ids = torch.full((B, T), -1, dtype=torch.long)
    ids[0, 100:150] = 0  # window rows 100..119 see keys up to 149
    ids[0, 170:190] = 1
    lengths = torch.tensor([120])
    for key, seen in ((140, True), (160, False), (180, False)):
        kk = k.clone()
        kk[0, 0, key, 0] = float("nan")
        out = headscope.vas_head_stats_qk(q.to(device), kk.to(device), V.to(device),
                                          lengths.to(device), 0.3, True, block_ids=ids.to(device))
        assert bool(torch.isnan(out[0, 0]).all()) == seen  # the head that reads key head 0
        assert torch.isfinite(out[0, 1]).all() and (seen or torch.isfinite(out).all())


# ---- bad pattern arguments ----------------------------------------------------------------------

def _pool_args(**over):
    gen = torch.Generator().manual_seed(12)
    args = dict(q=torch.randn(1, 4, 2, 8, generator=gen), k=torch.randn(1, 2, 10, 8, generator=gen),
                query_weights=torch.ones(1, 2), region_ids=torch.zeros(1, 10, dtype=torch.long),
                num_regions=3)
    args.update(over)
    return args


BAD_PATTERNS = [
    (dict(window=-1), r"'window' must be >= 0 \(0 or None: none\), got -1"),
    (dict(chunk=-3), r"'chunk' must be >= 0 \(0 or None: none\), got -3"),
    (dict(softcap=0.0), r"'softcap' must be finite and > 0, got 0"),
    (dict(softcap=-1.0), r"'softcap' must be finite and > 0"),
    (dict(softcap=float("inf")), r"'softcap' must be finite and > 0"),
    (dict(block_ids=torch.zeros(1, 10, dtype=torch.int32)), r"'block_ids' must have dtype Long"),
    (dict(block_ids=torch.zeros(10, dtype=torch.long)), r"'block_ids' must have 2 dimensions"),
    (dict(block_ids=torch.zeros(1, 9, dtype=torch.long)), r"'block_ids' must have size 10 in dimension 1"),
    (dict(block_ids=torch.zeros(2, 10, dtype=torch.long)), r"'block_ids' must have size 1 in dimension 0"),
    (dict(block_ids=torch.zeros(1, 10, dtype=torch.long), window_bounds_blocks=False, window=-2),
     r"'window' must be >= 0"),
    (dict(chunk=4, chunk_origin=torch.zeros(1, dtype=torch.int32)),
     r"'chunk_origin' must have dtype Long"),
    (dict(chunk=4, chunk_origin=torch.zeros(1, 1, dtype=torch.long)),
     r"'chunk_origin' must have 1 dimensions"),
    (dict(chunk=4, chunk_origin=torch.zeros(2, dtype=torch.long)),
     r"'chunk_origin' must have size 1 in dimension 0"),
    (dict(chunk_origin=torch.zeros(1, dtype=torch.long)),
     r"'chunk_origin' must come with a 'chunk' > 0 \(it says where each row's chunks start\), "
     r"got no chunk"),
    (dict(chunk=0, window=3, chunk_origin=torch.zeros(1, dtype=torch.long)),
     r"'chunk_origin' must come with a 'chunk' > 0"),
]


@pytest.mark.parametrize("over,msg", BAD_PATTERNS, ids=lambda x: str(x)[:40])
def test_bad_pattern_arguments_name_the_argument(over, msg):
    with pytest.raises(RuntimeError, match=r"headscope::region_pool_qk: argument " + msg):
        OPS.region_pool_qk(**_pool_args(**over))
    a = _pool_args()
    V = torch.randn(1, 4, 10, 3)
    with pytest.raises(RuntimeError, match=r"headscope::vas_head_stats_qk: argument " + msg):
        OPS.vas_head_stats_qk(a["k"].repeat(1, 2, 1, 1), a["k"], V, torch.tensor([10]), **over)
    lists = {key: ([v, v] if key in ("window", "chunk") else v) for key, v in over.items()}
    with pytest.raises(RuntimeError, match=r"headscope::region_pool_qk_layers: argument " + msg):
        OPS.region_pool_qk_layers([a["q"]] * 2, [a["k"]] * 2, a["query_weights"],
                                  a["region_ids"], 3, **lists)
    # the Meta kernels (torch.compile, fake tensors) raise the same error
    with pytest.raises(RuntimeError, match=msg):
        OPS.region_pool_qk(**{key: (v.to("meta") if torch.is_tensor(v) else v)
                              for key, v in _pool_args(**over).items()})


def test_bad_per_layer_lengths():
    a = _pool_args()
    q, k = [a["q"]] * 3, [a["k"]] * 3
    for arg in ("window", "chunk"):
        with pytest.raises(RuntimeError, match=r"headscope::region_pool_qk_layers: argument '"
                           + arg + r"' must hold one length per layer \(3\), got 2"):
            OPS.region_pool_qk_layers(q, k, a["query_weights"], a["region_ids"], 3,
                                      **{arg: [4, 4]})
        with pytest.raises(RuntimeError, match=r"argument '" + arg + r"' must be >= 0"):
            OPS.region_pool_qk_layers(q, k, a["query_weights"], a["region_ids"], 3,
                                      **{arg: [4, -1, 4]})


# ---- opcheck and torch.compile ----------------------------------------------------------------

def _pattern_samples(device):
    gen = torch.Generator().manual_seed(13)
    B, H, Hkv, Tq, Tk, D, K = 2, 4, 2, 3, 40, 8, 5
    q = torch.randn(B, H, Tq, D, generator=gen).to(device)
    k = torch.randn(B, Hkv, Tk, D, generator=gen).to(device)
    w = (torch.rand(B, Tq, generator=gen) + 0.1).to(device)
    rid = random_regions(B, Tk, K, gen, device=device)
    ids = two_blocks(B, Tk, gen, device)
    qv = torch.randn(B, H, Tk, D, generator=gen).to(device)
    V = torch.randn(B, H, Tk, 6, generator=gen).to(device)
    lengths = torch.tensor([Tk, Tk - 5], device=device)
    origin = torch.tensor([-21, Tk + 5], device=device)
    return [
        (OPS.region_pool_qk.default, (q, k, w, rid, K, 0.3, True, None, "sum", 8, 16, ids, 2.0)),
        (OPS.region_pool_qk.default, (q, k, w, rid, K, 0.3, True, None, "sum", 8, 16, ids, 2.0,
                                      False)),
        (OPS.region_pool_qk_layers.default, ([q, q], [k, k], w, rid, K, None, True, None, "mean",
                                             [8, 0], [0, 16], ids, 2.0)),
        (OPS.vas_head_stats_qk.default, (qv, k, V, lengths, 0.3, True, None, None, 9, 20, ids,
                                         3.0)),
        (OPS.vas_head_stats_qk.default, (qv, k, V, lengths, 0.3, True, None, None, 9, None, ids,
                                         None, False)),
        # chunks over a cache past their origin (negative) and counted from past the keys
        (OPS.region_pool_qk.default, (q, k, w, rid, K, 0.3, True, None, "sum", None, 16, ids,
                                      None, True, None, origin)),
        (OPS.region_pool_qk_layers.default, ([q, q], [k, k], w, rid, K, None, True, None, "sum",
                                             [8, 0], [0, 16], ids, 2.0, True, None, origin)),
        (OPS.vas_head_stats_qk.default, (qv, k, V, lengths, 0.3, True, None, None, 9, 20, ids,
                                         3.0, True, origin)),
    ]


def test_opcheck_with_patterns(device):
    for op, args in _pattern_samples(device):
        torch.library.opcheck(op, args)


def test_compile_with_patterns_dynamic_sizes():
    """torch.compile(fullgraph, dynamic): the pattern arguments pass through the Meta
    kernels; a new sequence length does not recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def fn(q, k, w, rid, ids, qv, V, lengths, origin):
        pooled = headscope.region_pool_qk(q, k, w, rid, 4, None, True, None, "sum", 16, None, ids,
                                          3.0)
        layers = headscope.region_pool_qk_layers([q, q], [k, k], w, rid, 4, window=[16, 0],
                                                 block_ids=ids, window_bounds_blocks=False)
        stats = headscope.vas_head_stats_qk(qv, k, V, lengths, window=16, chunk=32, block_ids=ids,
                                            softcap=3.0, chunk_origin=origin)
        chunked = headscope.region_pool_qk_layers([q, q], [k, k], w, rid, 4, chunk=[0, 8],
                                                  chunk_origin=origin)
        return pooled, layers, stats, chunked

    compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(14)
    for Tk in (50, 67):
        q, k = torch.randn(1, 4, 2, 8, generator=gen), torch.randn(1, 2, Tk, 8, generator=gen)
        w, rid = torch.ones(1, 2), random_regions(1, Tk, 4, gen)
        ids = two_blocks(1, Tk, gen)
        qv, V = torch.randn(1, 4, Tk, 8, generator=gen), torch.randn(1, 4, Tk, 5, generator=gen)
        lengths = torch.tensor([Tk])
        origin = torch.tensor([5 - Tk])  # a key cache past the first chunk
        args = (q, k, w, rid, ids, qv, V, lengths, origin)
        for got, want in zip(compiled(*args), fn(*args)):
            torch.testing.assert_close(got, want)
    assert counter.frame_count == 1
