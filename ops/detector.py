""":class:`VASDetector`: hallucination detection from an answer's VAS features, a logistic
regression on the standardised features, stored as safetensors."""
from __future__ import annotations

import json
from typing import Optional, Sequence

import torch
from torch import Tensor

from .head import STD_EPS
from .io import atomic_path
from .vas import VAS_COLUMNS

FORMAT = "headscope.VASDetector"
FORMAT_VERSION = 1


class VASDetector:
    """p(hallucination) = sigmoid(((features - mean) / std) . weight + bias).

    ``fit(features (N, F), labels (N,))`` minimises the mean logistic loss plus
    ``l2 * ||weight||^2`` (standardised units) with L-BFGS in float64; labels are 1 (or
    True) for a hallucinated answer. ``F`` defaults to the 36 columns of
    :data:`headscope.VAS_COLUMNS`. ``columns``: the features' names, saved with the
    detector (default: ``VAS_COLUMNS`` for 36 features, else none), so that a file says
    what it reads (``python -m headscope detector`` picks the columns of its table by
    them).
    """

    def __init__(self, num_features: int = len(VAS_COLUMNS),
                 columns: Optional[Sequence[str]] = None):
        if num_features < 1:
            raise ValueError(f"headscope.VASDetector: num_features must be >= 1, got "
                             f"{num_features}")
        if columns is None and num_features == len(VAS_COLUMNS):
            columns = VAS_COLUMNS
        if columns is not None and (not isinstance(columns, (list, tuple))
                                    or len(columns) != num_features or len(set(columns))
                                    != num_features or not all(isinstance(c, str)
                                                               for c in columns)):
            raise ValueError(f"headscope.VASDetector: columns must be {num_features} distinct "
                             f"names, got {columns!r}")
        self.columns = None if columns is None else list(columns)
        self.num_features = int(num_features)
        self.weight = torch.zeros(self.num_features, dtype=torch.float64)
        self.mean = torch.zeros(self.num_features, dtype=torch.float64)
        self.std = torch.ones(self.num_features, dtype=torch.float64)
        self.bias = torch.zeros((), dtype=torch.float64)

    def _features(self, where: str, features: Tensor) -> Tensor:
        if not isinstance(features, Tensor) or features.dim() != 2 or \
                features.shape[1] != self.num_features:
            shape = tuple(features.shape) if isinstance(features, Tensor) else type(features)
            raise ValueError(f"headscope.VASDetector.{where}: argument 'features' must be a "
                             f"tensor (N, {self.num_features}), got {shape}")
        X = features.detach().to(torch.float64).cpu()
        if not bool(torch.isfinite(X).all()):
            raise ValueError(f"headscope.VASDetector.{where}: argument 'features' holds NaN "
                             f"or Inf")
        return X

    def fit(self, features: Tensor, labels: Tensor, l2: float = 1e-3,
            max_iter: int = 500) -> "VASDetector":
        X = self._features("fit", features)
        y = torch.as_tensor(labels).detach().to(torch.float64).cpu().reshape(-1)
        if y.shape[0] != X.shape[0] or not bool(((y == 0) | (y == 1)).all()):
            raise ValueError(f"headscope.VASDetector.fit: argument 'labels' must hold "
                             f"{X.shape[0]} values, each 0 or 1")
        if not 0 < float(y.sum()) < y.shape[0]:
            raise ValueError("headscope.VASDetector.fit: the labels need both classes")
        if not l2 >= 0:
            raise ValueError(f"headscope.VASDetector.fit: argument 'l2' must be >= 0, got {l2}")
        mean = X.mean(0)
        std = X.std(0, unbiased=False) + STD_EPS
        Xs = (X - mean) / std
        w = torch.zeros(self.num_features + 1, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([w], max_iter=max_iter, tolerance_grad=1e-10,
                                      tolerance_change=1e-12, line_search_fn="strong_wolfe")

        def loss_fn():
            optimizer.zero_grad()
            logits = Xs @ w[:-1] + w[-1]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) \
                + l2 * (w[:-1] ** 2).sum()
            loss.backward()
            return loss

        optimizer.step(loss_fn)
        self.weight, self.bias = w[:-1].detach().clone(), w[-1].detach().clone()
        self.mean, self.std = mean, std
        return self

    def predict_proba(self, features: Tensor) -> Tensor:
        """``(N,)`` float64 probability that each answer is hallucinated."""
        X = self._features("predict_proba", features)
        return torch.sigmoid((X - self.mean) / self.std @ self.weight + self.bias)

    def predict(self, features: Tensor, threshold: float = 0.5) -> Tensor:
        """``(N,)`` bool: hallucinated (probability above ``threshold``)."""
        return self.predict_proba(features) > threshold

    def save(self, path) -> None:
        """Writes the detector to a safetensors file, atomically."""
        from safetensors.torch import save_file
        tensors = {"weight": self.weight, "mean": self.mean, "std": self.std,
                   "bias": self.bias}
        metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION),
                    "num_features": str(self.num_features)}
        if self.columns is not None:
            metadata["columns"] = json.dumps(self.columns)
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)

    @classmethod
    def load(cls, path) -> "VASDetector":
        """Reads a detector written by :meth:`save`, checking its format and values."""
        from safetensors import safe_open
        where = f"headscope.VASDetector.load({str(path)!r})"
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several types for damaged files
            raise ValueError(f"{where}: not a readable safetensors file: {e}") from e
        if meta.get("format") != FORMAT or meta.get("format_version") != str(FORMAT_VERSION):
            raise ValueError(f"{where}: not a {FORMAT} file of version {FORMAT_VERSION} "
                             f"(metadata {meta})")
        F = int(meta.get("num_features", "0"))
        shapes = {"weight": (F,), "mean": (F,), "std": (F,), "bias": ()}
        if {k: tuple(v.shape) for k, v in tensors.items()} != shapes:
            raise ValueError(f"{where}: tensors must be {shapes}, got "
                             f"{ {k: tuple(v.shape) for k, v in tensors.items()} }")
        if not all(bool(torch.isfinite(v).all()) for v in tensors.values()) or \
                not bool((tensors["std"] > 0).all()):
            raise ValueError(f"{where}: values must be finite and std positive")
        try:
            columns = json.loads(meta["columns"]) if "columns" in meta else None
            detector = cls(F, columns)
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: its column names are damaged: {e}") from e
        for k, v in tensors.items():
            setattr(detector, k, v.to(torch.float64))
        return detector
