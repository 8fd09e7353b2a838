"""The vStream estimator, :class:`AttributionHead`: a span's L*H features per region (the
attention ops of ``attribution.py``) against one weight vector, its fits to measured
ablation effects (closed form, ``fit``; by Pearson correlation over minibatches, under
torch.distributed too, ``fit_pearson``) and its file format (``save``/``load``:
safetensors with the sizes, feature set and layout in the metadata)."""
# No "from __future__ import annotations": TorchScript reads the class annotations.
import json
import math
import sys
from typing import Iterable, Optional, Tuple

import torch
from torch import Tensor, nn

from .features import FEATURE_SETS, check_feature_set, feature_blocks
from .io import atomic_path

FORMAT = "headscope.AttributionHead"
FORMAT_VERSION = 1
FEATURE_LAYOUT = "layer_major"  # feature index = layer * num_heads + head
STD_EPS = 1e-8                   # added to the feature and target stds (as the reference)

__all__ = ["AttributionHead"]


def _check_fit_data(where: str, features: Tensor, targets: Tensor, num_features: int,
                    columns: str):
    if not isinstance(features, Tensor) or not features.is_floating_point():
        raise TypeError(f"headscope.AttributionHead.{where}: argument 'features' must be a "
                        f"floating tensor (..., {num_features}), got {features!r:.80}")
    if features.dim() < 1 or features.shape[-1] != num_features:
        raise ValueError(f"headscope.AttributionHead.{where}: argument 'features' must have "
                         f"{columns} = {num_features} entries in its last dimension, got shape "
                         f"{tuple(features.shape)}")
    if not isinstance(targets, Tensor) or targets.shape != features.shape[:-1]:
        raise ValueError(f"headscope.AttributionHead.{where}: argument 'targets' must have "
                         f"shape {tuple(features.shape[:-1])} (features without the last "
                         f"dimension), got "
                         f"{tuple(targets.shape) if isinstance(targets, Tensor) else targets!r}")
    if not bool(torch.isfinite(features).all()):
        raise ValueError(f"headscope.AttributionHead.{where}: argument 'features' holds NaN "
                         f"or Inf")
    if not bool(torch.isfinite(targets).all()):
        raise ValueError(f"headscope.AttributionHead.{where}: argument 'targets' holds NaN "
                         f"or Inf")
    return (features.reshape(-1, num_features).to(torch.float64),
            targets.reshape(-1).to(torch.float64))


def _dist_group(group):
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist, group
    return None, None


