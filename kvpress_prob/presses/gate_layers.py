"""Fast KVzip's gates, each layer evicted in its own forward hook, with a recent window as the fill.

``GatePress`` keeps KVzip's widest allocation over all layers, so every layer's full K+V waits for the last
layer's scores. ``LayerGatePress`` gives every layer and head kvpress's count (``compute_n_kept``) and evicts each
layer in its own hook, as kvpress's scorer presses do, so no layer's full K+V outlives its hook: the prefill's time
and peak are snapkv's. Each head keeps its ``n_sink`` first entries, then the most recent ``window`` fraction of its
count (the recent tail, where most of pi_min-h's mass beyond KVzip's top lies on prose), then the gate's top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.presses.base_press import BasePress
from kvpress.utils import compute_n_kept
from torch import nn

from kvpress_prob.presses.gate import GatePress


@dataclass
class LayerGatePress(GatePress):
    """Fast KVzip's gates (Kim, Han, Yun 2026, arXiv 2601.17668) evicting each layer in its hook (see the module).

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of the cache evicted, in [0, 1); every layer and head keeps kvpress's count ``compute_n_kept``.
    gate : str or None, default None
        The gate to load (``GatePress.gate``); None: the model's default gate.
    gates : list or None, default None
        One gate per layer, used as given (``GatePress.gates``).
    n_sink : int, default 4
        The first entries are kept first (never evicted).
    window : float, default 0.0
        Fraction in [0, 1] of each head's kept count given to the most recent entries; the rest is the gate's top.
    """

    window: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.window <= 1.0:
            raise ValueError(f"window must be in [0, 1], got {self.window}")

    def kept_indices(self, scores: torch.Tensor) -> torch.Tensor:
        """(1, H, k) positions, in prefix order, that each head keeps from its gate ``scores`` (1, H, n), k =
        ``compute_n_kept(n, compression_ratio)``: the sinks, then the ``int(window * k)`` most recent, then the top."""
        n = scores.shape[-1]
        k = compute_n_kept(n, self.compression_ratio)
        recent = int(self.window * k)
        ranked = scores.float().clone()
        top = ranked.amax() + 1.0
        positions = torch.arange(n, device=scores.device, dtype=torch.float32) / n  # in [0, 1): later ranks higher
        if recent > 0:
            ranked[..., n - recent:] = top + positions[n - recent:]
        ranked[..., : self.n_sink] = top + 2.0  # above the window
        return ranked.topk(k, dim=-1).indices.sort(dim=-1).values

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's kept keys and values (1, H, k, d) from its gate's scores of ``hidden_states`` (1, n, d)."""
        if self.compression_ratio == 0:
            return keys, values
        if hidden_states.shape[0] != 1:
            raise ValueError(f"LayerGatePress supports batch size 1 (the gate scores one context), got "
                             f"{hidden_states.shape[0]}")
        return self._gather(keys, values, self.kept_indices(self.gate_scores(module.layer_idx, hidden_states)))

    forward_hook = BasePress.forward_hook  # each layer compressed in its own hook, as kvpress's scorer presses

    @torch.no_grad()
    def compress_scores(self, cache, scores: dict[int, torch.Tensor]) -> None:
        """Evict every layer of ``cache`` (a full prefill's) from ``scores``: layer index -> that layer's
        ``gate_scores`` (1, H, n). What the hooks do, layer by layer."""
        if self.compression_ratio == 0:
            return
        for module in self._attention:
            layer = cache.layers[module.layer_idx]
            layer.keys, layer.values = self._gather(layer.keys, layer.values,
                                                    self.kept_indices(scores[module.layer_idx]))

    @staticmethod
    def _gather(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = kept.to(keys.device)[..., None].expand(-1, -1, -1, keys.shape[-1])  # (1, H, k, d)
        return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()


__all__ = ["LayerGatePress"]
