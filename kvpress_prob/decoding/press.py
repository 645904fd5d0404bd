"""SamplingDecodingPress: probabilistic KV cache eviction while decoding, with compounded SNIS weights."""

from __future__ import annotations

import logging
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import DecodingPress
from kvpress.presses.base_press import is_prefilling
from kvpress.presses.scorer_press import ScorerPress
from torch import nn

from kvpress_prob import attention_dispatch
from kvpress_prob.correction import corrected_attention  # noqa: F401  registers the "corrected" handler
from kvpress_prob.correction import bias as correction
from kvpress_prob.decoding import rounds
from kvpress_prob.proposals.attention import rope_queries
from kvpress_prob.proposals.base import scores_to_weights
from kvpress_prob.samplers import Sampler
from kvpress_prob.samplers.priority import PrioritySampler

logger = logging.getLogger(__name__)

#: proposals while decoding: a kvpress scorer's scores, or the buffered queries' attention
PROPOSALS = ("scorer", "attention", "h2o", "min_variance")


@dataclass
class _CacheState:
    """What a ``SamplingDecodingPress`` keeps of one cache, per layer, between its forwards: two caches
    decoded in any interleaving inside one ``with press(model)`` never see each other's."""

    hidden_states_buffer: defaultdict = field(default_factory=lambda: defaultdict(list))  # hidden states (b, c, D)
    layer_step_counts: defaultdict = field(default_factory=lambda: defaultdict(int))  # steps since the last round
    queries: defaultdict = field(default_factory=lambda: defaultdict(list))  # RoPE (cos, sin) (b, c, d) of each step
    accumulated: dict = field(default_factory=dict)  # accumulated attention (b, H_kv, S) of the stored entries ("h2o")
    rounds: defaultdict = field(default_factory=lambda: defaultdict(int))  # rounds so far (seeds the generator)
    budgets: dict = field(default_factory=dict)  # per-layer budgets' plans and measures (``layer_budgets``)
    prompt: dict = field(default_factory=dict)  # logical length of each layer before its first decoding forward


