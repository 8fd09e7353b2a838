#!/usr/bin/env python3
"""Reproduces the synthetic experiment of vStream's reference implementation
(vstream_synth_repro.py; docs/attribution.md says where it is) with headscope's ops.

The data generator is the reference implementation's (copied here call for call so the
random streams are identical: numpy default_rng(0), L = 32, H = 36, 4000 train and 2000
test samples, 100 images of K = 32 regions). The estimator is
``headscope.AttributionHead.fit`` (the reference's standardised least squares), the metric
``headscope.lds``. Prints the LDS overall and per image next to the reference's own
numbers (recomputed here with NumPy/SciPy on the same data) and the time per span for
K = 32 regions: one ``linear_attribution`` call with the statistics stored, against the
reference's ``predict``, which recomputes the training mean and std on every call.

    PYTHONPATH=... python scripts/reproduce_vstream.py [--pearson-epochs N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def make_synthetic(L: int = 32, H: int = 36, n_train: int = 4000, n_test: int = 2000,
                   k_regions: int = 32, n_images: int = 100, n_rep: int = 200, seed: int = 0):
    """The reference implementation's data, generated in its order (bit-identical arrays)."""
    rng = np.random.default_rng(seed)
    D = L * H
    w_star = rng.standard_normal(D).astype(np.float64)
    w_star /= np.linalg.norm(w_star)

    def make_batch(n):
        F = rng.standard_normal((n, D)).astype(np.float64) * 0.5
        signal = F @ w_star
        noise = rng.standard_normal(n) * 0.7 * np.abs(signal).mean()
        return F, signal + noise

    Ftr, ytr = make_batch(n_train)
    Fte, yte = make_batch(n_test)
    spans = rng.standard_normal((n_rep, D)).astype(np.float64)
    images = [make_batch(k_regions) for _ in range(n_images)]
    return {"L": L, "H": H, "w_star": w_star, "Ftr": Ftr, "ytr": ytr, "Fte": Fte, "yte": yte,
            "spans": spans, "img_F": np.stack([f for f, _ in images]),
            "img_y": np.stack([y for _, y in images])}


def seed_reference(data) -> dict:
    """The reference implementation's own estimator and metric on the same data
    (NumPy/SciPy)."""
    from scipy.stats import spearmanr
    Ftr, ytr = data["Ftr"], data["ytr"]
    Ftr_s = (Ftr - Ftr.mean(0)) / (Ftr.std(0) + 1e-8)
    mu_y, sd_y = ytr.mean(), ytr.std() + 1e-8
    w = np.linalg.lstsq(Ftr_s, (ytr - mu_y) / sd_y, rcond=None)[0]

    def predict(F):
        return ((F - Ftr.mean(0)) / (Ftr.std(0) + 1e-8)) @ w

    overall = spearmanr(predict(data["Fte"]), data["yte"])[0]
    per_image = [spearmanr(predict(f), y)[0] for f, y in zip(data["img_F"], data["img_y"])]
    t0 = time.perf_counter()
    for s in data["spans"]:
        predict(s[None])
    t_span = (time.perf_counter() - t0) / len(data["spans"])
    return {"overall": float(overall), "per_image": float(np.mean(per_image)),
            "per_image_std": float(np.std(per_image)), "s_per_span_1_region": t_span,
            "predict": predict}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pearson-epochs", type=int, default=20,
                        help="also fit with fit_pearson for this many epochs (0: skip)")
    args = parser.parse_args(argv)

    import torch
    import headscope

    data = make_synthetic()
    L, H, K = data["L"], data["H"], data["img_F"].shape[1]
    ref = seed_reference(data)

    head = headscope.AttributionHead(L, H, dtype=torch.float64)
    head.fit(torch.from_numpy(data["Ftr"]), torch.from_numpy(data["ytr"]))
    torch.set_grad_enabled(False)  # inference below; fit_pearson enables grad itself
    pred_te = head(torch.from_numpy(data["Fte"]))
    pred_img = head(torch.from_numpy(data["img_F"]))           # (100, K)
    test = headscope.lds(pred_te, torch.from_numpy(data["yte"]))
    img = headscope.lds(pred_img, torch.from_numpy(data["img_y"]))
    overall, per_image = float(test.overall), float(img.per_image_mean)
    print(f"[headscope] L*H = {L}*{H} = {L * H} weights")
    print(f"[headscope] LDS overall ({len(data['yte'])} test samples) = {overall:.4f}   "
          f"reference: {ref['overall']:.4f}   |diff| = {abs(overall - ref['overall']):.2e}")
    print(f"[headscope] LDS per image ({len(data['img_y'])} images x {K} regions) = "
          f"{per_image:.4f} +/- {float(img.per_image.std(unbiased=False)):.4f}   reference: "
          f"{ref['per_image']:.4f} +/- {ref['per_image_std']:.4f}")

    # Time per span: scores of the K = 32 regions of one span, float32 as in a model.
    head32 = headscope.AttributionHead(L, H)
    head32.load_state_dict({k: v.float() for k, v in head.state_dict().items()})
    spans = torch.from_numpy(data["img_F"][:, :, :]).float()   # (100, K, L*H)
    head32(spans[0])
    times = []
    for rep in range(5):
        t0 = time.perf_counter()
        for s in spans:
            head32(s)
        times.append((time.perf_counter() - t0) / len(spans))
    t_ours = statistics.median(times)
    Ftr = data["Ftr"]
    t0 = time.perf_counter()
    for s in data["img_F"][:20]:
        ref["predict"](s)
    t_seed = (time.perf_counter() - t0) / 20
    print(f"[headscope] time per span (K = {K} regions, {L * H} features): {t_ours * 1e6:.1f} us"
          f"   reference's predict (recomputes mean/std of {Ftr.shape[0]}x{Ftr.shape[1]} "
          f"each call):"
          f" {t_seed * 1e3:.2f} ms   ({t_seed / t_ours:.0f}x)")

    ok = abs(overall - 0.81) <= 0.01 and abs(per_image - 0.80) <= 0.01
    if args.pearson_epochs > 0:
        gen = torch.Generator().manual_seed(0)
        Xtr, ytr = torch.from_numpy(data["Ftr"]), torch.from_numpy(data["ytr"])

        class Loader:
            def __iter__(self):
                perm = torch.randperm(len(ytr), generator=gen)
                for i in range(0, len(ytr), 500):
                    idx = perm[i:i + 500]
                    yield Xtr[idx], ytr[idx]

        hp = headscope.AttributionHead(L, H, dtype=torch.float64)
        t0 = time.perf_counter()
        with torch.enable_grad():
            hp.fit_pearson(Loader(), epochs=args.pearson_epochs, lr=1e-2)
        tp = time.perf_counter() - t0
        lp = headscope.lds(hp(torch.from_numpy(data["Fte"])), torch.from_numpy(data["yte"]))
        li = headscope.lds(hp(torch.from_numpy(data["img_F"])), torch.from_numpy(data["img_y"]))
        print(f"[headscope] fit_pearson ({args.pearson_epochs} epochs, minibatches of 500, "
              f"{tp:.1f} s): LDS overall = {float(lp.overall):.4f}, per image = "
              f"{float(li.per_image_mean):.4f}")
    print(f"[headscope] LDS within 0.01 of the reference's 0.81 overall / 0.80 per image: "
          f"{'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
