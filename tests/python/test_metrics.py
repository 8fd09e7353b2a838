"""headscope.metrics: the bootstrap interval on known cases, the exact expectation of
random pointing, heat per image token and the deletion and insertion AUC on a case
computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from headscope.metrics import (bootstrap_interval, curve_sets, deletion_auc, heat_order,
                               hotter_than_rest, insertion_auc, mean_with_interval, per_token,
                               r_squared, random_pointing, region_centroids)


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


def test_deletion_and_insertion_auc_of_a_case_computed_by_hand():
    # 3 regions of 2, 1 and 1 image tokens scored 4, 3, 1: per token 2, 3, 1, so the heat
    # order is 1, 0, 2 (by total it would be 0, 1, 2)
    scores, tokens = torch.tensor([4.0, 3.0, 1.0]), torch.tensor([2, 1, 1])
    heat = per_token(scores, tokens)
    assert heat.tolist() == [2.0, 3.0, 1.0]
    order = heat_order(heat)
    assert order.tolist() == [1, 0, 2]
    deletion, insertion = curve_sets(order)
    assert deletion.tolist() == [[False, True, False], [True, True, False], [True, True, True]]
    assert insertion.tolist() == [[True, False, True], [False, False, True],
                                  [False, False, False]]
    # removing {1}: 1.0 nats, {0, 1}: 3.0, everything: 2.0 -> shares 0.5, 1.5, 1 at token
    # shares 0.25, 0.75, 1: (0.25 * 0.5 + 0.5 * 2.0 + 0.25 * 2.5) / 2 = 0.875
    removed = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)
    assert float(deletion_auc(order, tokens, removed)) == pytest.approx(0.875, abs=1e-12)
    # keeping {1} (removing {0, 2}): 1.6 nats, keeping {0, 1}: 0.2, keeping all: 0 ->
    # recovered 0.2, 0.9, 1: (0.25 * 0.2 + 0.5 * 1.1 + 0.25 * 1.9) / 2 = 0.5375
    kept = torch.tensor([1.6, 0.2, 0.0], dtype=torch.float64)
    assert float(insertion_auc(order, tokens, kept, torch.tensor(2.0))) == \
        pytest.approx(0.5375, abs=1e-12)
    # batched over spans, and undefined where removing everything has no positive effect
    orders = torch.stack([order, order])
    both = deletion_auc(orders, tokens, torch.stack([removed, torch.tensor([1.0, 0.5, 0.0])]))
    assert both[0] == pytest.approx(0.875) and math.isnan(both[1])
    assert math.isnan(float(insertion_auc(order, tokens, kept, torch.tensor(-1.0))))
    # a region without tokens is painted NaN and comes last
    assert heat_order(per_token(torch.tensor([5.0, 1.0]), torch.tensor([0, 1]))).tolist() == [1, 0]


def test_hotter_than_rest_and_r_squared():
    heat = torch.tensor([1.0, 1.0, 0.2, 0.2, 0.2])
    assert hotter_than_rest(heat, torch.tensor([1, 1, 0, 0, 0])) is True
    assert hotter_than_rest(heat, torch.tensor([0, 0, 1, 1, 0])) is False
    assert hotter_than_rest(heat, torch.zeros(5)) is None
    assert r_squared(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])) == 1.0
    # predicting the mean scores 0, the reverse order (1 - 8 / 2) = -3
    assert r_squared(torch.full((3,), 2.0), torch.tensor([1.0, 2.0, 3.0])) == 0.0
    assert r_squared(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([1.0, 2.0, 3.0])) == -3.0
    assert r_squared(torch.ones(3), torch.ones(3)) is None
