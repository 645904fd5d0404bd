"""Per-layer budgets while decoding at the same total (issue 28; ``kvpress_prob.decoding.layer_budgets``): the
allocation's arithmetic, the spread against a slow float64 loop, and on a tiny model that the layers hold
different counts whose sum, and whose bytes measured on the cache, are those of equal budgets."""

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import DynamicCache

from evaluation.tasks.streaming.drive import Schedule, feed
from evaluation.tasks.streaming.presses import stream_presses
from kvpress_prob.correction import bias as correction
from kvpress_prob.names.decoding import get_decoding_press
from kvpress_prob.decoding.layer_budgets import LayerBudgetDecodingPress, allocate, spread
from kvpress_prob.presses.sampling import language_model

NAME = "prob_decode_min_variance_priority_floor20_layers"


def test_allocate_follows_the_spreads_within_the_bounds_and_keeps_the_total():
    spreads = [0.1, 0.2, 0.7]
    # unconstrained: 300 * ((1 - 0.5) / 3 + 0.5 * s / 1.0) = 65, 80, 155
    assert allocate(spreads, 300, [10] * 3, [200] * 3, 0.5) == [65, 80, 155]
    # the spread layer is capped at 120 (what it holds): its excess goes to the others in proportion
    capped = allocate(spreads, 300, [10] * 3, [120] * 3, 0.5)
    assert capped[2] == 120 and sum(capped) == 300 and capped[0] < capped[1]
    assert allocate(spreads, 300, [10] * 3, [200] * 3, 0.0) == [100, 100, 100]  # share 0: equal budgets
    assert allocate([0.3] * 4, 1016, [37] * 4, [286] * 4, 1.0) == [254] * 4  # equal spreads: equal budgets
    # the floor binds: a layer that attends to almost nothing keeps the least it may
    low = allocate([1e-9, 0.5, 0.5], 300, [50] * 3, [300] * 3, 1.0)
    assert low[0] == 50 and sum(low) == 300
    for total in (299, 300, 301, 450):  # rounding: the sum is the total exactly
        got = allocate([0.13, 0.41, 0.29, 0.05], total, [20] * 4, [200] * 4, 0.7)
        assert sum(got) == total and all(20 <= t <= 200 for t in got)


def test_allocate_refuses_bounds_that_cannot_hold_the_total():
    with pytest.raises(ValueError, match="total=700"):
        allocate([0.5, 0.5], 700, [10, 10], [300, 300], 0.5)
    with pytest.raises(ValueError, match="same length"):
        allocate([0.5], 100, [10, 10], [300, 300], 0.5)


def test_spread_equals_a_slow_float64_loop():
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(2, 3, 12, generator=g, dtype=torch.float64) ** 4
    candidates = torch.rand(2, 3, 12, generator=g) > 0.3
    want = []
    for b in range(2):
        for h in range(3):
            w = [float(weights[b, h, i]) for i in range(12) if candidates[b, h, i]]
            p = [x / sum(w) for x in w]
            want.append(math.exp(-sum(x * math.log(x) for x in p if x > 0)) / len(w))
    assert spread(weights, candidates) == pytest.approx(sum(want) / len(want), rel=1e-12)
    uniform = torch.ones(1, 1, 8, dtype=torch.float64)
    assert spread(uniform, torch.ones(1, 1, 8, dtype=torch.bool)) == pytest.approx(1.0)
    one_hot = torch.zeros(1, 1, 8, dtype=torch.float64)
    one_hot[..., 3] = 1
    assert spread(one_hot, torch.ones(1, 1, 8, dtype=torch.bool)) == pytest.approx(1 / 8)


def test_bad_share_names_itself():
    with pytest.raises(ValueError, match="share"):
        LayerBudgetDecodingPress(proposal="min_variance", share=1.5)
    with pytest.raises(ValueError, match="share"):
        LayerBudgetDecodingPress(proposal="min_variance", share=True)


