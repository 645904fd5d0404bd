"""Per-head budgets while decoding, evicted for real into a ragged cache: ``HeadBudgetDecodingPress``.

A ``DynamicCache`` stores every head of a layer at one length, so ``SamplingDecodingPress`` cuts each head to
``target_size`` (and ``LayerBudgetDecodingPress`` moves budget between layers, never between heads). Here each
round spreads the layer's budget of ``H * target_size`` entries over its KV heads as AdaKV does (Feng et al.,
"Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference", 2024), and the
layer becomes a ragged layer (``kvpress_prob.cache.folded``) holding exactly the kept entries: a head whose
buffered queries attend to few entries gives its share to one whose attention is spread.

``head_counts`` does the allocation: each head's exact entries (sinks, window, protected values) count against
its share; each head first draws its safeguard, ``int(alpha_safeguard * (target_size - fixed_h))`` of its
candidates with the largest proposal weights; the rest of the layer's draws go to the largest weights over all
the layer's candidates (the layer's top). The proposal weights are comparable across heads: each query spreads
one unit of attention over the entries it sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from kvpress.presses.base_press import is_prefilling
from torch import nn

from kvpress_prob.cache import check_evictable, held_bytes, held_counts, padded_view, prompt_entries
from kvpress_prob.cache.folded import fold
from kvpress_prob.decoding import rounds
from kvpress_prob.decoding.press import SamplingDecodingPress, logger


def head_counts(weights: torch.Tensor, candidates: torch.Tensor, fixed: torch.Tensor, target_size: int,
                alpha_safeguard: float) -> torch.Tensor:
    """(b, H) long: how many of its candidates each KV head draws, for a layer keeping ``H * target_size``
    entries with the ``fixed`` ones (b, H, n) bool counted in each head's share (see the module). ``weights``
    (b, H, n) >= 0 on the ``candidates`` (b, H, n) bool. Raises ValueError if the layer holds no more than its
    budget (nothing to choose)."""
    b, H, n = weights.shape
    m = candidates.sum(-1)  # (b, H)
    share = (target_size - fixed.sum(-1)).clamp_min(0)  # (b, H): each head's draws under equal budgets
    draws = share.sum(-1)  # (b,): the layer's draws
    if bool((draws > m.sum(-1)).any()):
        raise ValueError(f"the layer holds at most its budget of {H} x target_size = {H * target_size} entries: "
                         "there is nothing to choose")
    safe = torch.minimum((share.double() * alpha_safeguard).floor().long(), m)  # (b, H)
    w = weights.double().masked_fill(~candidates, float("-inf"))
    order = w.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=w.device).expand_as(order))
    pooled = torch.where(rank < safe[..., None], float("inf"), w).reshape(b, H * n)  # the safeguards first
    counts = torch.zeros(b, H, dtype=torch.long, device=w.device)
    for i in range(b):
        top = pooled[i].topk(int(draws[i])).indices
        counts[i] = torch.bincount(top // n, minlength=H)
    return counts


@dataclass
class HeadBudgetDecodingPress(SamplingDecodingPress):
    """``SamplingDecodingPress`` with per-head budgets, evicted for real: each round spreads the layer's
    ``H * target_size`` entries over its KV heads by AdaKV's allocation (Feng et al. 2024; ``head_counts``) of
    the round's proposal weights, each head draws its count by ``sampler``, and the layer becomes a
    ``FoldedLayer`` (``kvpress_prob.cache.folded``) holding exactly the kept entries' K and V (plus, where the
    press corrects and samples, their compounded SNIS log-weights: Geh et al., "A Probabilistic Interpretation
    of KV Cache Eviction", 2026). The tokens decoded since the last round are folded into the heads' regions,
    candidates like any other entry; between rounds they are appended to every head and attended through the
    ragged attention route (``kvpress_prob.cache.ragged_attention``). With ``TopKSampler`` the kept set is AdaKV's top.

    A round runs when a layer holds more than ``H * target_size`` entries in all (else it is skipped, counted
    in ``stats["skipped"]``). It reads the layer once as a padded copy (never held). Batch size 1; a
    ``QuantizedCache`` is refused. Runs alone (``with press(model): model.generate(...)``, kvpress's pipeline,
    which crops the answer off to the prompt's length after it) or behind a prefill press, ragged or dense.

    Parameters
    ----------
    alpha_safeguard : float, default 0.2
        Share of its equal budget (``target_size`` less its exact entries) each head draws at least, before the
        layer's top, in [0, 1] (AdaKV's safeguard; 0: the layer's top alone; 1: equal budgets).
    Every other parameter is ``SamplingDecodingPress``'s (``target_size``: the mean count per head after a
    round; ``n_sink``, ``window``, ``protect_values``: per head, kept exactly).
    """

    alpha_safeguard: float = 0.2

    def __post_init__(self):
        a = self.alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha_safeguard must be a number in [0, 1], got {a!r}")
        super().__post_init__()

    def forward_hook(self, module: nn.Module, input: list, kwargs: dict, output: list):
        """``SamplingDecodingPress``'s hook; records each layer's logical length before its first decoding
        forward (the prompt a crop goes back to)."""
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            cache = kwargs["past_key_values"]
            check_evictable(cache, hidden_states.shape[0], "HeadBudgetDecodingPress")
            self._state_of(cache).prompt.setdefault(module.layer_idx, int(kwargs["cache_position"][0]))
        return super().forward_hook(module, input, kwargs, output)

    @torch.no_grad()
    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys, values, attentions, kwargs: dict):
        """One round on one layer: replaces the cache's layer by a ``FoldedLayer`` of the kept entries. Returns
        ``keys`` and ``values`` as given: kvpress's hook writes them back onto the replaced layer object, where
        they change nothing (the same tensors, or a ragged layer's full logical view)."""
        cache, i = kwargs["past_key_values"], module.layer_idx
        layer = cache.layers[i]
        length = int(kwargs["cache_position"][-1]) + 1  # positions so far (a dense layer's count may be fewer)
        k_all, v_all, held_bias = padded_view(layer)  # (1, H, m, d) x 2: a ragged layer's padded copy, m = S + t
        bias = rounds.extended_bias(held_bias, tuple(k_all.shape[:3]), k_all.device)  # (1, H, m), 0 after S
        real = rounds.is_real(bias)
        H = k_all.shape[1]
        if int(real.sum()) <= H * self.target_size:
            if self.proposal == "h2o":  # the buffered steps still accumulate
                self.weights(module, hidden_states, k_all, v_all, bias, kwargs)
            if not self.stats.get("skipped"):
                logger.warning(f"layer {i} holds {int(real.sum())} <= {H} x target_size={self.target_size} entries: "
                               f"no round (counted in stats['skipped'])")
            self.stats["skipped"] = self.stats.get("skipped", 0) + 1
            return keys, values
        prompt_length, prompt = prompt_entries(layer, real, self._prompt.get(i), length)  # (1, H, m)
        fixed = rounds.fixed_entries(real, self.n_sink, self.window, v_all, self.protect_values)
        candidates = real & ~fixed
        weights = self.weights(module, hidden_states, k_all, v_all, bias, kwargs)  # (1, H, n)
        counts = head_counts(weights, candidates, fixed, self.target_size, self.alpha_safeguard)  # (1, H)
        pi = rounds.proposal_over(weights, candidates, self.floor)
        generator = torch.Generator(device=k_all.device).manual_seed(
            (self.seed * 1_000_003 + i) * 100_003 + self._rounds[i])
        drawn, log_weight = rounds.draw(pi, candidates, counts, self.sampler, generator)
        keep = fixed | drawn
        if self.correct:
            bias = bias + rounds.controlled(log_weight, bias, drawn, candidates, self.temperature,
                                            math.log(self.max_weight), self.renormalise).float()
        if self.bias_dtype == "keys":
            bias = bias.to(k_all.dtype)
        if i in self._accumulated:  # h2o's sums follow the kept entries, packed as the next round's view reads them
            self._accumulated[i] = _packed(weights.float(), keep)
        folded = fold(cache, i, k_all, v_all, keep, bias.masked_fill(~keep, 0), length, prompt_length,
                      prompt.expand_as(keep))
        self._rounds[i] += 1
        self.stats["rounds"] = self.stats.get("rounds", 0) + 1
        self.stats.setdefault("kept", {})[i] = held_counts(folded)
        self.stats.setdefault("bytes_bias", {})[i] = held_bytes(folded)[1]
        return keys, values

    def weights(self, module, hidden_states, keys, values, bias, kwargs) -> torch.Tensor:
        """``SamplingDecodingPress``'s proposal weights (1, H, n); a scorer's scores are shifted by their
        minimum over the real entries (padding of a ragged layer's view excluded), 0 on padding."""
        if self.proposal != "scorer":
            return super().weights(module, hidden_states, keys, values, bias, kwargs)
        real = rounds.is_real(bias)
        original, self.base_press.compression_ratio = self.base_press.compression_ratio, 0.0
        try:
            scores = self.base_press.score(module, hidden_states, keys, values, None, kwargs).double()
        finally:
            self.base_press.compression_ratio = original
        if not bool(torch.isfinite(scores[real]).all()):
            raise ValueError("scores must be finite (the scorer returned NaN or Inf)")
        low = scores.masked_fill(~real, float("inf")).amin(-1, keepdim=True)
        return (scores - low).masked_fill(~real, 0.0)


def _packed(weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """weights (1, H, n) at the kept entries (1, H, n), each head's first, in order, then 0: (1, H, max c_h)."""
    counts = keep.sum(-1, keepdim=True)
    order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., : int(counts.max())]
    return weights.gather(-1, order) * (torch.arange(order.shape[-1], device=keep.device) < counts)


__all__ = ["HeadBudgetDecodingPress", "head_counts"]
