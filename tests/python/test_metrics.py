"""headscope.metrics: the bootstrap interval on known cases and the exact expectation of
random pointing."""
from __future__ import annotations

import math

import pytest
import torch

from headscope.metrics import (bootstrap_interval, mean_with_interval, random_pointing,
                               region_centroids)


def test_bootstrap_interval_of_a_known_mean():
    values = 0.3 + torch.randn(400, generator=torch.Generator().manual_seed(1),
                               dtype=torch.float64)
    low, high = bootstrap_interval(values)
    mean, half = float(values.mean()), 1.96 * float(values.std()) / math.sqrt(400)
    assert low < mean < high
    # the normal-theory interval, to the bootstrap's resampling error
    assert abs(low - (mean - half)) < 0.02 and abs(high - (mean + half)) < 0.02
    assert bootstrap_interval(torch.full((10,), 0.25)) == pytest.approx((0.25, 0.25))
    assert bootstrap_interval(values) == bootstrap_interval(values)  # seeded
    m = mean_with_interval(values)
    assert m["n"] == 400 and m["mean"] == pytest.approx(mean)
    assert m["se"] == pytest.approx(float(values.std()) / 20)
    with pytest.raises(ValueError, match="at least 2"):
        bootstrap_interval(torch.tensor([1.0]))
    assert mean_with_interval(torch.tensor([0.5])) == {"mean": 0.5, "se": None,
                                                      "interval95": None, "n": 1}
    assert mean_with_interval(torch.tensor([]))["mean"] is None


def test_random_pointing_is_the_exact_expectation():
    # a 2 x 4 token grid in 3 regions: the left column pair, the right column pair of the
    # top row, everything else; centroids (0.25, 0.5), (0.75, 0.25), (0.75, 0.75)
    labels = torch.tensor([0, 0, 1, 1,
                           0, 0, 2, 2])
    centroids = region_centroids(labels, 2, 4, 3)
    assert torch.allclose(centroids, torch.tensor([[0.25, 0.5], [0.75, 0.25], [0.75, 0.75]],
                                                  dtype=torch.float64))
    cases = [(0, centroids, (0.0, 0.0, 0.5, 1.0)),   # holds region 0: 1/3
             (1, centroids, (0.5, 0.0, 1.0, 1.0)),   # holds regions 1 and 2: 2/3
             (2, centroids, (0.9, 0.9, 1.0, 1.0))]   # holds none: 0
    assert random_pointing(cases) == pytest.approx((1 / 3 + 2 / 3 + 0) / 3, abs=1e-15)
    # an empty region (NaN centroid) is not one a random pick can land on
    with_empty = region_centroids(labels, 2, 4, 4)
    assert torch.isnan(with_empty[3]).all()
    assert random_pointing([(0, with_empty, (0.0, 0.0, 0.5, 1.0))]) == pytest.approx(1 / 3)
    assert random_pointing([]) is None
