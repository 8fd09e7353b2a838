"""Checks that each op and class does what it claims with an oracle, fails clearly on misuse,
holds up under concurrent callers, and that saved files are never half-written."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import headscope

scipy_stats = pytest.importorskip("scipy.stats")


# ---- FactorMixer against the dense doubly-stochastic W ----------------------------------------

def test_factor_mixer_equals_dense_projection():
    """Random projections, q != k, a temperature other than the default: the mixer's output
    is W v with W = U diag(1/g) V^T of kl_project's factors of (q W_q / t, k W_k / t)."""
    gen = torch.Generator().manual_seed(4)
    B, H, n, Dh, r, t = 2, 3, 20, 8, 4, 1.7
    mixer = headscope.FactorMixer(H, Dh, r, temperature=t).double()
    with torch.no_grad():
        mixer.w_q.copy_(torch.randn(H, Dh, r, generator=gen, dtype=torch.float64) * 0.5)
        mixer.w_k.copy_(torch.randn(H, Dh, r, generator=gen, dtype=torch.float64) * 0.5)
    q, k, v = (torch.randn(B, H, n, Dh, generator=gen, dtype=torch.float64) for _ in range(3))
    out = mixer(q, k, v)
    proj = headscope.kl_project(q @ mixer.w_q / t, k @ mixer.w_k / t, log_space=True, tol=1e-12)
    g = proj.U.sum(-2)
    W = (proj.U / g[..., None, :]) @ proj.V.transpose(-1, -2)  # (B, H, n, n)
    torch.testing.assert_close(W.sum(-1), torch.ones(B, H, n, dtype=torch.float64))
    torch.testing.assert_close(W.sum(-2), torch.ones(B, H, n, dtype=torch.float64))
    torch.testing.assert_close(out, W @ v, rtol=1e-10, atol=1e-12)
    # each of W_q, W_k and the temperature changes the result
    for change in ("w_q", "w_k", "temperature"):
        other = headscope.FactorMixer(H, Dh, r, temperature=t).double()
        other.load_state_dict(mixer.state_dict())
        if change == "temperature":
            other.temperature = 2 * t
        else:
            with torch.no_grad():
                getattr(other, change).mul_(1.5)
        assert not torch.allclose(other(q, k, v), out, rtol=1e-6, atol=1e-8), change


@pytest.mark.parametrize("kwargs, error", [(dict(rank=0), "rank must be >= 1"),
                                           (dict(temperature=0.0), "temperature must be > 0")])
def test_factor_mixer_bad_arguments(kwargs, error):
    args = dict(num_heads=2, head_dim=4, rank=2) | kwargs
    with pytest.raises(ValueError, match=error):
        headscope.FactorMixer(**args)


def test_factor_mixer_bad_shapes():
    mixer = headscope.FactorMixer(2, 4, 2)
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="FactorMixer: q, k must be"):
        mixer(q, torch.randn(1, 2, 6, 4), torch.randn(1, 2, 5, 4))
    with pytest.raises(ValueError, match="FactorMixer: q, k must be"):
        mixer(q[0], q[0], q[0])


# ---- stack_layers, lds, spearman --------------------------------------------------------------

def test_stack_layers_is_layer_major():
    L, K, H = 3, 5, 4
    per_layer = [torch.randn(2, K, H) for _ in range(L)]
    stacked = headscope.stack_layers(per_layer)
    assert stacked.shape == (2, K, L * H)
    for l in range(L):
        for h in range(H):
            assert torch.equal(stacked[..., l * H + h], per_layer[l][..., h])
    head = headscope.AttributionHead(L, H)
    assert head.metadata()["feature_layout"] == "layer_major"


def test_lds_one_image_constant_image_and_bad_ranks():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(12)
    p = a + rng.standard_normal(12)
    one = headscope.lds(torch.from_numpy(p), torch.from_numpy(a))
    assert one.per_image.shape == (1,)
    assert abs(float(one.overall) - scipy_stats.spearmanr(p, a)[0]) < 1e-12
    pred = torch.from_numpy(np.stack([p, np.full(12, 2.0), p[::-1].copy()]))
    actual = torch.from_numpy(np.stack([a, a, a]))
    out = headscope.lds(pred, actual)
    assert torch.isnan(out.per_image[1])  # a constant image has no ranking
    want = [scipy_stats.spearmanr(p, a)[0], scipy_stats.spearmanr(p[::-1], a)[0]]
    assert abs(float(out.per_image_mean) - np.mean(want)) < 1e-12
    with pytest.raises(ValueError, match="must be \\(K,\\) or \\(n_images, K\\)"):
        headscope.lds(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="must have the shape of 'pred'"):
        headscope.lds(torch.zeros(2, 3), torch.zeros(3, 2))


