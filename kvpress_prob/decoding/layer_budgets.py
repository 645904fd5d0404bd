"""Per-layer budgets while decoding at the same total: ``LayerBudgetDecodingPress``.

kvpress's ``DynamicCache`` holds a layer as one (b, H_kv, S, d) tensor, so heads of one layer that keep
different counts are padded to the largest: per-head budgets are not equal bytes, per-layer budgets are.
This press moves entries between layers, keeping the sum over layers of the entries per KV head at
``n_layers * target_size``: a layer whose proposal is concentrated on few candidates keeps fewer entries,
one whose proposal is spread keeps more.

The plan of round r (one target per layer) is made once, when the first layer reaches round r, from
what every layer's round r - 1 measured (``spread``), so it does not depend on the order in which the
layers of one forward run; round 0 is uniform. ``allocate`` does the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpress_prob.decoding.press import SamplingDecodingPress
from kvpress_prob.presses.sampling import language_model


def spread(weights: torch.Tensor, candidates: torch.Tensor) -> float:
    """How spread a layer's proposal is over its candidates: exp(entropy) / m, the effective number of
    candidates over their number, averaged over the batch and KV heads; in (0, 1], 1 for a uniform
    proposal. ``weights`` (b, H_kv, n) >= 0, ``candidates`` (b, H_kv, n) bool."""
    w = weights.double().clamp_min(0) * candidates
    p = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    m = candidates.sum(-1).clamp_min(1)
    return float((entropy.exp() / m).mean())


def allocate(spreads: list[float], total: int, low: list[int], high: list[int], share: float) -> list[int]:
    """Integer targets t_l, low_l <= t_l <= high_l, summing to ``total``, as close as the bounds allow to
    total * ((1 - share) / L + share * spread_l / sum(spread)): ``share`` of the total follows the spreads,
    the rest is uniform. Raises ValueError if the bounds cannot hold the total."""
    n = len(spreads)
    if not (len(low) == len(high) == n) or n == 0:
        raise ValueError(f"spreads, low and high must have the same length >= 1, got {n}, {len(low)}, {len(high)}")
    if not sum(low) <= total <= sum(high):
        raise ValueError(f"total={total} must be within the bounds' sums [{sum(low)}, {sum(high)}]")
    s = sum(spreads)
    raw = [(1 - share) / n + share * (x / s if s > 0 else 1 / n) for x in spreads]

    def filled(c: float) -> list[float]:
        return [min(max(c * r * total, lo), hi) for r, lo, hi in zip(raw, low, high)]

    below, above = 0.0, 1.0
    while sum(filled(above)) < total:
        above *= 2
    for _ in range(200):  # bisection on the scale: sum(filled(c)) is continuous and non-decreasing in c
        middle = (below + above) / 2
        below, above = (middle, above) if sum(filled(middle)) < total else (below, middle)
    real = filled(above)
    targets = [min(max(math.floor(x), lo), hi) for x, lo, hi in zip(real, low, high)]
    order = sorted(range(n), key=lambda i: (targets[i] - real[i], i))  # largest fractional part first
    while sum(targets) < total:
        i = next(i for i in order if targets[i] < high[i])
        targets[i] += 1
        order.remove(i)
        order.append(i)
    while sum(targets) > total:
        i = next(i for i in reversed(order) if targets[i] > low[i])
        targets[i] -= 1
        order.remove(i)
        order.insert(0, i)
    return targets


@dataclass
class LayerBudgetDecodingPress(SamplingDecodingPress):
    """``SamplingDecodingPress`` with per-layer budgets at the same total (per-head budgets
    while decoding, at layer granularity: the granularity at which a ``DynamicCache`` saves bytes).
    Probabilistic eviction with compounded SNIS weights as in ``SamplingDecodingPress`` (Geh et al.,
    "A Probabilistic Interpretation of KV Cache Eviction", 2026; VaSE, Chang et al. 2026); the layer
    allocation by attention concentration follows the layer-adaptive budgets of PyramidKV (Cai et al.
    2024) and Ada-KV (Feng et al. 2024), here measured while decoding.

    Round r of layer l keeps t_l entries per KV head, sum_l t_l = n_layers * ``target_size``: t is
    ``allocate``'s answer for the spreads (``spread``: exp(entropy) / m of the proposal over the
    candidates) that each layer's round r - 1 measured, between n_sink + window + protect_values + 1
    and what the layer holds at round r (its round r - 1 target plus the tokens appended since). Round 0
    keeps ``target_size`` everywhere. The plans and spreads are per cache (two caches never share them).
    A round that a layer skips (it holds at most its target) leaves its spread as it was.

    Parameters
    ----------
    share : float, default 0.5
        The part of the total budget allocated in proportion to the layers' spreads, in [0, 1]; the rest
        is split evenly (0: ``SamplingDecodingPress``'s equal budgets).
    Every other parameter is ``SamplingDecodingPress``'s (``target_size``: the mean budget per layer).
    """

    share: float = 0.5

    def __post_init__(self):
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)) or not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be a number in [0, 1], got {self.share!r}")
        super().__post_init__()
        self._n_layers = None

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        self._n_layers = len(language_model(model).layers)
        self.stats["targets"] = {}

    def layer_target(self, layer: int, held: int) -> int:
        state = self._budgets
        plans, targets, spreads, calls = (state.setdefault(name, {}) for name in ("plans", "targets", "spreads", "calls"))
        r = calls[layer] = calls.get(layer, -1) + 1  # this layer's round index, counting rounds it skips (a
        # target may be all the layer holds: then it keeps everything, and must not fall behind the others)
        if r not in plans:
            n = self._n_layers
            if n is None:
                raise RuntimeError("LayerBudgetDecodingPress needs the model's layer count: use it as `with press(model)`")
            if r == 0 or len(spreads) < n or len(targets) < n:
                plans[r] = [self.target_size] * n
            else:
                growth = held - targets[layer]  # the tokens appended since the last round, alike in every layer
                low = [self.n_sink + self.window + self.protect_values + 1] * n
                high = [max(targets[i] + growth, low[i]) for i in range(n)]
                plans[r] = allocate([spreads[i] for i in range(n)], n * self.target_size, low, high, self.share)
            for old in [k for k in plans if k < r]:
                del plans[old]
        target = plans[r][layer]
        targets[layer] = min(target, held)  # what the layer holds after this round (all of it if it skips)
        self.stats.setdefault("targets", {})[layer] = target
        return target

    def observe(self, layer: int, weights: torch.Tensor, candidates: torch.Tensor) -> None:
        self._budgets.setdefault("spreads", {})[layer] = spread(weights, candidates)
