"""A learned scorer in Fast KVzip's shape: per-layer gates map the attention input to KVzip's scores.

Fast KVzip (Kim, Han, Yun, "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction", arXiv
2601.17668) trains, per layer, a small gate (kvpress's ``FastKVzipGate``: queries and keys of 16 dimensions over
the hidden states, with learned sink base keys) on KVzip's reconstruction scores, so the prefill scores every
entry from what it computes anyway, with no reconstruction pass. ``GatePress`` scores inside the prefill's own
attention hooks, as kvpress's scorer presses do, and evicts every layer at the last hooked layer under KVzip's
``"widest"`` allocation (``kvzip_alloc.allocation_keep`` and ``evict_keep``: equal memory, real eviction), so it
compresses under ``model.generate`` too. Its gates are kvpress's ``FastKVzipPress`` format (a list of per-layer
state dicts of ``FastKVzipGate``), so a released gate loads as it is; without one, it loads the gate it names,
else the model's default gate (``kvpress_prob.presses.gate_store.load``: trained by ``kvprob train-gate``).
``compress_scores`` evicts a cache from gate scores computed elsewhere (the evaluation engine's shared prefill,
which computes them once for every ratio).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from torch import nn

from kvpress_prob import attention_dispatch
from kvpress_prob.presses import gate_store
from kvpress_prob.presses.allocations import allocation_keep, evict_keep
from kvpress_prob.presses.prefill_plan import PrefillPlan
from kvpress_prob.presses.sampling import hooked_layers, language_model
from kvpress_prob.samplers.base import check_ratio


@dataclass
class GatePress(BasePress):
    """Fast KVzip's gates (Kim, Han, Yun 2026, arXiv 2601.17668) kept under KVzip's widest allocation (see the module).

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of the cache evicted, in [0, 1); kvpress's count (``compute_n_kept``) per head, over all layers.
    gate : str or None, default None
        The gate to load when ``gates`` is None: a name (``gate_store.gate_name``) in the model's gate folder, or a
        file's path. None: the model's default gate (``gate_store.default_gate``: the one ``kvprob train-gate
        --set-default`` made the default, else ``gate_store.DEFAULT_GATE``). A missing gate raises, naming
        ``kvprob train-gate``.
    gates : list or None, default None
        One gate per layer: ``FastKVzipGate`` modules or their state dicts (``FastKVzipPress``'s format), used as
        given (``gate`` must then be None).
    n_sink : int, default 4
        The first entries are pinned above every score (never evicted), as ``KVzipSampledPress.pinned_scores``.
    """

    compression_ratio: float = 0.0
    gate: str | None = None
    gates: list | None = field(default=None, repr=False)
    n_sink: int = 4

    def __post_init__(self):
        check_ratio(self.compression_ratio)
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        if self.gate is not None and self.gates is not None:
            raise ValueError("pass gate (a gate's name or path) or gates (the modules), not both")
        self.gate_used: str | None = None  # the name of the gate scoring, once entered on a model ("given": gates)
        self._modules: list[nn.Module] = []  # the gates, one per layer
        self._attention: list[nn.Module] = []  # the model's attention modules, in order
        self._layers: list[int] = []
        self._scores: dict[int, torch.Tensor] = {}
        self.kept: list[list[int]] = []

    def post_init_from_model(self, model):
        """Check the attention implementation, and ready one gate per layer of ``model``."""
        attention_dispatch.check_implementation(model, type(self).__name__)
        self._layers = hooked_layers(model)
        self._attention = [layer.self_attn for layer in language_model(model).layers]
        if self._layers != [m.layer_idx for m in self._attention]:
            raise ValueError("GatePress scores every layer: a model with sliding-window layers (Gemma3) is not supported")
        if self.gates is None:
            self.gate_used, self._modules = gate_store.load(model, self.gate)
        elif all(isinstance(g, dict) for g in self.gates):
            self.gate_used, self._modules = "given", gate_store.gates_from_state_dicts(self.gates)
        else:
            self.gate_used, self._modules = "given", list(self.gates)
        n_layers = len(language_model(model).layers)
        if len(self._modules) != n_layers:
            raise ValueError(f"gates must hold one gate per layer ({n_layers}), got {len(self._modules)}")
        heads = model.config.num_key_value_heads
        if any(g.nhead != heads for g in self._modules):
            raise ValueError(f"gates must score the model's {heads} KV heads, got {[g.nhead for g in self._modules]}")

    @property
    def gate_key(self) -> tuple:
        """What this press's gate scores depend on, once entered on a model: its gate's name, or its modules."""
        return (self.gate_used,) if self.gates is None else tuple(id(m) for m in self._modules)

    @torch.no_grad()
    def gate_scores(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """Layer ``layer_idx``'s gate scores (1, H_kv, n) in float32 from its attention input (1, n, d)."""
        gate = self._modules[layer_idx]
        weight = gate.q_proj.weight
        if weight.device != hidden_states.device:
            gate.to(hidden_states.device)
        return gate(hidden_states.to(weight.dtype)).float()

    def prefill_plan(self, model, n: int) -> PrefillPlan:
        """After a shared full-cache prefill: ``compress_scores`` on the ``gate_scores`` computed in its hooks, keyed
        by ``gate_key`` (shared by every ratio); nothing at ratio 0."""
        if self.compression_ratio == 0:
            return PrefillPlan("full")
        return PrefillPlan("gate", ("gate", self.gate_key), lambda module, kwargs, output: self.gate_scores(
            module.layer_idx, kwargs["hidden_states"]))

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
            self.compress_scores(kwargs["past_key_values"], scores)
        return output

    @torch.no_grad()
    def compress_scores(self, cache, scores: dict[int, torch.Tensor]) -> None:
        """Evict ``cache`` (a full prefill's, on the model this press was entered on) under this press's allocation
        of ``scores``: layer index -> that layer's ``gate_scores`` (1, H, n). What the last hooked layer does."""
        if self.compression_ratio == 0:
            return
        device = scores[self._layers[0]].device  # layers may sit on several devices: allocate on the first's
        stacked = torch.stack([scores[i].to(device) for i in self._layers])  # (L, 1, H, n)
        self.kept = self.evict(cache, self.pinned(stacked))

    def evict(self, cache, scores: torch.Tensor) -> list[list[int]]:
        """Evict ``cache`` to the widest allocation of the pinned ``scores`` (L, 1, H, n); the kept counts."""
        keep = allocation_keep(scores, self.compression_ratio, "widest")  # (L, 1, H, n)
        return evict_keep(cache, self._attention, keep)


__all__ = ["GatePress"]