def test_spearman_with_ties_equals_scipy_to_1e12():
    rng = np.random.default_rng(5)
    for x in (rng.integers(0, 5, (8, 40)).astype(np.float64),
              np.round(rng.standard_normal((8, 9)), 1)):
        y = np.round(x + rng.standard_normal(x.shape), 0)
        got = headscope.spearman(torch.from_numpy(x), torch.from_numpy(y)).numpy()
        want = [scipy_stats.spearmanr(a, b)[0] for a, b in zip(x, y)]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


# ---- error paths ------------------------------------------------------------------------------

OPS = torch.ops.headscope


@pytest.mark.parametrize("call, pattern", [
    (lambda: OPS.kl_hvp(torch.rand(4, 3).double(), torch.rand(4, 2).double(),
                        torch.rand(3).double()), "headscope::kl_hvp"),
    (lambda: OPS.kl_hvp(torch.rand(4, 3).double(), torch.rand(4, 3).double(),
                        torch.rand(2).double()), "headscope::kl_hvp"),
    (lambda: OPS.linear_attribution(torch.rand(2, 6), torch.rand(6), torch.rand(5),
                                    torch.ones(6)), "headscope::linear_attribution.*'mean'"),
    (lambda: OPS.linear_attribution(torch.rand(2, 6), torch.rand(6), torch.rand(6),
                                    torch.ones(7)), "headscope::linear_attribution.*'std'"),
    (lambda: OPS.spearman(torch.rand(5), torch.rand(5).double(), -1), "headscope::spearman"),
    # no heads to compute: the windows are still checked (found by fuzz/fuzz_vas.cpp)
    (lambda: OPS.vas_head_stats(torch.rand(2, 0, 5, 5), torch.rand(2, 0, 5, 1), torch.tensor([-1, 2])),
     "headscope::vas_head_stats.*'lengths'"),
    (lambda: OPS.vas_head_stats_qk(torch.rand(2, 0, 5, 4), torch.rand(2, 1, 5, 4), torch.rand(2, 0, 5, 1),
                                   torch.tensor([9, 1])), "headscope::vas_head_stats_qk.*'lengths'"),
])
def test_op_errors_name_the_op_and_argument(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_vas_accumulator_misuse():
    with pytest.raises(ValueError, match="'num_layers' must be >= 1"):
        headscope.VASAccumulator(0, torch.ones(1, 8))
    with pytest.raises(ValueError, match="give 'attention_mask' or 'lengths'"):
        headscope.VASAccumulator(2)
    acc = headscope.VASAccumulator(2, torch.ones(1, 8))
    with pytest.raises(RuntimeError, match="no layer has been added yet"):
        acc.head_stats
    A = torch.softmax(torch.randn(1, 2, 8, 8), -1)
    V = torch.randn(1, 2, 8, 4)
    with pytest.raises(IndexError, match="'layer_idx' must be in \\[0, 2\\)"):
        acc.update(2, A, V)
    acc.update(0, A, V)
    with pytest.raises(RuntimeError, match="layers \\[1\\] were never added"):
        acc.features()
    acc.update(1, A, V)
    assert acc.features().shape == (1, 36)


def test_attribution_head_misuse(tmp_path):
    with pytest.raises(ValueError, match="num_layers and num_heads must be >= 1"):
        headscope.AttributionHead(0, 4)
    with pytest.raises(ValueError, match="reduce must be 'sum' or 'mean'"):
        headscope.AttributionHead(2, 4, reduce="max")
    head = headscope.AttributionHead(2, 4)
    with pytest.raises(ValueError, match="need at least 2 samples"):
        head.fit(torch.randn(1, 8), torch.randn(1))
    with pytest.raises(ValueError, match="'ridge' must be a finite value >= 0"):
        head.fit(torch.randn(5, 8), torch.randn(5), ridge=-1.0)
    with pytest.raises(ValueError, match="'features' holds NaN"):
        head.fit(torch.full((5, 8), float("nan")), torch.randn(5))
    with pytest.raises(ValueError, match="L\\*H = 8 entries"):
        head.fit(torch.randn(5, 7), torch.randn(5))
    from safetensors.torch import save_file
    bad_keys = tmp_path / "keys.safetensors"
    save_file({"weight": torch.zeros(8), "mean": torch.zeros(8), "std": torch.ones(8),
               "offset": torch.zeros(())}, str(bad_keys), metadata=head.metadata())
    with pytest.raises(ValueError, match="keys.safetensors.*tensors must be weight, mean"):
        headscope.AttributionHead.load(bad_keys)
    inf = tmp_path / "inf.safetensors"
    save_file({"weight": torch.full((8,), float("inf")), "mean": torch.zeros(8),
               "std": torch.ones(8), "bias": torch.zeros(())}, str(inf), metadata=head.metadata())
    with pytest.raises(ValueError, match="inf.safetensors.*'weight' must hold finite floats"):
        headscope.AttributionHead.load(inf)
    truncated = tmp_path / "cut.safetensors"
    head.save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:-7])
    with pytest.raises(ValueError, match="cut.safetensors.*truncated or damaged"):
        headscope.AttributionHead.load(truncated)


