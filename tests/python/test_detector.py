"""headscope.VASDetector: logistic regression on VAS features, saved as safetensors."""
from __future__ import annotations

import pytest
import torch

import headscope
from headscope import VASDetector


def _data(n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 36, generator=g) * torch.linspace(0.1, 10, 36) + 3
    true_w = torch.zeros(36)
    true_w[[2, 7, 20]] = torch.tensor([2.0, -1.5, 1.0])
    logits = ((X - 3) / torch.linspace(0.1, 10, 36)) @ true_w
    y = torch.rand(n, generator=g) < torch.sigmoid(logits)
    return X, y


def test_fit_matches_sklearn_logistic_regression():
    from sklearn.linear_model import LogisticRegression
    X, y = _data()
    det = VASDetector().fit(X, y, l2=1e-2)
    Xs = ((X.double() - X.double().mean(0)) / X.double().std(0, unbiased=False)).numpy()
    # sklearn minimises sum(loss) + ||w||^2 / (2C); ours mean(loss) + l2 ||w||^2
    ref = LogisticRegression(C=1 / (2 * 1e-2 * len(y)), tol=1e-12, max_iter=10_000).fit(
        Xs, y.numpy())
    assert torch.allclose(det.weight, torch.from_numpy(ref.coef_[0]), atol=1e-5)
    assert abs(float(det.bias) - float(ref.intercept_[0])) < 1e-5
    p = det.predict_proba(X)
    assert torch.allclose(p, torch.from_numpy(ref.predict_proba(Xs)[:, 1]), atol=1e-6)
    assert torch.equal(det.predict(X), p > 0.5)
    assert float((det.predict(X) == y).double().mean()) > 0.7


def test_save_load_round_trip_and_damaged_files(tmp_path):
    X, y = _data()
    det = VASDetector().fit(X, y)
    path = tmp_path / "det.safetensors"
    det.save(path)
    back = VASDetector.load(path)
    assert torch.equal(back.predict_proba(X), det.predict_proba(X))
    assert [p.name for p in tmp_path.iterdir()] == ["det.safetensors"]
    (tmp_path / "bad.safetensors").write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"VASDetector.load\(.*bad.safetensors"):
        VASDetector.load(tmp_path / "bad.safetensors")
    head = headscope.AttributionHead(2, 3)
    head.save(tmp_path / "head.safetensors")
    with pytest.raises(ValueError, match="not a headscope.VASDetector file"):
        VASDetector.load(tmp_path / "head.safetensors")


@pytest.mark.parametrize("features, labels, match", [
    (torch.zeros(4, 35), torch.tensor([0, 1, 0, 1]), "argument 'features' must be a tensor"),
    (torch.zeros(4, 36), torch.tensor([0, 1, 2, 1]), "each 0 or 1"),
    (torch.zeros(4, 36), torch.tensor([0, 1, 1]), "must hold 4 values"),
    (torch.zeros(4, 36), torch.tensor([1, 1, 1, 1]), "both classes"),
    (torch.full((4, 36), float("nan")), torch.tensor([0, 1, 0, 1]), "NaN"),
])
def test_fit_refuses_bad_input(features, labels, match):
    with pytest.raises(ValueError, match=match):
        VASDetector().fit(features, labels)