class AttributionHead(nn.Module):
    """The vStream estimator: scores = ((features - mean) / std) . weight + bias.

    ``features`` are ``(..., K, L*H)`` (layer-major, see ``stack_layers``); the result is
    one score per region, the predicted effect of ablating it (in the targets' units
    after ``fit``). Scriptable with ``torch.jit.script`` (``forward`` and
    ``predict_subsets``).

    ``feature_set`` says what the columns hold (:data:`FEATURE_SETS`): ``"attention"`` (the
    attention mass, ``L*H`` columns), ``"attention*value_norm"`` (the mass with each key
    weighted by its value norm, ``L*H``) or ``"both"`` (``2*L*H``: the attention block, then
    the weighted one). It is saved with the head, and ``load`` can require one.
    """

    num_layers: int
    num_heads: int
    reduce: str
    feature_set: str
    feature_blocks: int

    def __init__(self, num_layers: int, num_heads: int, reduce: str = "sum",
                 dtype: torch.dtype = torch.float32, feature_set: str = "attention"):
        super().__init__()
        if num_layers < 1 or num_heads < 1:
            raise ValueError(f"headscope.AttributionHead: num_layers and num_heads must be "
                             f">= 1, got {num_layers}, {num_heads}")
        if reduce not in ("sum", "mean"):
            raise ValueError(f"headscope.AttributionHead: reduce must be 'sum' or 'mean', "
                             f"got {reduce!r}")
        check_feature_set("headscope.AttributionHead", feature_set)
        self.num_layers = int(num_layers)
        self.num_heads = int(num_heads)
        self.reduce = reduce
        self.feature_set = feature_set
        self.feature_blocks = feature_blocks(feature_set)
        F = self.num_features
        self.weight = nn.Parameter(torch.zeros(F, dtype=dtype))
        self.register_buffer("mean", torch.zeros(F, dtype=dtype))
        self.register_buffer("std", torch.ones(F, dtype=dtype))
        self.register_buffer("bias", torch.zeros((), dtype=dtype))

    @property
    def num_features(self) -> int:
        return self.feature_blocks * self.num_layers * self.num_heads

    def forward(self, features: Tensor) -> Tensor:
        # The op would name its 'weight' argument; a head's user thinks in L*H features.
        F = self.feature_blocks * self.num_layers * self.num_heads
        if features.dim() < 1 or features.size(-1) != F:
            blocks = "2*" if self.feature_blocks == 2 else ""
            raise ValueError("headscope.AttributionHead: argument 'features' must have "
                             + blocks + "L*H = " + blocks + str(self.num_layers) + "*"
                             + str(self.num_heads) + " = " + str(F) + " entries in its last "
                             "dimension (feature set '" + self.feature_set + "'), got shape "
                             + str(features.shape))
        return torch.ops.headscope.linear_attribution(features, self.weight, self.mean,
                                                      self.std, self.bias)

    @torch.jit.export
    def predict_subsets(self, scores: Tensor, subsets: Tensor) -> Tensor:
        """Additive predicted effect of ablating each subset of regions together:
        ``scores`` ``(..., K)``, ``subsets`` ``(N, K)`` bool -> ``(..., N)``."""
        if subsets.dim() != 2 or subsets.dtype != torch.bool:
            raise ValueError("headscope.AttributionHead.predict_subsets: argument 'subsets' "
                             "must be a bool tensor (N, K), got " + str(subsets.dtype) + " "
                             + str(subsets.shape))
        if scores.dim() < 1 or scores.size(-1) != subsets.size(1):
            raise ValueError("headscope.AttributionHead.predict_subsets: argument 'scores' "
                             "must have K = " + str(subsets.size(1)) + " regions (the columns "
                             "of 'subsets') in its last dimension, got " + str(scores.shape))
        return torch.matmul(scores, subsets.to(scores.dtype).t())

    # ---- fitting (not scripted) ----------------------------------------------------------

    @torch.jit.unused
    def _columns(self) -> str:
        """What the feature columns count: "L*H", or "2*L*H" for the feature set "both"."""
        return "2*L*H" if self.feature_blocks == 2 else "L*H"

    @torch.jit.unused
    def _store(self, weight: Tensor, mean: Tensor, std: Tensor, bias: float) -> None:
        with torch.no_grad():
            self.weight.copy_(weight.to(self.weight))
            self.mean.copy_(mean.to(self.mean))
            self.std.copy_(std.to(self.std))
            self.bias.fill_(bias)

    @torch.jit.unused
    def fit(self, features: Tensor, targets: Tensor, ridge: float = 0.0,
            weights: Optional[Tensor] = None) -> "AttributionHead":
        """Closed-form fit, the estimator of the reference implementation
        (``vstream_synth_repro.py``, docs/attribution.md): least squares of the standardised
        targets on the standardised features (optimal for Pearson correlation), in float64.

        ``features`` ``(..., F)``, ``targets`` ``(...)``. ``ridge`` > 0 adds
        ``ridge * ||w||^2`` (standardised units); 0 gives the reference implementation's
        minimum-norm ``lstsq``. ``weights`` (the targets' shape, >= 0, not all 0): weighted
        least squares, with the means and standard deviations weighted alike (None: every
        sample weighs 1, the reference implementation). The stored weight and bias give
        predictions in the targets' units (the reference implementation's, times the
        targets' std, plus their mean: the same ranking and LDS).
        """
        X, y = _check_fit_data("fit", features, targets, self.num_features,
                               self._columns())
        if X.shape[0] < 2:
            raise ValueError(f"headscope.AttributionHead.fit: need at least 2 samples, got "
                             f"{X.shape[0]}")
        if ridge < 0 or not math.isfinite(ridge):
            raise ValueError(f"headscope.AttributionHead.fit: argument 'ridge' must be a "
                             f"finite value >= 0, got {ridge}")
        if weights is None:
            mean = X.mean(0)
            std = X.std(0, unbiased=False) + STD_EPS
            mu_y = y.mean()
            sd_y = y.std(unbiased=False) + STD_EPS
        else:
            if not isinstance(weights, Tensor) or weights.shape != targets.shape:
                got = tuple(weights.shape) if isinstance(weights, Tensor) else weights
                raise ValueError(f"headscope.AttributionHead.fit: argument 'weights' must "
                                 f"have the targets' shape {tuple(targets.shape)}, got {got!r}")
            weights = weights.reshape(-1).to(torch.float64)
            if not bool(torch.isfinite(weights).all() & (weights >= 0).all()) or \
                    not bool(weights.sum() > 0):
                raise ValueError("headscope.AttributionHead.fit: argument 'weights' must be "
                                 "finite and >= 0, not all 0")
            share = weights / weights.sum()
            mean = share @ X
            std = (share @ (X - mean) ** 2).sqrt() + STD_EPS
            mu_y = share @ y
            sd_y = (share @ (y - mu_y) ** 2).sqrt() + STD_EPS
        Xs = (X - mean) / std
        ys = (y - mu_y) / sd_y
        if weights is not None:
            # rows scaled by the root of weights that average 1, so that ridge keeps its scale
            root = (share * X.shape[0]).sqrt()
            Xs, ys = Xs * root.unsqueeze(1), ys * root
        if ridge == 0:
            w = torch.linalg.lstsq(Xs, ys.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        else:
            A = Xs.T @ Xs + ridge * torch.eye(Xs.shape[1], dtype=Xs.dtype)
            w = torch.linalg.solve(A, Xs.T @ ys)
        self._store(w * sd_y, mean, std, float(mu_y))
        return self

    @torch.jit.unused
    def calibrate(self, features: Tensor, targets: Tensor,
                  weights: Optional[Tensor] = None) -> "AttributionHead":
        """Puts the scores into the units of ``targets``: the least-squares slope and offset
        of the targets on the current scores (weighted by ``weights``, as :meth:`fit`'s)
        are folded into the weight and bias, so that the ranking is unchanged. For a head
        fitted to another target than the effects (ranks), so that its scores still
        predict effects. A slope that is not positive (scores that do not rise with the
        targets) is an error, as it would reverse the ranking."""
        X, y = _check_fit_data("calibrate", features, targets, self.num_features,
                               self._columns())
        share = torch.full_like(y, 1.0 / y.numel()) if weights is None else \
            weights.reshape(-1).to(torch.float64) / float(weights.sum())
        with torch.no_grad():
            p = torch.ops.headscope.linear_attribution(
                X, self.weight.double(), self.mean.double(), self.std.double(),
                self.bias.double())
        mp, my = share @ p, share @ y
        var = share @ (p - mp) ** 2
        slope = float(share @ ((p - mp) * (y - my)) / var) if var > 0 else 0.0
        if not slope > 0:
            raise ValueError(f"headscope.AttributionHead.calibrate: the targets do not rise "
                             f"with the scores (least-squares slope {slope:g}); calibrating "
                             f"would reverse the ranking")
        self._store(self.weight.double() * slope, self.mean, self.std,
                    float(my - slope * mp + slope * self.bias.double()))
        return self

    @torch.jit.unused
    def fit_pearson(self, loader: Iterable[Tuple[Tensor, Tensor]], epochs: int,
                    lr: float = 1e-2, progress: bool = False,
                    group=None) -> "AttributionHead":
        """Fits by minimising the negative Pearson correlation over minibatches.

        ``loader`` is re-iterable (e.g. a DataLoader) of ``(features (..., F), targets
        (...))`` batches. One pass computes the standardisation and a start (each
        feature's own correlation with the targets); then ``epochs`` passes of Adam on
        ``-pearson(scores, targets)`` per minibatch; a last pass calibrates scale and bias
        so scores are in the targets' units. Under ``torch.distributed`` (``group``, or
        the default group when initialised), every moment is all-reduced and so is the
        gradient: N processes, each with its share of every minibatch, compute exactly the
        weights one process computes on the whole minibatches. Every process must yield the
        same number of batches per pass (the collectives run once per batch).

        The loss is formed from the (all-reduced) moments with plain torch ops; the
        scores go through ``headscope.linear_attribution`` (differentiable).
        ``progress=True`` prints one line per epoch to stderr (quiet by default).
        """
        dist, group = _dist_group(group)
        F = self.num_features

        def all_sum(t: Tensor) -> Tensor:
            if dist is not None:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            return t

        # Pass 1: n, sum f, sum f^2, sum y, sum y^2, sum f y (float64, all-reduced).
        acc = torch.zeros(3 * F + 3, dtype=torch.float64)
        for features, targets in loader:
            X, y = _check_fit_data("fit_pearson", features, targets, F, self._columns())
            acc[0] += X.shape[0]
            acc[1:1 + F] += X.sum(0)
            acc[1 + F:1 + 2 * F] += (X * X).sum(0)
            acc[1 + 2 * F] += y.sum()
            acc[2 + 2 * F] += (y * y).sum()
            acc[3 + 2 * F:] += (X * y.unsqueeze(1)).sum(0)
        all_sum(acc)
        n = float(acc[0])
        if n < 2:
            raise ValueError(f"headscope.AttributionHead.fit_pearson: need at least 2 "
                             f"samples, got {int(n)}")
        mean = acc[1:1 + F] / n
        std = (acc[1 + F:1 + 2 * F] / n - mean * mean).clamp_min(0).sqrt() + STD_EPS
        my = float(acc[1 + 2 * F]) / n
        sy = math.sqrt(max(float(acc[2 + 2 * F]) / n - my * my, 0.0)) + STD_EPS
        cov = acc[3 + 2 * F:] / n - mean * my
        w = nn.Parameter((cov / (std * sy)).clone())
        opt = torch.optim.Adam([w], lr=lr)

        def moments(X: Tensor, y: Tensor, wt: Tensor) -> Tensor:
            p = torch.ops.headscope.linear_attribution(X, wt, mean, std)
            return torch.stack([torch.full((), float(X.shape[0]), dtype=torch.float64),
                                p.sum(), y.sum(), (p * p).sum(), (y * y).sum(), (p * y).sum()])

        def corr(m: Tensor) -> Tensor:
            n_, sp, sy_, spp, syy, spy = m.unbind()
            return (n_ * spy - sp * sy_) / torch.sqrt((n_ * spp - sp * sp) * (n_ * syy - sy_ * sy_))

        for epoch in range(epochs):
            total, batches = 0.0, 0
            for features, targets in loader:
                X, y = _check_fit_data("fit_pearson", features, targets, F, self._columns())
                opt.zero_grad()
                local = moments(X, y, w)
                glob = all_sum(local.detach().clone())
                # value of the global moments, gradient of the local ones
                m = local + (glob - local).detach()
                loss = -corr(m)
                loss.backward()
                all_sum(w.grad)
                opt.step()
                total += float(loss.detach())
                batches += 1
            if progress:
                print(f"headscope.fit_pearson: epoch {epoch + 1}/{epochs} mean loss "
                      f"{total / max(batches, 1):.6f}", file=sys.stderr)

        # Calibration: least-squares scale and offset of the targets on the scores.
        with torch.no_grad():
            m = torch.zeros(6, dtype=torch.float64)
            for features, targets in loader:
                X, y = _check_fit_data("fit_pearson", features, targets, F, self._columns())
                m += moments(X, y, w.detach())
            all_sum(m)
            n_, sp, sy_, spp, _, spy = m.tolist()
            var_p = spp / n_ - (sp / n_) ** 2
            a = (spy / n_ - sp / n_ * sy_ / n_) / var_p if var_p > 0 else 1.0
            b = sy_ / n_ - a * sp / n_
        self._store(w.detach() * a, mean, std, b)
        return self

    # ---- persistence ------------------------------------------------------------------------

    @torch.jit.unused
    def metadata(self) -> dict:
        return {"format": FORMAT, "format_version": str(FORMAT_VERSION),
                "num_layers": str(self.num_layers), "num_heads": str(self.num_heads),
                "num_features": str(self.num_features), "feature_layout": FEATURE_LAYOUT,
                "feature_set": self.feature_set, "reduce": self.reduce,
                "dtype": str(self.weight.dtype).replace("torch.", "")}

    @torch.jit.unused
    def save(self, path) -> None:
        """Writes weight, mean, std and bias to a safetensors file with metadata, atomically:
        into a temporary file in the same folder, then renamed over ``path``, so that an
        interrupted save leaves the previous file (or none), never half of one."""
        from safetensors.torch import save_file
        tensors = {name: t.detach().cpu().contiguous() for name, t in
                   (("weight", self.weight), ("mean", self.mean), ("std", self.std),
                    ("bias", self.bias))}
        with atomic_path(path) as tmp:
            save_file(tensors, tmp, metadata=self.metadata())

    @classmethod
    def load(cls, path, num_layers: Optional[int] = None, num_heads: Optional[int] = None,
             reduce: Optional[str] = None,
             feature_set: Optional[str] = None) -> "AttributionHead":
        """Reads a head written by ``save``; checks the format, version, sizes, layout and
        values, and (when given) that num_layers / num_heads / reduce / feature_set match
        (a file without a feature set holds an ``"attention"`` head)."""
        from safetensors import safe_open
        where = f"headscope.AttributionHead.load({str(path)!r})"
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                keys = set(f.keys())
                tensors = {k: f.get_tensor(k) for k in keys}
        except Exception as e:  # safetensors raises several types for damaged files
            raise ValueError(f"{where}: not a readable safetensors file (truncated or "
                             f"damaged?): {e}") from e
        if meta.get("format") != FORMAT:
            raise ValueError(f"{where}: metadata 'format' must be {FORMAT!r}, got "
                             f"{meta.get('format')!r}")
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise ValueError(f"{where}: metadata 'format_version' must be {FORMAT_VERSION}, "
                             f"got {meta.get('format_version')!r}")
        try:
            L, H, F = (int(meta["num_layers"]), int(meta["num_heads"]),
                       int(meta["num_features"]))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where}: metadata num_layers/num_heads/num_features missing or "
                             f"not integers: {json.dumps(meta)}") from e
        stored_set = meta.get("feature_set", "attention")
        if stored_set not in FEATURE_SETS:
            raise ValueError(f"{where}: metadata 'feature_set' must be one of "
                             f"{', '.join(map(repr, FEATURE_SETS))}, got {stored_set!r}")
        blocks = feature_blocks(stored_set)
        if L < 1 or H < 1 or F != blocks * L * H:
            raise ValueError(f"{where}: metadata num_features={F} must equal "
                             f"{'2 * ' if blocks == 2 else ''}num_layers * num_heads = "
                             f"{'2*' if blocks == 2 else ''}{L}*{H} (feature set "
                             f"{stored_set!r})")
        if meta.get("feature_layout") != FEATURE_LAYOUT:
            raise ValueError(f"{where}: metadata 'feature_layout' must be {FEATURE_LAYOUT!r}, "
                             f"got {meta.get('feature_layout')!r}")
        if meta.get("reduce") not in ("sum", "mean"):
            raise ValueError(f"{where}: metadata 'reduce' must be 'sum' or 'mean', got "
                             f"{meta.get('reduce')!r}")
        for name, want in (("num_layers", num_layers), ("num_heads", num_heads)):
            got = L if name == "num_layers" else H
            if want is not None and want != got:
                raise ValueError(f"{where}: the file holds a head with {name}={got}, "
                                 f"expected {want}")
        if reduce is not None and reduce != meta["reduce"]:
            raise ValueError(f"{where}: the file holds a head with reduce="
                             f"{meta['reduce']!r}, expected {reduce!r}")
        if feature_set is not None and feature_set != stored_set:
            raise ValueError(f"{where}: the file holds a head fitted on {stored_set!r} "
                             f"features, expected {feature_set!r} (fit a head on features "
                             f"of that set)")
        if keys != {"weight", "mean", "std", "bias"}:
            raise ValueError(f"{where}: tensors must be weight, mean, std, bias; got "
                             f"{sorted(keys)}")
        for name in ("weight", "mean", "std"):
            if tuple(tensors[name].shape) != (F,):
                raise ValueError(f"{where}: tensor {name!r} must have shape ({F},) = "
                                 f"num_features, got {tuple(tensors[name].shape)}")
        if tuple(tensors["bias"].shape) != ():
            raise ValueError(f"{where}: tensor 'bias' must be a scalar, got shape "
                             f"{tuple(tensors['bias'].shape)}")
        for name, t in tensors.items():
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise ValueError(f"{where}: tensor {name!r} must hold finite floats")
        if not bool((tensors["std"] > 0).all()):
            raise ValueError(f"{where}: tensor 'std' must be positive")
        head = cls(L, H, reduce=meta["reduce"], dtype=tensors["weight"].dtype,
                   feature_set=stored_set)
        head._store(tensors["weight"], tensors["mean"], tensors["std"],
                    float(tensors["bias"]))
        return head
