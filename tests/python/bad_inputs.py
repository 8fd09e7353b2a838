"""The bad-input matrix: every op, through torch.ops.headscope, fed each bad input that
applies to each of its tensor arguments. Run as a script it prints one line per case
(``ok``/``FAIL``, op, case) and exits non-zero on a failure; test_bad_inputs.py runs it in a
subprocess, so that a crash is reported, not suffered.

What each case must do:
* ``error``: raise an error whose message names the op (``headscope::op``) and the argument;
* ``same``: compute exactly the result of the well-formed call (layouts: non-contiguous,
  expanded with stride 0, overlapping views);
* ``error_or_nonfinite``: raise as above, or return a result holding NaN or Inf (NaN/Inf in);
* ``error_or_result``: raise as above, or return (empty inputs, zero-size dimensions).
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, List, Tuple

import torch

import headscope  # noqa: F401  (loads the ops)

OPS = torch.ops.headscope
g = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def softmax(*shape):
    return torch.softmax(rand(*shape), -1)


def regions(B, T, K):
    """Region ids in [-1, K) with key 0 of every row an image token, so that the NaN and
    Inf cases of key_weights (written at index 0) reach a factor the ops read."""
    ids = torch.randint(-1, K, (B, T), generator=g)
    ids[:, 0] = 0
    return ids


def blocks(B, T):
    """block_ids with one bidirectional block per row (the q/k ops' attention pattern)."""
    ids = torch.full((B, T), -1, dtype=torch.long)
    ids[:, T // 4:T // 2] = 0
    return ids


# op -> (argument names, well-formed arguments, names of float tensor arguments that take
# values (NaN/Inf cases), extra value cases {description: (argument index, bad value)})
VALID: Dict[str, Tuple] = {
    "kl_project": (["log_u_ref", "log_v_ref", "tol", "max_iter"],
                   [rand(2, 12, 3).double(), rand(2, 12, 3).double(), 1e-10, 50],
                   {"log_u_ref", "log_v_ref"},
                   {"tol < 0": (2, -1.0), "max_iter < 0": (3, -1)}),
    "kl_hvp": (["U", "V", "s"], [softmax(12, 3).double(), softmax(12, 3).double(),
                                 rand(3).double()], {"U", "V", "s"}, {}),
    "thin_mix": (["U", "V", "X"], [softmax(12, 3), softmax(12, 3), rand(12, 5)],
                 {"U", "V", "X"}, {}),
    "vas_head_stats": (["attn", "head_writes", "lengths", "offsets"],
                       [softmax(2, 2, 16, 16), rand(2, 2, 16, 8), torch.tensor([16, 9]),
                        torch.tensor([0, 3])], {"attn", "head_writes"},
                       {"length > T": (2, torch.tensor([17, 9])),
                        "negative length": (2, torch.tensor([-1, 9])),
                        "window past T": (3, torch.tensor([0, 8])),
                        "negative offset": (3, torch.tensor([-1, 0]))}),
    "vas_head_stats_qk": (["q", "k", "head_writes", "lengths", "scale", "causal", "offsets",
                           "key_padding_mask", "window", "chunk", "block_ids", "softcap",
                           "window_bounds_blocks", "chunk_origin"],
                          [rand(2, 4, 16, 8), rand(2, 2, 16, 8), rand(2, 4, 16, 8),
                           torch.tensor([16, 9]), 0.35, True, None,
                           torch.zeros(2, 16, dtype=torch.bool), 5, 8, blocks(2, 16), 3.0,
                           True, torch.tensor([-3, 21])],
                          {"q", "k", "head_writes"},
                          {"scale inf": (4, float("inf")),
                           "length > T": (3, torch.tensor([17, 9])),
                           "kv heads not dividing": (1, rand(2, 3, 16, 8)),
                           "window < 0": (8, -1), "chunk < 0": (9, -2),
                           "block_ids int32": (10, blocks(2, 16).int()),
                           "block_ids of T - 1 keys": (10, blocks(2, 15)),
                           "softcap 0": (11, 0.0), "softcap nan": (11, float("nan")),
                           "chunk_origin without chunk": (9, None),
                           "chunk_origin of 3 rows": (13, torch.tensor([0, 1, 2]))}),
    "vas_aggregate": (["head_stats"], [rand(2, 3, 4, 3)], {"head_stats"},
                      {"last dim 2": (0, rand(2, 3, 4, 2))}),
    "region_pool": (["attn", "query_weights", "region_ids", "num_regions", "reduce",
                     "key_weights"],
                    [softmax(2, 3, 5, 20), torch.rand(2, 5, generator=g) + 0.1,
                     regions(2, 20, 4), 4, "sum",
                     torch.rand(2, 3, 20, generator=g)],
                    {"attn", "query_weights", "key_weights"},
                    {"key_weights of 2 heads for 3": (5, torch.rand(2, 2, 20, generator=g)),
                     "region id >= K": (2, torch.full((2, 20), 4)),
                     "region id < -1": (2, torch.full((2, 20), -2)),
                     "num_regions 0": (3, 0), "reduce max": (4, "max"),
                     "negative weights": (1, -torch.ones(2, 5)),
                     "zero weights": (1, torch.zeros(2, 5))}),
    "region_pool_qk": (["q", "k", "query_weights", "region_ids", "num_regions", "scale",
                        "causal", "key_padding_mask", "reduce", "window", "chunk", "block_ids",
                        "softcap", "window_bounds_blocks", "key_weights", "chunk_origin"],
                       [rand(2, 4, 5, 8), rand(2, 2, 20, 8), torch.rand(2, 5, generator=g) + .1,
                        regions(2, 20, 4), 4, 0.35, True, None, "sum",
                        # window, chunk and the chunks' origin: key 0 seen (NaN cases)
                        20, 20, blocks(2, 20), 3.0,
                        True, torch.rand(2, 2, 20, generator=g), torch.tensor([-20, 40])],
                       {"q", "k", "query_weights", "key_weights"},
                       {"key_weights of 3 heads for 4": (14, torch.rand(2, 3, 20, generator=g)),
                        "region id >= K": (3, torch.full((2, 20), 4)),
                        "num_regions -1": (4, -1), "scale nan": (5, float("nan")),
                        "reduce max": (8, "max"), "window < 0": (9, -1), "chunk < 0": (10, -1),
                        "block_ids float": (11, blocks(2, 20).float()),
                        "block_ids of 3 rows": (11, blocks(3, 20)),
                        "softcap -1": (12, -1.0), "softcap inf": (12, float("inf")),
                        "chunk_origin with chunk 0": (10, 0)}),
    # tensor lists: the bad inputs go to their first tensor ("q[0]", "k[0]")
    "region_pool_qk_layers": (["q", "k", "query_weights", "region_ids", "num_regions", "scale",
                               "causal", "key_padding_mask", "reduce", "window", "chunk",
                               "block_ids", "softcap", "window_bounds_blocks", "key_weights",
                               "chunk_origin"],
                              [[rand(2, 4, 5, 8), rand(2, 4, 5, 8)],
                               [rand(2, 2, 20, 8), rand(2, 2, 20, 8)],
                               torch.rand(2, 5, generator=g) + .1,
                               regions(2, 20, 4), 4, [0.35, 0.3], True,
                               None, "sum", [20, 0], [0, 20], blocks(2, 20), 3.0, True,
                               [torch.rand(2, 2, 20, generator=g),
                                torch.rand(2, 4, 20, generator=g)], torch.tensor([-20, 40])],
                              {"q[0]", "k[0]", "query_weights", "key_weights[0]"},
                              {"one layer of key_weights": (14, [torch.rand(2, 2, 20)]),
                               "one layer of k": (1, [rand(2, 2, 20, 8)]),
                               "layers of two dtypes": (0, [rand(2, 4, 5, 8),
                                                            rand(2, 4, 5, 8).double()]),
                               "no layer": (0, []),
                               "one scale": (5, [0.35]), "scale nan": (5, [0.35, float("nan")]),
                               "region id >= K": (3, torch.full((2, 20), 4)),
                               "reduce max": (8, "max"), "one window": (9, [6]),
                               "negative window": (9, [6, -1]), "one chunk": (10, [12]),
                               "negative chunk": (10, [-1, 12]),
                               "block_ids of 19 keys": (11, blocks(2, 19)),
                               "softcap 0": (12, 0.0),
                               "chunk_origin without chunks": (10, [0, 0]),
                               "chunk_origin of 1 row": (15, torch.tensor([3]))}),
    "linear_attribution": (["features", "weight", "mean", "std", "bias"],
                           [rand(3, 5, 8), rand(8), rand(8), torch.rand(8, generator=g) + 0.5,
                            torch.tensor(0.1)], {"features", "weight", "mean", "std", "bias"},
                           {"weight of F + 1": (1, rand(9))}),
    "spearman": (["pred", "target", "dim"], [rand(4, 10), rand(4, 10), -1], {"pred", "target"},
                 {"dim 2": (2, 2), "dim -3": (2, -3), "shapes differ": (1, rand(4, 11))}),
    "pearson": (["pred", "target", "dim"], [rand(4, 10), rand(4, 10), -1], {"pred", "target"},
                {"dim 2": (2, 2)}),
    "ward_regions": (["features", "height", "width", "num_regions", "frames"],
                     [rand(24, 5), 4, 3, 5, 2], {"features"},
                     {"frames*height*width != rows": (1, 5), "num_regions 0": (3, 0),
                      "num_regions > rows": (3, 25), "height 0": (1, 0),
                      "negative width": (2, -6), "sizes overflowing int32": (1, 1 << 31),
                      "frames 0": (4, 0), "negative frames": (4, -2),
                      "frames overflowing int32": (4, 1 << 31)}),
}

# arguments of any rank (leading dimensions are batch dimensions)
ANY_RANK = {("linear_attribution", "features"), ("spearman", "pred"), ("spearman", "target"),
            ("pearson", "pred"), ("pearson", "target"), ("kl_project", "log_u_ref"),
            ("kl_project", "log_v_ref"), ("kl_hvp", "U"), ("kl_hvp", "V"), ("kl_hvp", "s"),
            ("thin_mix", "U"), ("thin_mix", "V"), ("thin_mix", "X")}
# values whose infinities are meaningful (ranks order them)
INF_OK = {("spearman", "pred"), ("spearman", "target")}


def call(op: str, args: List) -> object:
    return getattr(OPS, op)(*args)


def tensors(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def equal(a, b) -> bool:
    """Equal up to the rounding of a different summation order (4 units in the last place):
    the ops read any strides, and some reduce in the order the layout gives."""
    if isinstance(a, (tuple, list)):
        return all(equal(x, y) for x, y in zip(a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    eps = torch.finfo(a.dtype).eps
    return bool(torch.isclose(a, b, rtol=4 * eps, atol=4 * eps, equal_nan=True).all())


def names_op_and_arg(message: str, op: str, arg: str) -> bool:
    return f"headscope::{op}" in message and f"'{arg}'" in message


def cases() -> List[Tuple[str, str, str, Callable[[], object], str]]:
    """(op, case, argument, thunk, expectation)."""
    f, w, mu, sd, bias = VALID["linear_attribution"][1]
    out = [("linear_attribution", f"std {v}", "std",
            (lambda v=v: call("linear_attribution", [f, w, mu, torch.full_like(sd, v), bias])),
            "error_or_nonfinite") for v in (0.0, -1.0)]
    for op, (names, valid, valued, extra) in VALID.items():
        for i, (name, v) in enumerate(zip(names, valid)):
            listed = isinstance(v, list)
            if listed:
                name, v = f"{name}[0]", v[0]
            if not isinstance(v, torch.Tensor):
                continue

            def replaced(x, i=i, valid=valid, listed=listed):
                args = list(valid)
                args[i] = [x] + valid[i][1:] if listed else x
                return args

            def with_arg(x, op=op, replaced=replaced):
                args = replaced(x)
                return lambda: call(op, args)

            rank_case = "error_or_result" if (op, name) in ANY_RANK else "error"
            out.append((op, "rank + 1", name, with_arg(v.unsqueeze(0)), rank_case))
            if v.dim() > 1:
                out.append((op, "rank - 1", name, with_arg(v.flatten(0, 1)), rank_case))
            if v.dim() >= 1:
                out.append((op, "rank 0", name, with_arg(v.flatten()[0]), "error"))
            for dtype in (torch.bool, torch.complex64, torch.int32,
                          torch.float64 if v.dtype != torch.float64 else torch.int64):
                if dtype == v.dtype:
                    continue
                expect = "error"
                if v.dtype.is_floating_point and dtype == torch.float64:
                    expect = "error_or_result"  # ops taking float32 and float64
                out.append((op, f"dtype {dtype}", name, with_arg(v.to(dtype)), expect))
            if sum(isinstance(a, torch.Tensor) for a in valid) > 1:
                out.append((op, "mixed devices (meta)", name, with_arg(v.to("meta")), "error"))
            if v.dim() >= 1:
                out.append((op, "zero-size last dim", name, with_arg(v[..., :0]),
                            "error_or_result"))
                wide = torch.zeros(*v.shape[:-1], 2 * v.shape[-1], dtype=v.dtype)
                wide[..., ::2] = v
                out.append((op, "non-contiguous", name, with_arg(wide[..., ::2]), "same"))
            if v.dim() >= 2:
                t = v.transpose(-1, -2).contiguous().transpose(-1, -2)
                out.append((op, "transposed layout", name, with_arg(t), "same"))
            if v.dim() >= 1 and v.shape[0] > 1:
                rows = v[:1].expand_as(v)  # stride 0: every row the first
                args = replaced(rows.contiguous())
                ref = (lambda args=args, op=op: call(op, args))
                out.append((op, "expanded (stride 0)", name, with_arg(rows),
                            ("same_as", ref)))
            if name in valued:
                for bad in (float("nan"), float("inf")):
                    x = v.clone()
                    x.view(-1)[0] = bad
                    expect = "error_or_result" if (op, name) in INF_OK and bad == float("inf") \
                        else "error_or_nonfinite"
                    out.append((op, f"{bad} in", name, with_arg(x), expect))
        for desc, (i, bad) in extra.items():
            args = list(valid)
            args[i] = bad
            out.append((op, desc, names[i], (lambda args=args, op=op: call(op, args)), "error"))
    return out


def run() -> int:
    failures = 0
    all_cases = cases()
    for op, desc, arg, thunk, expect in all_cases:
        names, valid = VALID[op][0], VALID[op][1]
        ok, why = True, ""
        try:
            result = thunk()
        except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as e:
            msg = str(e)
            if isinstance(expect, tuple):  # the materialised call must raise alike
                try:
                    expect[1]()
                    ok, why = False, f"raised for a valid layout: {msg[:160]}"
                except (RuntimeError, ValueError) as e2:
                    ok = str(e2) == msg
                    why = "" if ok else "raised unlike the materialised call"
            elif expect == "same":
                ok, why = False, f"raised for a valid layout: {msg[:160]}"
            elif f"headscope::{op}" not in msg:
                ok, why = False, f"error does not name the op: {msg[:160]}"
            elif expect == "error" and f"'{arg}'" not in msg and not any(
                    f"'{n}'" in msg or f"'{n}[" in msg for n in names):  # [: a list's tensor
                ok, why = False, f"error names no argument: {msg[:160]}"
        else:
            if expect == "error":
                ok, why = False, "returned instead of raising"
            elif expect == "same":
                ok = equal(result, call(op, valid))
                why = "" if ok else "result differs from the contiguous call"
            elif isinstance(expect, tuple):
                ok = equal(result, expect[1]())
                why = "" if ok else "result differs from the materialised call"
            elif expect == "error_or_nonfinite":
                ok = any(r.is_floating_point() and not bool(torch.isfinite(r).all())
                         for r in tensors(result))
                why = "" if ok else "NaN/Inf in, finite numbers out"
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {op}: {desc} ({arg}) {why}", flush=True)
    print(f"{len(all_cases)} cases, {failures} failed")
    return failures


if __name__ == "__main__":
    sys.exit(1 if run() else 0)
