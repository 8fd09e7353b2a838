"""Reproduces the reference implementation kl_projection_reference.py (docs/mixer.md says
where it is) with headscope's ops: the same random draws (numpy default_rng(7)), the same
three predictions and mini experiment, the same JSON layout, plus a table. With
../shared/seeds present, the reference implementation runs beside it and both columns are
printed.

    python scripts/reproduce_kl_projection.py [--json results.json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import headscope
from headscope.bench._util import load_seed

ops = torch.ops.headscope


def project(Ub, Vb):
    U, V, z, iters, res = ops.kl_project(torch.from_numpy(np.log(Ub)),
                                         torch.from_numpy(np.log(Vb)), 1e-11, 80)
    return U.numpy(), V.numpy(), z.numpy(), int(iters), float(res)


def hessian(U, V):
    return np.diag(U.sum(0) + V.sum(0)) - U.T @ U - V.T @ V


def reproduce(project=project):
    """The reference implementation's run(), with `project` (ours by default) in place of
    its own."""
    rng = np.random.default_rng(7)
    rows = []
    for n in [16, 32, 64, 128]:
        for r in [2, 4, 8]:
            A, B = rng.normal(size=(n, r)), rng.normal(size=(n, r))
            U, V, z, its, res = project(np.exp(A), np.exp(B))[:5]
            rows.append({"n": n, "r": r, "residual": res, "iters": its,
                         "row_res": float(max(abs(U.sum(1) - 1).max(), abs(V.sum(1) - 1).max())),
                         "col_match": float(abs(U.sum(0) - V.sum(0)).max()),
                         "h_null": float(np.linalg.norm(hessian(U, V) @ np.ones(r)))})
    hv = []
    for r in [2, 4, 8, 12]:
        n = 40
        U, V = project(np.exp(rng.normal(size=(n, r))), np.exp(rng.normal(size=(n, r))))[:2]
        s = rng.normal(size=r)
        H = hessian(U, V)
        got = ops.kl_hvp(torch.from_numpy(U), torch.from_numpy(V), torch.from_numpy(s)).numpy()
        hv.append({"r": r, "hvp_relative_error": float(np.linalg.norm(got - H @ s) /
                                                       (np.linalg.norm(H @ s) + 1e-15)),
                   "min_gauge_eigen": float(np.linalg.eigvalsh(H[:-1, :-1]).min())})
    app = []
    for n, r in [(32, 4), (64, 4), (128, 8), (256, 8)]:
        U, V, _, _, res = project(np.exp(rng.normal(size=(n, r))), np.exp(rng.normal(size=(n, r))))[:5]
        X = rng.normal(size=(n, 16))
        W = (U / U.sum(0)[None, :]) @ V.T
        Yd = W @ X
        Yt = ops.thin_mix(torch.from_numpy(U), torch.from_numpy(V), torch.from_numpy(X)).numpy()
        app.append({"n": n, "r": r,
                    "apply_rel_error": float(np.linalg.norm(Yd - Yt) / (np.linalg.norm(Yd) + 1e-15)),
                    "dense_entries": n * n, "factor_entries": 2 * n * r + r,
                    "storage_ratio": float(n * n / (2 * n * r + r))})
    n, r, d = 256, 8, 32
    Q, K, X = rng.normal(size=(n, d)), rng.normal(size=(n, d)), rng.normal(size=(n, d))
    t = time.perf_counter()
    S = Q @ K.T / np.sqrt(d)
    S -= S.max(1, keepdims=True)
    P = np.exp(S)
    P /= P.sum(1, keepdims=True)
    yd = P @ X
    dense_ms = 1000 * (time.perf_counter() - t)
    U, V, _, _, res = project(np.exp(Q[:, :r] / 3), np.exp(K[:, :r] / 3))[:5]
    Ut, Vt, Xt = (torch.from_numpy(a) for a in (U, V, X))
    ops.thin_mix(Ut, Vt, Xt)  # warm-up: the reference's numpy needs none
    t = time.perf_counter()
    yi = ops.thin_mix(Ut, Vt, Xt).numpy()
    thin_ms = 1000 * (time.perf_counter() - t)
    return {"prediction_1_feasibility": rows, "prediction_2_hvp": hv,
            "prediction_3_application": app,
            "mini_experiment": {"n": n, "rank": r, "dense_ms": dense_ms, "thin_ms": thin_ms,
                                "dense_attention_row_residual": float(abs(P.sum(1) - 1).max()),
                                "idea_ds_residual": float(res), "dense_state_entries": n * n,
                                "idea_factor_entries": 2 * n * r + r,
                                "output_relative_difference": float(
                                    np.linalg.norm(yd - yi) / (np.linalg.norm(yd) + 1e-15))}}


def print_tables(ours, seed=None):
    print("Prediction 1: residual and iterations (headscope | reference implementation)")
    print(f"{'n':>4} {'r':>2} {'residual':>10} {'iters':>5} {'row_res':>9} {'col_match':>9}"
          + ("   |  ref residual  iters" if seed else ""))
    for i, row in enumerate(ours["prediction_1_feasibility"]):
        line = (f"{row['n']:>4} {row['r']:>2} {row['residual']:>10.2e} {row['iters']:>5} "
                f"{row['row_res']:>9.2e} {row['col_match']:>9.2e}")
        if seed:
            s = seed["prediction_1_feasibility"][i]
            line += f"   | {s['residual']:>13.2e} {s['iters']:>6}"
        print(line)
    print("\nPrediction 2: analytic HVP against the Hessian")
    for row in ours["prediction_2_hvp"]:
        print(f"  r={row['r']:>2}  relative error {row['hvp_relative_error']:.2e}  "
              f"min gauge eigenvalue {row['min_gauge_eigen']:.3f}")
    print("\nPrediction 3: thin application against dense W, storage ratio n^2 / (2nr + r)")
    for row in ours["prediction_3_application"]:
        print(f"  n={row['n']:>3} r={row['r']}  relative error {row['apply_rel_error']:.2e}  "
              f"storage ratio {row['storage_ratio']:.2f}")
    m = ours["mini_experiment"]
    print(f"\nMini experiment (n={m['n']}, r={m['rank']}): dense softmax {m['dense_ms']:.3f} ms, "
          f"thin mixer {m['thin_ms']:.3f} ms, doubly-stochastic residual {m['idea_ds_residual']:.1e}, "
          f"output difference to softmax attention {m['output_relative_difference']:.3f} "
          f"(a different operator, as in the reference implementation)")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results (the reference's layout) here")
    args = parser.parse_args()
    ours = reproduce()
    seed_module = load_seed("kl_projection_reference")
    seed = reproduce(seed_module.project) if seed_module else None
    print_tables(ours, seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ours, f, indent=2)


if __name__ == "__main__":
    main()