# ---- persistence: an interrupted save leaves the previous file ----------------------------------

_SAVE_THEN_HANG = r"""
import sys, time, torch, headscope
import safetensors.torch as st
path = sys.argv[1]
head = headscope.AttributionHead(2, 4)
head.weight.data.fill_(1.0)
head.save(path)
real = st.save_file
def slow(tensors, filename, metadata=None):
    real(tensors, filename, metadata=metadata)
    with open(filename, "r+b") as f:
        f.truncate(20)  # half-written
    print("writing", flush=True)
    time.sleep(60)
st.save_file = slow
head.weight.data.fill_(2.0)
head.save(path)
"""


def test_save_killed_midway_keeps_previous_file(tmp_path):
    path = tmp_path / "head.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", _SAVE_THEN_HANG, str(path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait()
    head = headscope.AttributionHead.load(path)
    assert torch.equal(head.weight, torch.ones(8))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["head.safetensors"]


def test_saved_file_has_the_permissions_of_a_plain_open(tmp_path):
    """The temporary file is private (mkstemp); the saved one must not stay so."""
    umask = os.umask(0o027)
    try:
        headscope.AttributionHead(2, 4).save(tmp_path / "head.safetensors")
        (tmp_path / "plain").touch()
    finally:
        os.umask(umask)
    assert (tmp_path / "head.safetensors").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "plain").stat().st_mode & 0o777 == 0o640