@dataclass
class SamplingDecodingPress(DecodingPress):
    """Probabilistic eviction while decoding, a kvpress ``DecodingPress`` (beyond Geh et al., "A
    Probabilistic Interpretation of KV Cache Eviction", 2026, which evicts at prefill only; the
    sampling is that of VaSE, Chang et al. 2026, arXiv 2606.03928, plus the correction).

    Every ``compression_interval`` decoding steps each layer is cut back to ``target_size`` entries
    per KV head (``kvpress_prob.decoding.rounds``): the first ``n_sink`` and the last ``window`` are kept
    exactly, the others are drawn from the proposal by ``sampler``, and the cache keeps its positional
    order. With ``correct=True`` a kept entry's log-weight log 1/q is added to the correction bias
    it already carries (a prefill ``SamplingPress``'s included) and the bias is gathered with its
    keys, so an entry that survived rounds with inclusion probabilities q1, q2, ... weighs
    1/(q1 q2 ...) in the decode-time SNIS attention (``kvpress_prob.correction.bias``).
    ``correct=False`` keeps the same entries and adds nothing (a bias already on the cache is still
    carried with its keys). A ``TopKSampler`` is kvpress's ``DecodingPress`` with positional order.

    Runs alone (kvpress's pipeline, ``model.generate``) or as the ``decoding_press`` of a
    ``PrefillDecodingPress`` behind any prefill press. A round that finds a layer with at most
    ``target_size`` entries in every head leaves it and logs a warning (``stats["skipped"]``).
    Batch size 1 for the designs whose kept count is random (threshold, blocks); padding to the
    largest head counts in ``stats["stored"]``.

    Parameters
    ----------
    base_press : kvpress ScorerPress, optional
        The scorer of ``proposal="scorer"``, called on the buffered hidden states as kvpress's
        ``DecodingPress`` calls it; None for the other proposals.
    compression_interval : int, default 32
        Decoding steps (forwards) between two rounds, >= 1.
    target_size : int, default 256
        Entries per KV head after a round, > n_sink + window + protect_values.
    hidden_states_buffer_size : int, default 32
        Steps of hidden states (and, for the attention proposals, queries) kept for the proposal;
        >= compression_interval makes "h2o" the exact accumulated attention of every step.
    proposal : {"scorer", "attention", "h2o", "min_variance"}, default "attention"
        "scorer": ``base_press.score``; "attention": the buffered queries' attention with the
        current bias; "h2o": that attention accumulated over all rounds (H2O, Zhang et al. 2023),
        carried with the entries; "min_variance": attention x ||v|| (pi_min, Geh et al.).
    sampler : kvpress_prob Sampler, default PrioritySampler()
        The design of the draw (priority: exactly k per head; threshold; stratified; blocks; top-k).
    n_sink : int, default 4
        First entries per head kept exactly, >= 0.
    window : int, default 32
        Last entries per head kept exactly, >= 0.
    protect_values : int, default 0
        Entries per head with the largest value range (max - min over the head dimension) kept
        exactly, VaSE's protection of large values; >= 0.
    correct : bool, default True
        Compound the Horvitz-Thompson weights into the correction bias.
    temperature : float, default 1.0
        Each round adds log(1/q) / ``temperature`` to a kept entry's bias, > 0. Compounding is
        defined stage by stage: a round
        multiplies the weight an entry already carries, whatever its origin (a prefill press's
        log w / T_prefill, 0 after an uncorrected prefill), by (1/q)^(1/temperature). At 1 a round
        is unbiased for the cache it cuts; 1 / (q_prefill q1 ...) holds when every stage has T = 1,
        and temperature = T_prefill gives the one tempered product (1 / (q_prefill q1 ...))^(1/T).
    max_weight : float, default inf
        Cap on a drawn entry's compounded weight e^bias (truncated importance weights), > 1.
    renormalise : bool, default False
        Scale the drawn entries' compounded weights, per head and round, to sum to the candidates'
        weights before the round (``decode_round.controlled``).
    harmonic : bool, default False
        Weigh the buffered queries' attention rows by the harmonic prior h_j ~ 1 / (B - j) (the
        attention proposals; "min_variance" with it is pi_min-h over the buffer).
    floor : float, default 0.01
        Uniform mass mixed into the proposal over the drawn candidates, in [0, 1) (a defensive
        mixture: no candidate's inclusion probability falls below about floor k / m).
    bias_dtype : {"float32", "keys"}, default "float32"
        The dtype the compounded bias is stored in: float32, or the keys' dtype (2 bytes in
        bfloat16 / float16, which an equal-bytes comparison counts per kept entry).
    seed : int, default 0
        Round r of layer l draws from a generator seeded with (seed, l, r): same seed, same kept sets.
    """
    #: read by ``kvpress_prob.correction.wrappers``: this decoding press keeps the correction bias with its keys
    keeps_correction: ClassVar[bool] = True

    base_press: ScorerPress | None = None
    compression_interval: int = 32
    target_size: int = 256
    hidden_states_buffer_size: int = 32
    proposal: str = "attention"
    sampler: Sampler = field(default_factory=PrioritySampler)
    n_sink: int = 4
    window: int = 32
    protect_values: int = 0
    correct: bool = True
    temperature: float = 1.0
    max_weight: float = float("inf")
    renormalise: bool = False
    harmonic: bool = False
    floor: float = 0.01
    bias_dtype: str = "float32"
    seed: int = 0
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("compression_interval", "target_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("n_sink", "window", "protect_values", "hidden_states_buffer_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        exact = self.n_sink + self.window + self.protect_values
        if self.target_size <= exact:
            raise ValueError(
                f"target_size must be > n_sink + window + protect_values = {exact} (some entries must be drawn), "
                f"got {self.target_size}"
            )
        if self.proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {self.proposal!r}")
        if self.proposal == "scorer" and not isinstance(self.base_press, ScorerPress):
            raise TypeError(
                f"proposal='scorer' needs a kvpress ScorerPress as base_press, got {type(self.base_press).__name__}"
            )
        if self.proposal != "scorer" and self.base_press is not None:
            raise ValueError(f"base_press is the scorer of proposal='scorer'; proposal={self.proposal!r} takes None")
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must be a kvpress_prob Sampler, got {type(self.sampler).__name__}")
        if not self.temperature > 0 or self.temperature == float("inf"):  # also catches NaN
            raise ValueError(f"temperature must be > 0 and finite (correct=False adds nothing), got {self.temperature}")
        if not self.max_weight > 1:
            raise ValueError(f"max_weight must be > 1 (inf: no cap), got {self.max_weight}")
        if self.bias_dtype not in ("float32", "keys"):
            raise ValueError(f"bias_dtype must be 'float32' or 'keys', got {self.bias_dtype!r}")
        if self.harmonic and self.proposal == "scorer":
            raise ValueError("harmonic weighs the buffered queries of the attention proposals; proposal='scorer' has none")
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"floor must be in [0, 1), got {self.floor}")
        self.reset()

    def reset(self):
        """Drop every buffer and count (kvpress calls it when the press's context exits)."""
        self._caches = weakref.WeakKeyDictionary()  # cache -> its _CacheState (freed with the cache)
        self._bind(_CacheState())

    def _bind(self, state: "_CacheState") -> None:
        """Point the per-layer state kvpress's ``DecodingPress`` and this press read at one cache's."""
        self.hidden_states_buffer = state.hidden_states_buffer
        self.layer_step_counts = state.layer_step_counts
        self._queries, self._accumulated, self._rounds = state.queries, state.accumulated, state.rounds
        self._budgets, self._prompt = state.budgets, state.prompt

    def _state_of(self, cache) -> "_CacheState":
        state = self._caches.get(cache)
        if state is None:
            state = self._caches[cache] = _CacheState()
        return state

    def post_init_from_model(self, model):
        if self.base_press is not None:
            self.base_press.post_init_from_model(model)
        self.stats = {"rounds": 0, "skipped": 0, "stored": {}, "bytes_bias": {}}
        if self.correct:
            attention_dispatch.check_implementation(model, "SamplingDecodingPress")
        attention_dispatch.install()

    @torch.no_grad()
    def forward_hook(self, module: nn.Module, input: list, kwargs: dict, output: list):
        """kvpress's ``DecodingPress`` hook (buffer, count, a round every ``compression_interval``
        steps), plus the buffered RoPE of the attention proposals' queries."""
        hidden_states = kwargs["hidden_states"]
        if is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output
        if hidden_states.shape[0] != 1 and self.sampler.random:
            raise ValueError(f"SamplingDecodingPress samples with batch size 1, got {hidden_states.shape[0]}")
        layer = module.layer_idx
        self._bind(self._state_of(kwargs["past_key_values"]))  # every buffer, count and sum is this cache's
        if self.proposal != "scorer":  # the step's RoPE (cos, sin): its query is projected at the round
            self._queries[layer].append(kwargs["position_embeddings"])
        output = super().forward_hook(module, input, kwargs, output)
        if self.layer_step_counts[layer] == 0:  # a round ran: the queries are the cut cache's past
            self._queries[layer] = []
        size = self.hidden_states_buffer_size
        self._queries[layer] = self._queries[layer][-size:] if size > 0 else []
        return output

    @torch.no_grad()
    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One round on one layer: keys, values (b, H_kv, n, d) -> (b, H_kv, S', d); installs the
        compounded bias (b, H_kv, S') on the layer of ``kwargs["past_key_values"]``."""
        cache = kwargs["past_key_values"]
        layer = module.layer_idx
        b, h, n, _ = keys.shape
        stored = correction.bias_of(module, cache)
        bias = rounds.extended_bias(stored, (b, h, n), keys.device)  # (b, H_kv, n)
        real = rounds.is_real(bias)
        held = int(real.sum(-1).max())
        target = self.layer_target(layer, held)
        if held <= target:
            if self.proposal == "h2o":  # the buffered steps still accumulate
                self.weights(module, hidden_states, keys, values, bias, kwargs)
            if not self.stats.get("skipped"):  # once per context; stats["skipped"] counts every layer's
                logger.warning(f"layer {layer} holds {n} <= target_size={target} entries per head: no "
                               f"round (counted in stats['skipped'])")
            self.stats["skipped"] = self.stats.get("skipped", 0) + 1
            return keys, values
        fixed = rounds.fixed_entries(real, self.n_sink, self.window, values, self.protect_values)
        candidates = real & ~fixed
        k = torch.minimum((target - fixed.sum(-1)).clamp_min(0), candidates.sum(-1))  # (b, H_kv)
        weights = self.weights(module, hidden_states, keys, values, bias, kwargs)  # (b, H_kv, n)
        self.observe(layer, weights, candidates)
        pi = rounds.proposal_over(weights, candidates, self.floor)
        generator = torch.Generator(device=keys.device).manual_seed(
            (self.seed * 1_000_003 + layer) * 100_003 + self._rounds[layer])
        drawn, log_weight = rounds.draw(pi, candidates, k, self.sampler, generator)
        keep = fixed | drawn
        log_weight = rounds.controlled(log_weight, bias, drawn, candidates, self.temperature,
                                       math.log(self.max_weight), self.renormalise)
        keys, values, new_bias, order = rounds.cut(keys, values, bias, keep, log_weight, self.correct)
        if layer in self._accumulated:
            self._accumulated[layer] = weights.float().gather(-1, order) * (new_bias > rounds.LOWEST / 2)
        if self.bias_dtype == "keys":  # padding stays padding (cut sets it to float32's lowest)
            new_bias = correction.cast(new_bias, keys.dtype)
        if stored is not None or bool((new_bias != 0).any()):
            correction.set_bias(module, new_bias, cache)
        self._rounds[layer] += 1
        self.stats["rounds"] = self.stats.get("rounds", 0) + 1
        self.stats.setdefault("stored", {})[layer] = keys.shape[2]
        self.stats.setdefault("bytes_bias", {})[layer] = new_bias.numel() * new_bias.element_size()
        return keys, values

    def layer_target(self, layer: int, held: int) -> int:
        """Entries per KV head the round of ``layer`` keeps, its heads holding at most ``held`` real entries:
        ``target_size`` (``kvpress_prob.decoding.layer_budgets.LayerBudgetDecodingPress`` moves entries between layers)."""
        return self.target_size

    def observe(self, layer: int, weights: torch.Tensor, candidates: torch.Tensor) -> None:
        """Sees each round's proposal weights (b, H_kv, n) and candidates; nothing here (``layer_budgets``)."""

    def weights(self, module, hidden_states, keys, values, bias, kwargs) -> torch.Tensor:
        """The proposal's weights (b, H_kv, n), >= 0, any scale (``proposal_over`` restricts them to
        the candidates and normalises)."""
        b, h, n, d = keys.shape
        if self.proposal == "scorer":
            ratio = self._find_target_compression_ratio(n, self.target_size)
            original, self.base_press.compression_ratio = self.base_press.compression_ratio, ratio
            try:
                scores = self.base_press.score(module, hidden_states, keys, values, None, kwargs)
            finally:
                self.base_press.compression_ratio = original
            return scores_to_weights(scores).double()
        rope = self._queries[module.layer_idx]
        if not rope:
            raise RuntimeError(f"layer {module.layer_idx}: no buffered queries for proposal={self.proposal!r}")
        # the buffered steps' queries, projected in one call from kvpress's buffered hidden states (the same
        # steps, in order) rather than one projection per decoding step
        cos, sin = (torch.cat([part[i] for part in rope], dim=1) for i in (0, 1))
        if cos.shape[1] != hidden_states.shape[1]:
            raise RuntimeError(f"layer {module.layer_idx}: {cos.shape[1]} buffered positions for "
                               f"{hidden_states.shape[1]} buffered hidden states")
        queries = rope_queries(module, hidden_states, (cos, sin))[:, :, -n:]  # (b, H_q, B, d)
        scaling = getattr(module, "scaling", d ** -0.5)
        rows = rounds.harmonic_rows(queries.shape[2], keys.device) if self.harmonic else None
        mass = rounds.buffered_attention(queries, keys, bias, scaling, rows)  # (b, H_q, n)
        mass = mass.view(b, h, -1, n)  # (b, H_kv, g, n)
        if self.proposal == "min_variance":
            mass = mass * torch.linalg.vector_norm(values.float(), dim=-1)[:, :, None]
            return (mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)).mean(2).double()
        mass = mass.mean(2)  # (b, H_kv, n)
        if self.proposal == "h2o":
            previous = self._accumulated.get(module.layer_idx)
            if previous is not None and previous.shape[-1] <= n:
                mass = mass.clone()
                mass[..., : previous.shape[-1]] += previous.to(mass.device)
            self._accumulated[module.layer_idx] = mass  # gathered with the kept entries by ``compress``
        return mass.double()
