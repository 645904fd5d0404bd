"""A learned scorer in Fast KVzip's shape: per-layer gates map the attention input to KVzip's scores.

Fast KVzip (Kim, Han, Yun, "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction", arXiv
2601.17668) trains, per layer, a small gate (kvpress's ``FastKVzipGate``: queries and keys of 16 dimensions over
the hidden states, with learned sink base keys) on KVzip's reconstruction scores, so the prefill scores every
entry from what it computes anyway, with no reconstruction pass. ``GatePress`` scores inside the prefill's own
attention hooks, as kvpress's scorer presses do, and evicts every layer at the last hooked layer under KVzip's
``"widest"`` allocation (``kvzip_alloc.allocation_keep`` and ``evict_keep``: equal memory, real eviction), so it
compresses under ``model.generate`` too. Its gates are kvpress's ``FastKVzipPress`` format (a list of per-layer
state dicts of ``FastKVzipGate``), so a released gate loads as it is; without one, the gate trained on
development texts (``kvpress_prob.presses.gate_training``) is read from the cache or trained on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from torch import nn

from kvpress_prob.correction import attention
from kvpress_prob.presses.gate_training import cached_gates, gates_from_state_dicts
from kvpress_prob.presses.allocations import allocation_keep, evict_keep
from kvpress_prob.presses.sampling import hooked_layers, language_model
from kvpress_prob.samplers.base import check_ratio


@dataclass
class GatePress(BasePress):
    """Fast KVzip's gates (Kim, Han, Yun 2026, arXiv 2601.17668) kept under KVzip's widest allocation (see the module).

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of the cache evicted, in [0, 1); kvpress's count (``compute_n_kept``) per head, over all layers.
    gates : list or None, default None
        One gate per layer: ``FastKVzipGate`` modules or their state dicts (``FastKVzipPress``'s format). None: the
        gate trained for this model on development texts (``gate_training.cached_gates``: from the cache, else
        trained on ``corpus`` on first use, with one log line).
    corpus : callable or None, default None
        ``corpus(tokenizer)`` -> the training contexts (a list of (1, n) id tensors), used only when ``gates`` is None
        and no gate is cached; None then raises, naming ``kvprob train-gate``.
    n_sink : int, default 4
        The first entries are pinned above every score (never evicted), as ``KVzipSampledPress.pinned_scores``.
    """

    compression_ratio: float = 0.0
    gates: list | None = None
    corpus: Callable | None = field(default=None, repr=False)
    n_sink: int = 4

    def __post_init__(self):
        check_ratio(self.compression_ratio)
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        self._modules: list[nn.Module] = []  # the gates, one per layer
        self._attention: list[nn.Module] = []  # the model's attention modules, in order
        self._layers: list[int] = []
        self._scores: dict[int, torch.Tensor] = {}
        self.kept: list[list[int]] = []

    def post_init_from_model(self, model):
        """Check the attention implementation, and ready one gate per layer of ``model``."""
        attention.check_implementation(model)
        self._layers = hooked_layers(model)
        self._attention = [layer.self_attn for layer in language_model(model).layers]
        if self._layers != [m.layer_idx for m in self._attention]:
            raise ValueError("GatePress scores every layer: a model with sliding-window layers (Gemma3) is not supported")
        if self.gates is None:
            self._modules = cached_gates(model, self.corpus)
        elif all(isinstance(g, dict) for g in self.gates):
            self._modules = gates_from_state_dicts(self.gates)
        else:
            self._modules = list(self.gates)
        n_layers = len(language_model(model).layers)
        if len(self._modules) != n_layers:
            raise ValueError(f"gates must hold one gate per layer ({n_layers}), got {len(self._modules)}")
        heads = model.config.num_key_value_heads
        if any(g.nhead != heads for g in self._modules):
            raise ValueError(f"gates must score the model's {heads} KV heads, got {[g.nhead for g in self._modules]}")

    @torch.no_grad()
    def gate_scores(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """Layer ``layer_idx``'s gate scores (1, H_kv, n) in float32 from its attention input (1, n, d)."""
        gate = self._modules[layer_idx]
        weight = gate.q_proj.weight
        if weight.device != hidden_states.device:
            gate.to(hidden_states.device)
        return gate(hidden_states.to(weight.dtype)).float()

    def pinned(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (L, 1, H, n) with the first ``n_sink`` entries above every other (never evicted)."""
        scores = scores.clone()
        scores[..., : self.n_sink] = scores.amax() + 1.0
        return scores

    @torch.no_grad()
    def forward_hook(self, module: nn.Module, input: list, kwargs: dict, output: list):
        """At prefill, score this layer; the last hooked layer evicts every layer under the widest allocation."""
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output
        if hidden_states.shape[0] != 1:
            raise ValueError(f"GatePress supports batch size 1 (the layers keep different counts), got "
                             f"{hidden_states.shape[0]}")
        if module.layer_idx == self._layers[0]:
            self._scores = {}
        if module.layer_idx != self._layers[len(self._scores)]:
            seen, self._scores = sorted(self._scores), {}
            raise RuntimeError(f"GatePress saw layer {module.layer_idx} after layers {seen}: its eviction needs "
                               f"every hooked layer of one prefill, in order")
        self._scores[module.layer_idx] = self.gate_scores(module.layer_idx, hidden_states)
        if module.layer_idx == self._layers[-1]:
            scores, self._scores = self._scores, {}
            if self.compression_ratio > 0:
                device = scores[self._layers[0]].device  # layers may sit on several devices: allocate on the first's
                stacked = torch.stack([scores[i].to(device) for i in self._layers])  # (L, 1, H, n)
                self.kept = self.evict(kwargs["past_key_values"], self.pinned(stacked))
        return output

    def evict(self, cache, scores: torch.Tensor) -> list[list[int]]:
        """Evict ``cache`` to the widest allocation of the pinned ``scores`` (L, 1, H, n); the kept counts."""
        keep = allocation_keep(scores, self.compression_ratio, "widest")  # (L, 1, H, n)
        return evict_keep(cache, self._attention, keep)


__all__ = ["GatePress"]
