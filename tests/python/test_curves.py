"""headscope.hf.heat_curves on a tiny random Qwen2-VL: every curve's sets measured in one
batched call give the AUCs that measuring each curve's sets on its own gives; the true
effects' own scores reproduce the true-effect order; random orders are seeded."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from headscope.hf import Tracer, heat_curves, region_effects  # noqa: E402
from headscope.hf.curves import random_orders, region_tokens  # noqa: E402
from headscope.hf.testing import image_prompt, tiny_model  # noqa: E402
from headscope.metrics import (curve_sets, deletion_auc, heat_order, insertion_auc,  # noqa: E402
                               per_token)

K = 5


@pytest.fixture(scope="module")
def generated():
    torch.manual_seed(0)
    model = tiny_model("qwen2_vl")
    inputs = image_prompt(model, grids=((8, 8),), text_before=(3,), text_after=(5,))
    with torch.no_grad(), Tracer(model, regions=K, vas=False) as tr:  # Ward: unequal sizes
        list(tr.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None))
    return model, inputs, tr.sequences, tr.region_ids


def test_batched_curves_equal_each_curve_measured_alone(generated):
    model, inputs, sequences, rid = generated
    spans = [(0, 3), (3, 6)]
    tokens = region_tokens(rid)
    assert tokens.sum() == (rid >= 0).sum() and len(set(tokens.tolist())) > 1
    scores = {"a": torch.randn(2, K, generator=torch.Generator().manual_seed(1)),
              "b": torch.randn(2, K, generator=torch.Generator().manual_seed(2))}
    effects = region_effects(model, inputs, sequences, spans, rid, progress=False)
    curves, total = heat_curves(model, inputs, sequences, spans, rid, scores, random=2,
                                seed=3)
    assert set(curves) == {"a", "b", "effects", "random"}
    everything = region_effects(model, inputs, sequences, spans, rid,
                                subsets=torch.ones(1, K, dtype=torch.bool), progress=False)[1]
    torch.testing.assert_close(total, everything[:, 0].double(), atol=1e-5, rtol=1e-5)
    # a span whose total is not positive has no AUC; this model's random weights give one
    # of each, so both cases are checked
    assert (total > 0).tolist() == [False, True]
    assert torch.isnan(curves["a"]["deletion"]).tolist() == [True, False]

    def alone(order):
        deletion, insertion = [], []
        for s in range(2):
            d_sets, i_sets = curve_sets(order[s])
            _, d = region_effects(model, inputs, sequences, spans, rid, subsets=d_sets,
                                  progress=False)
            _, i = region_effects(model, inputs, sequences, spans, rid, subsets=i_sets,
                                  progress=False)
            deletion.append(deletion_auc(order[s], tokens, d[s].double()))
            insertion.append(insertion_auc(order[s], tokens, i[s].double(), d[s, -1].double()))
        return torch.stack(deletion), torch.stack(insertion)
    # (each set measured alone: a call per curve, 12 in all, about 10 s on a loaded CPU)
    deletion, insertion = alone(heat_order(per_token(scores["a"], tokens)))
    torch.testing.assert_close(curves["a"]["deletion"], deletion, atol=1e-4, rtol=1e-4,
                               equal_nan=True)
    torch.testing.assert_close(curves["a"]["insertion"], insertion, atol=1e-4, rtol=1e-4,
                               equal_nan=True)
    shuffled = random_orders(2, K, 2, 3)
    expected = torch.stack([torch.stack(alone(shuffled[r])) for r in range(2)]).mean(0)
    torch.testing.assert_close(torch.stack([curves["random"]["deletion"],
                                            curves["random"]["insertion"]]), expected,
                               atol=1e-4, rtol=1e-4, equal_nan=True)
    # the effects as scores take the true-effect order; given effects are not measured again
    again, _ = heat_curves(model, inputs, sequences, spans, rid, {"true": effects},
                           effects=effects, random=0)
    assert set(again) == {"true", "effects"}
    torch.testing.assert_close(again["true"], again["effects"], rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match=r"scores\['a'\] must be a \(2, 5\) tensor"):
        heat_curves(model, inputs, sequences, spans, rid, {"a": torch.zeros(3, K)},
                    effects=effects)


def test_random_orders_are_seeded_permutations():
    orders = random_orders(3, 6, 2, seed=7)
    assert orders.shape == (2, 3, 6)
    assert torch.equal(orders.sort(-1).values, torch.arange(6).expand(2, 3, 6))
    assert torch.equal(orders, random_orders(3, 6, 2, seed=7))
    assert not torch.equal(orders, random_orders(3, 6, 2, seed=8))