def test_layers_hold_the_planned_counts_at_the_total_of_equal_budgets(monkeypatch):
    """4 layers, target 24, a round every 4 tokens; the spreads are set by the test (the tiny random model's
    proposals are all nearly uniform): layer l's k-th measured spread is l + 1 for even k, 4 - l for odd k.
    Round 0 keeps 24 everywhere; round r >= 1 keeps in each layer what ``allocate`` gives for the spreads,
    bounded by what the layer holds (its last target plus the 4 new tokens). A layer given all it holds keeps
    it (a skipped round, which measures nothing) and must stay on the others' round: every round's counts sum
    to 4 x 24, and the bias has one value per kept entry."""
    from kvpress_prob.decoding import layer_budgets

    monkeypatch.setattr(layer_budgets, "spread", lambda weights, candidates: None)
    model = tiny_model("llama", layers=4)
    ids = random_ids(40 + 40, seed=5)
    press = get_decoding_press(NAME, 24, 4, window=4, seed=0)
    assert isinstance(press, LayerBudgetDecodingPress)
    measured = {}

    def fixed_spread(l: int, k: int) -> float:
        return float(l + 1) if k % 2 == 0 else float(4 - l)

    def observe(layer, weights, candidates):
        press._budgets.setdefault("spreads", {})[layer] = fixed_spread(layer, measured.get(layer, 0))
        measured[layer] = measured.get(layer, 0) + 1

    press.observe = observe
    cache = DynamicCache()
    rounds = []
    with torch.no_grad(), press(model):
        model(ids[:, :40], past_key_values=cache)
        for t in range(40, 80):
            model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))
            if (t - 40 + 1) % 4 == 0:  # a round ended this forward
                rounds.append([layer.keys.shape[2] for layer in cache.layers])
        attn = [layer.self_attn for layer in language_model(model).layers]
        biases = [correction.bias_of(a, cache) for a in attn]
    want, targets, spreads, count, skipped, cut_to = [], [24] * 4, [0.0] * 4, [0] * 4, 0, [24] * 4
    for r in range(10):
        held = [40 + 4] * 4 if r == 0 else [t + 4 for t in targets]
        plan = [24] * 4 if r == 0 else allocate(spreads, 96, [4 + 4 + 1] * 4, held, 0.5)
        for l in range(4):
            if held[l] <= plan[l]:
                skipped += 1
            else:
                spreads[l], count[l], cut_to[l] = fixed_spread(l, count[l]), count[l] + 1, plan[l]
        targets = [min(p, h) for p, h in zip(plan, held)]
        want.append(targets)
    assert rounds == want
    assert all(sum(counts) == 4 * 24 for counts in rounds) and len({tuple(c) for c in rounds}) > 2
    assert skipped > 0 and press.stats["skipped"] == skipped  # the case that must not fall behind did occur
    # one bias value per entry kept at the layer's last round that ran (entries appended since carry bias 0)
    assert [b.shape[-1] for b in biases] == cut_to


def test_stream_bytes_are_those_of_equal_budgets():
    """The streaming driver measures the equal-bytes target per layer: the per-layer design's keys, values
    and bias fit in the bytes of `budget` entries in every layer, as the uniform corrected design's do."""
    model, ids = tiny_model("llama", layers=4), random_ids(161, seed=6)
    schedule = Schedule(n=161, budget=48, chunk=16, interval=16)
    sizes = {}
    for name in (NAME, "prob_decode_min_variance_priority_floor20"):
        press = stream_presses()[name](schedule, 0, 16, torch.float32)
        out = feed(model, ids, schedule, press)
        held = [layer.keys.shape[2] for layer in out["cache"].layers]
        sizes[name] = (held, out)
    held, out = sizes[NAME]
    per_entry = 2 * 2 * 16 * 4  # K and V x heads x head_dim x float32
    assert out["budget_bytes"] == 4 * 48 * per_entry
    assert out["kv_bytes"] == sum(held) * per_entry and sum(held) == 4 * (48 * 32 // 33)
    assert out["kv_bytes"] + out["bias_bytes"] <= out["budget_bytes"]
    assert len(set(held)) > 1
    uniform_held, uniform = sizes["prob_decode_min_variance_priority_floor20"]
    assert uniform["kv_bytes"] + uniform["bias_bytes"] == out["kv_bytes"] + out["bias_bytes"]
