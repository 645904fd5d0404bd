"""Fast KVzip's gates under a per-head budget profile learned offline, each layer evicted in its own hook into a
ragged cache.

``RaggedGatePress`` keeps the gate's global top over every layer and head, so every layer's full K+V waits for the
last layer's scores (its peak is above snapkv's). ``LayerGatePress`` evicts each layer in its hook, but gives every
head kvpress's count, so no head can hold the large share that KVzip's global top gives the few heads that carry
retrieval. ``ProfileGatePress`` evicts each layer in its own hook, as kvpress's scorer presses do, and gives each
(layer, KV head) its count from a budget profile learned offline on development contexts
(``presses.budget_profile``, learned by ``kvpress_prob.learned.profile``: the mean share each head holds of
KVzip's global top, LU-KV's and HeadKV's offline per-head budgets), fixed for the whole model from the context length before the first layer's hook. The
counts sum exactly to snapkv's ``L H compute_n_kept(n, r)``; within each head the gate's scores choose (sinks
first, then an optional recent window of the head's count, then optionally a fill: the top of a second score, such as
a sampled-rows pi_min-h, for a share of the head's count). Each layer becomes a ``RaggedLayer`` in its hook
(``evict_ragged``), so no layer's full K+V outlives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import is_prefilling
from torch import nn
from transformers import QuantizedCache

from kvpress_prob.cache import evict_ragged
from kvpress_prob.presses.budget_profile import Profile, load_profile, profile_counts
from kvpress_prob.presses import artefacts
from kvpress_prob.presses.gate import GatePress
from kvpress_prob.presses.prefill_plan import PrefillPlan
from kvpress_prob.proposals.base import Proposal


@dataclass
class ProfileGatePress(GatePress):
    """Fast KVzip's gates (Kim, Han, Yun, arXiv 2601.17668) under a per-head budget profile learned offline (LU-KV,
    arXiv 2602.08585; HeadKV, arXiv 2410.19258), each layer evicted in its own hook into a ragged cache, like
    KVzap's in-hook eviction (arXiv 2601.07891) at an exact budget (see the module).

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of the cache evicted, in [0, 1); the heads keep ``L H compute_n_kept(n, r)`` entries in all.
    gate : str or None, default None
        The gate to load (``GatePress.gate``); None: the model's default gate.
    gates : list or None, default None
        One gate per layer, used as given (``GatePress.gates``).
    n_sink : int, default 4
        The first entries of each head are kept first.
    window : float, default 0.0
        Fraction in [0, 1] of each head's count given to its most recent entries (after the sinks); the rest is the
        gate's top.
    profile : str, Profile or None, default None
        The budget profile: a ``Profile``, or a file's path (``learned.profile.save_profile``'s format). None: the
        package's profile of the model (``budget_profile.load_profile``), refused for another model.
    scope : {"head", "layer"}, default "head"
        "head": each head keeps its own profile count. "layer": each layer keeps the sum of its heads' counts, as
        the top of its heads' ranked scores together (the heads of a layer share its budget by the gate's scores,
        as AdaKV does within a layer); the model's total is the same.
    fill : Proposal or None, default None
        A second score of each head's entries (a ``Proposal``, computed in the hook on the layer's keys and values,
        e.g. ``SampledMinVarianceProposal``, a sub-quadratic pi_min-h): ``floor(fill_share * count)`` of each head's
        count are the fill's top among the entries the sinks, the window and the gate did not keep (as the toprest
        fill of ``cross_kvzip_block1_a50_toprest_ragged``). None: no fill. Needs ``scope="head"``.
    fill_share : float, default 0.5
        Fraction in [0, 1] of each head's count taken by the fill; the sinks, window and gate keep the rest.
    """

    window: float = 0.0
    profile: str | Profile | None = field(default=None, repr=False)
    scope: str = "head"
    fill: Proposal | None = None
    fill_share: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.window <= 1.0:
            raise ValueError(f"window must be in [0, 1], got {self.window}")
        if self.scope not in ("head", "layer"):
            raise ValueError(f"scope must be 'head' or 'layer', got {self.scope!r}")
        if not 0.0 <= self.fill_share <= 1.0:
            raise ValueError(f"fill_share must be in [0, 1], got {self.fill_share}")
        if self.fill is not None and not isinstance(self.fill, Proposal):
            raise TypeError(f"fill must be a Proposal or None, got {type(self.fill).__name__}")
        if self.fill is not None and self.scope != "head":
            raise ValueError(f"a fill needs scope='head', got scope={self.scope!r}")
        self._profile: Profile | None = None
        self._counts: torch.Tensor | None = None  # (L, H): this prefill's counts, fixed before the first layer's hook

    def post_init_from_model(self, model):
        """``GatePress``'s checks and gates, then the model's budget profile."""
        super().post_init_from_model(model)
        heads = (len(self._attention), model.config.num_key_value_heads)
        if isinstance(self.profile, Profile):
            if self.profile.heads != heads:
                raise ValueError(f"profile holds (layers, KV heads) {self.profile.heads}, the model {heads}")
            self._profile = self.profile
        else:
            self._profile = load_profile(artefacts.model_key(model), heads, self.profile)

    def counts(self, n: int) -> torch.Tensor:
        """(L, H) long: each head's kept count for a context of ``n`` tokens (``budget_profile.profile_counts``)."""
        return profile_counts(self._profile, self.compression_ratio, n)

    def head_keep(self, scores: torch.Tensor, counts: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        """(1, H, n) bool: each head's top ``counts`` (H,) of its gate ``scores`` (1, H, n) ranked as: its first
        ``n_sink`` entries, then its ``int(window * count)`` most recent, then the gate's top (ties to the earlier
        entry). With ``fill`` (1, H, n), the last ``floor(fill_share * count)`` of each head's count are the fill's
        top among the entries not kept before. Under ``scope="layer"``, the top ``counts.sum()`` of the layer's
        ranked entries over all its heads."""
        n = scores.shape[-1]
        counts = counts.to(scores.device)
        ranked = scores.float().clone()
        top = ranked.amax() + 1.0
        position = torch.arange(n, device=scores.device, dtype=torch.float32) / n
        recent = (self.window * counts.double()).floor()[None, :, None]  # (1, H, 1)
        ranked = torch.where(torch.arange(n, device=scores.device) >= n - recent, top + position, ranked)
        ranked[..., : self.n_sink] = top + 2.0
        if self.scope == "layer":
            H = ranked.shape[1]
            keep = top_counts(ranked.reshape(1, 1, H * n), counts.sum().view(1))
            return keep.view(1, H, n)
        if fill is None:
            return top_counts(ranked, counts)
        n_fill = (self.fill_share * counts.double()).floor().long()  # (H,)
        keep = top_counts(ranked, counts - n_fill)
        return keep | top_counts(fill.float().masked_fill(keep, float("-inf")), n_fill)

    def fill_scores(self, module: nn.Module, kwargs: dict) -> torch.Tensor | None:
        """The fill's scores (1, H, n) of the layer ``module`` at its hook (its keys and values in the cache), or
        None without a fill."""
        if self.fill is None:
            return None
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        return self.fill(module, kwargs["hidden_states"], layer.keys, layer.values, kwargs)

    def prefill_plan(self, model, n: int) -> PrefillPlan:
        """``GatePress``'s plan; with a fill, each layer stores its gate scores and fill scores side by side
        (1, 2 H, n), keyed by the gate and the fill."""
        if self.fill is None or self.compression_ratio == 0:
            return super().prefill_plan(model, n)
        return PrefillPlan("gate", ("gate", self.gate_key, "fill", repr(self.fill)), lambda module, kwargs, output:
                           torch.cat([self.gate_scores(module.layer_idx, kwargs["hidden_states"]),
                                      self.fill_scores(module, kwargs).float()], dim=1))

    @torch.no_grad()
    def forward_hook(self, module: nn.Module, input: list, kwargs: dict, output: list):
        """At prefill, score this layer with its gate, keep each head's profile count, and replace the layer by a
        ``RaggedLayer`` of exactly those entries. The counts are fixed at the first hooked layer, from n."""
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]) or self.compression_ratio == 0:
            return output
        cache = kwargs["past_key_values"]
        if isinstance(cache, QuantizedCache):
            raise ValueError("ProfileGatePress evicts into a ragged cache: a QuantizedCache is not supported")
        if hidden_states.shape[0] != 1:
            raise ValueError(f"ProfileGatePress supports batch size 1 (heads keep different counts), got "
                             f"{hidden_states.shape[0]}")
        layer_idx = module.layer_idx
        if layer_idx == self._layers[0]:
            self._counts = self.counts(hidden_states.shape[1])
            self.kept = []
        scores = self.gate_scores(layer_idx, hidden_states)  # (1, H, n)
        keep = self.head_keep(scores, self._counts[self._layers.index(layer_idx)], self.fill_scores(module, kwargs))
        evict_ragged(cache, layer_idx, keep)
        self.kept.append(keep[0].sum(-1).tolist())
        return output

    @torch.no_grad()
    def compress_scores(self, cache, scores: dict[int, torch.Tensor]) -> None:
        """Evict every layer of ``cache`` (a full prefill's) from ``scores``: layer index -> that layer's
        ``gate_scores`` (1, H, n), with a fill its gate and fill scores side by side (1, 2 H, n) (``prefill_plan``).
        What the hooks do, layer by layer."""
        if self.compression_ratio == 0:
            return
        counts = self.counts(scores[self._layers[0]].shape[-1])
        self.kept = []
        for row, layer_idx in enumerate(self._layers):
            gate, fill = scores[layer_idx], None
            if self.fill is not None:
                gate, fill = gate.chunk(2, dim=1)
            keep = self.head_keep(gate, counts[row], fill)
            evict_ragged(cache, layer_idx, keep)
            self.kept.append(keep[0].sum(-1).tolist())


def top_counts(ranked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(1, H, n) bool: the ``counts`` (H,) highest entries of each head of ``ranked`` (1, H, n), ties to the earlier
    entry."""
    n = ranked.shape[-1]
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(ranked, dtype=torch.bool)
    keep.scatter_(-1, order, torch.arange(n, device=ranked.device) < counts.to(ranked.device)[None, :, None])
    return keep


__all__ = ["ProfileGatePress", "top_counts"]