def test_save_error_removes_temporary_file(tmp_path, monkeypatch):
    import safetensors.torch as st

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        headscope.AttributionHead(2, 4).save(tmp_path / "head.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_save_into_a_missing_folder_names_the_path_given(tmp_path):
    path = tmp_path / "nodir" / "head.safetensors"
    with pytest.raises(FileNotFoundError) as e:
        headscope.AttributionHead(2, 4).save(path)
    assert str(path) in str(e.value) and ".tmp" not in str(e.value)
    assert e.value.filename == str(path)


def test_newest_torch_check_refuses_to_test_the_pin_again(tmp_path):
    """scripts/test_newest_torch.sh fails, before installing anything, when the torch it
    would test is not newer than the pin of requirements.txt."""
    from conftest import REPO
    pin = next(line.split("==")[1].strip() for line in
               (REPO / "requirements.txt").read_text().splitlines()
               if line.startswith("torch=="))
    for version in (pin, pin + "+cu130", "2.0.0"):
        env = dict(os.environ, HEADSCOPE_NEWEST_TORCH=version,
                   HEADSCOPE_NEWEST_DIR=str(tmp_path / "env"))
        result = subprocess.run(["bash", str(REPO / "scripts" / "test_newest_torch.sh")],
                                capture_output=True, text=True, env=env, timeout=60)
        assert result.returncode == 1, result.stderr
        assert f"torch {version} is not newer than the pin torch=={pin}" in result.stderr
        assert not (tmp_path / "env").exists()


# ---- concurrency -------------------------------------------------------------------------------

def _inputs():
    gen = torch.Generator().manual_seed(8)
    return dict(
        A=torch.softmax(torch.randn(2, 3, 64, 64, generator=gen), -1),
        V=torch.randn(2, 3, 64, 16, generator=gen),
        q=torch.randn(2, 4, 64, 16, generator=gen), k=torch.randn(2, 2, 64, 16, generator=gen),
        lengths=torch.tensor([64, 50]),
        rid=torch.randint(-1, 6, (2, 64), generator=gen),
        w=torch.rand(2, 64, generator=gen) + 0.1,
        lu=torch.randn(3, 30, 4, generator=gen).double(), lv=torch.randn(3, 30, 4, generator=gen).double(),
        X=torch.randn(3, 30, 5, generator=gen).double(),
        x=torch.randn(6, 40, generator=gen), y=torch.randn(6, 40, generator=gen),
        feats=torch.randn(64, 8, generator=gen),
    )


def _calls(inputs=None):
    t = inputs if inputs is not None else _inputs()
    return {
        "vas_head_stats": lambda: headscope.vas_head_stats(t["A"], t["V"], t["lengths"]),
        "vas_head_stats_qk": lambda: headscope.vas_head_stats_qk(
            t["q"], t["k"], t["V"].repeat(1, 2, 1, 1)[:, :4], t["lengths"]),
        "region_pool_qk": lambda: headscope.region_pool_qk(t["q"], t["k"], t["w"], t["rid"], 6, causal=True),
        "kl_project": lambda: OPS.kl_project(t["lu"], t["lv"], 1e-11, 80)[0],
        "thin_mix": lambda: headscope.thin_mix(*OPS.kl_project(t["lu"], t["lv"], 1e-11, 80)[:2], t["X"]),
        "spearman": lambda: headscope.spearman(t["x"], t["y"]),
        "ward_regions": lambda: headscope.ward_regions(t["feats"], 8, 8, 5),
    }


def test_concurrent_callers_get_serial_results():
    calls = _calls()
    serial = {name: fn() for name, fn in calls.items()}
    results, errors = [], []

    def worker():
        try:
            for _ in range(3):
                results.append({name: fn() for name, fn in calls.items()})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 12
    for got in results:
        for name, want in serial.items():
            assert torch.equal(got[name], want), name


def test_results_repeat_bitwise_across_runs():
    calls = _calls()
    first = {name: fn() for name, fn in calls.items()}
    for name, fn in calls.items():
        assert torch.equal(fn(), first[name]), name



@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: no GPU on this machine")
def test_cuda_ops_run_on_the_current_stream():
    """On a side stream whose inputs are written only after a long sleep, every op must wait
    for them: a kernel launched on another stream would read the buffers before the copies."""
    inputs = {name: t.cuda() for name, t in _inputs().items()}
    want = {name: fn() for name, fn in _calls(inputs).items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        late = {name: t.clone() for name, t in inputs.items()}
        got = {name: fn() for name, fn in _calls(late).items()}
    torch.cuda.current_stream().wait_stream(side)
    for name in want:  # CUDA's float64 atomics may move the last float32 bits between runs
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)

def _large_calls():
    """Sizes where the kernels split one head, one row or one reduction among threads."""
    gen = torch.Generator().manual_seed(9)
    T = 300
    A = torch.softmax(torch.randn(1, 1, T, T, generator=gen), -1)
    V = torch.randn(1, 1, T, 64, generator=gen)
    q, k = torch.randn(1, 2, T, 64, generator=gen), torch.randn(1, 1, T, 64, generator=gen)
    rid, w = torch.randint(-1, 8, (1, T), generator=gen), torch.rand(1, T, generator=gen)
    x, y = torch.randn(2, 50000, generator=gen), torch.randn(2, 50000, generator=gen)
    f, weight = torch.randn(5000, 64, generator=gen), torch.randn(64, generator=gen)
    lu, lv = torch.randn(1, 2048, 16, generator=gen), torch.randn(1, 2048, 16, generator=gen)
    head_stats = torch.rand(8, 28, 16, 3, generator=gen)
    return {
        "vas_head_stats": lambda: headscope.vas_head_stats(A, V, torch.tensor([T])),
        "vas_head_stats_qk": lambda: headscope.vas_head_stats_qk(q, k, V.expand(1, 2, T, 64),
                                                                 torch.tensor([T])),
        "vas_aggregate": lambda: headscope.vas_aggregate(head_stats),
        "region_pool": lambda: headscope.region_pool(A, w, rid, 8),
        "region_pool_qk": lambda: headscope.region_pool_qk(q, k, w, rid, 8, causal=True),
        "kl_project": lambda: OPS.kl_project(lu, lv, 1e-8, 80)[0],
        "spearman": lambda: headscope.spearman(x, y),
        "pearson": lambda: headscope.pearson(x, y),
        "linear_attribution": lambda: headscope.linear_attribution(f, weight, f.mean(0), f.std(0), 0.5),
    }


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_results_bitwise_across_thread_counts(restore_threads):
    """Every kernel of our own gives the same bits whatever torch.set_num_threads says: work
    is split over (batch, head) items or fixed blocks, each summed in one fixed order. The
    ATen composite thin_mix is two BLAS products, whose sums the BLAS splits among threads:
    equal to float32 rounding across thread counts, bitwise for a fixed count."""
    calls = {**_calls(), **{f"{n} (large)": fn for n, fn in _large_calls().items()}}
    composites = {name: calls.pop(name) for name in ("thin_mix",)}
    gen = torch.Generator().manual_seed(10)
    U, V = OPS.kl_project(torch.randn(1, 4096, 16, generator=gen), torch.randn(1, 4096, 16, generator=gen),
                          1e-8, 80)[:2]
    X = torch.randn(1, 4096, 128, generator=gen)
    composites["thin_mix (large)"] = lambda: headscope.thin_mix(U, V, X)
    torch.set_num_threads(1)
    single = {name: fn() for name, fn in calls.items()}
    single_composite = {name: fn() for name, fn in composites.items()}
    for threads in (2, 3, 4):
        torch.set_num_threads(threads)
        for name, fn in calls.items():
            assert torch.equal(fn(), single[name]), (name, threads)
        for name, fn in composites.items():
            got = fn()
            assert torch.equal(fn(), got), (name, threads)
            torch.testing.assert_close(got, single_composite[name], rtol=1e-6, atol=1e-6,
                                       msg=f"{name}, {threads} threads")

# ---- inputs past 2^31 elements (64-bit indexing) -----------------------------------------------

@pytest.mark.isolated(max_rss_gib=12)  # 10.7 GiB measured
def test_attention_past_2_31_elements():
    """vas_head_stats and region_pool on a (1, H, 64, 64) attention of 2^31 + 2^20 elements
    (8 GiB, in a process of its own that returns them): every head's result equals the same
    op on a slice of heads far below 2^31, so no offset (head * T * T, ...) wrapped around
    in 32 bits."""
    T, Dh = 64, 4
    H = (1 << 31) // (T * T) + 256
    gen = torch.Generator().manual_seed(31)
    A = torch.rand(1, H, T, T, generator=gen)
    A /= A.sum(-1, keepdim=True)
    assert A.numel() > 2 ** 31
    V = torch.randn(1, H, T, Dh, generator=gen)
    lengths = torch.tensor([T])
    stats = headscope.vas_head_stats(A, V, lengths)
    rid = (torch.arange(T) % 5 - 1)[None]
    w = torch.ones(1, T)
    pooled = headscope.region_pool(A, w, rid, 4)
    for h0 in (0, H // 2, H - 300):  # slices at the start, the middle and past 2^31
        sl = slice(h0, h0 + 300)
        assert torch.equal(stats[:, sl], headscope.vas_head_stats(A[:, sl], V[:, sl], lengths))
        assert torch.equal(pooled[:, :, sl], headscope.region_pool(A[:, sl], w, rid, 4))


# ---- allocations that cannot be made -----------------------------------------------------------

def _huge_calls():
    """Calls whose result or scratch space needs terabytes (stride-0 inputs cost nothing)."""
    a, w, rid = torch.rand(1, 1, 2, 3), torch.ones(1, 2), torch.zeros(1, 3, dtype=torch.long)
    long_q = torch.rand(1, 1, 1, 1).expand(1, 1, 2 ** 40, 1)
    q, k = torch.rand(1, 1, 2, 4), torch.rand(1, 1, 3, 4)
    problems = torch.rand(1, 1, 1).expand(2 ** 40, 2, 2)
    row = torch.rand(1).expand(2 ** 40)
    return {
        "region_pool (operator new)": ("region_pool", lambda: headscope.region_pool(a, w, rid, 2 ** 40)),
        "region_pool (vector length)": ("region_pool", lambda: headscope.region_pool(a, w, rid, 2 ** 62)),
        "region_pool_qk": ("region_pool_qk", lambda: headscope.region_pool_qk(q, k, w, rid, 2 ** 40)),
        "vas_head_stats_qk": ("vas_head_stats_qk", lambda: headscope.vas_head_stats_qk(
            long_q, long_q, long_q, torch.tensor([5]))),
        "kl_project": ("kl_project", lambda: OPS.kl_project(problems, problems, 1e-8, 5)),
        "spearman": ("spearman", lambda: headscope.spearman(row, row)),
    }


@pytest.mark.parametrize("case", list(_huge_calls()))
def test_failed_allocation_is_an_out_of_memory_error_naming_the_op(case):
    op, call = _huge_calls()[case]
    with pytest.raises(torch.OutOfMemoryError, match=rf"^headscope::{op}: out of memory"):
        call()
