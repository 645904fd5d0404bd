"""SamplingPress: probabilistic KV cache eviction with a global soft budget and SNIS correction."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from torch import nn
from transformers import PreTrainedModel, QuantizedCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob import correction
from kvpress_prob.budget import SCOPES
from kvpress_prob.proposals import MinVarianceProposal, Proposal, ScoreProposal
from kvpress_prob.sampling import Draw, draw

correction.install()


def language_model(model: PreTrainedModel) -> nn.Module:
    """The decoder stack (``model.model``, or its ``language_model`` for multimodal wrappers)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


@dataclass
class SamplingPress(BasePress):
    """Probabilistic KV cache eviction (Geh, Chen, Israel, Grover, Van den Broeck, "A Probabilistic
    Interpretation of KV Cache Eviction", 2026).

    At prefill every layer's proposal pi (batch, kv_heads, n) is collected; when the prefill
    forward ends (a hook on the decoder stack), the number of draws m is solved for the budget,
    counts c_i ~ Poisson(m pi_i) are drawn for every head (O(n) per head; the total is Poisson(m),
    not fixed: given it, the counts are the paper's multinomial), the entries never drawn are
    evicted, and each layer's cache is cut to its kept entries, padded only to that layer's largest
    head. Each attention module keeps the log-weights log(c_i / (m pi_i)) / temperature, read at
    decode time by ``kvpress_prob.correction`` (self-normalised importance sampling).

    m is chosen so that the expected kept count sum_i (1 - exp(-m pi_i)), over the budget's scope,
    equals (1 - compression_ratio) * n per head: the kept count is random ("soft"), its
    realisation is in ``stats``.

    Parameters
    ----------
    proposal : Proposal, default MinVarianceProposal(harmonic=True)
        Maps a layer's prefill to pi (see ``kvpress_prob.proposals``).
    compression_ratio : float, default 0.0
        Fraction of the prefix evicted, in [0, 1). 0 leaves the cache untouched.
    temperature : float, default 1.0
        tau > 0; the log-weights are divided by it. 1 is the full correction, larger values trade
        bias for variance, ``float("inf")`` is plain renormalisation over the kept entries.
    correct : bool, default True
        False turns the correction off (the same as temperature = inf).
    budget : {"global", "layer", "head"}, default "global"
        One m for the whole model, one per layer, or one per head.
    seed : int, default 0
        Seed of the draws: the same seed gives the same kept set.
    n_sink, window : int, default 0
        Exact strata (beyond the paper): the first ``n_sink`` and last ``window`` prefix positions
        are kept in every head with weight 1; they count against the budget.
    alpha : float, default 0.0
        Exact top stratum (beyond the paper): the top ``alpha`` fraction of each head's allocation,
        by pi, is kept with weight 1 and the rest sampled from pi restricted to the remainder.
        0 is the paper; 1 is a deterministic top-k under the same budget allocation.
    coordinated : bool, default False
        Coordinated sampling (beyond the paper): one uniform per position shared by every layer
        and head, so a token tends to be kept everywhere or nowhere.
    inclusion_weights : bool, default False
        Beyond the paper: weight a kept entry by 1 / q_i, q_i = 1 - exp(-m pi_i) its inclusion
        probability (Horvitz-Thompson), instead of c_i / (m pi_i). It is the count weight averaged
        over the counts that give the same kept set: unbiased too, and free of the Poisson noise of
        c_i on entries drawn many times (see ``kvpress_prob.sampling``).
    """

    proposal: Proposal = field(default_factory=lambda: MinVarianceProposal(harmonic=True))
    compression_ratio: float = 0.0
    temperature: float = 1.0
    correct: bool = True
    budget: str = "global"
    seed: int = 0
    n_sink: int = 0
    window: int = 0
    alpha: float = 0.0
    coordinated: bool = False
    inclusion_weights: bool = False
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    last_draw: Draw | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"compression_ratio must be in [0, 1), got {self.compression_ratio}")
        if not self.temperature > 0:  # also catches NaN
            raise ValueError(f"temperature must be > 0 (inf turns the correction off), got {self.temperature}")
        if self.budget not in SCOPES:
            raise ValueError(f"budget must be one of {SCOPES}, got {self.budget!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.n_sink < 0 or self.window < 0:
            raise ValueError(f"n_sink and window must be >= 0, got {self.n_sink} and {self.window}")
        if not isinstance(self.proposal, Proposal):
            raise TypeError(f"proposal must be a kvpress_prob Proposal, got {type(self.proposal).__name__}")
        self._pending: dict[int, tuple[nn.Module, torch.Tensor]] = {}
        self._cache = None

    def post_init_from_model(self, model: PreTrainedModel):
        implementation = model.config._attn_implementation
        if implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"SamplingPress needs an attention implementation from ALL_ATTENTION_FUNCTIONS "
                f"{sorted(ALL_ATTENTION_FUNCTIONS.keys())}, got attn_implementation={implementation!r}: "
                f"load the model with attn_implementation='sdpa'"
            )
        if isinstance(self.proposal, ScoreProposal):
            self.proposal.scorer.compression_ratio = self.compression_ratio
            self.proposal.scorer.post_init_from_model(model)

    @torch.no_grad()
    def forward_hook(self, module: nn.Module, input: list, kwargs: dict, output: list):
        """At prefill, compute and keep this layer's proposal; eviction waits for the last layer."""
        hidden_states = kwargs["hidden_states"]
        q_len = hidden_states.shape[1]
        if not is_prefilling(kwargs["cache_position"], q_len):
            return output
        correction.reset(module)
        if module.layer_idx == 0:
            self._pending = {}
        if self.compression_ratio == 0:
            return output
        if hidden_states.shape[0] != 1:
            raise ValueError(
                f"SamplingPress supports batch size 1 (heads keep different counts per example), "
                f"got batch size {hidden_states.shape[0]}"
            )
        cache = kwargs["past_key_values"]
        if cache is None or isinstance(cache, QuantizedCache):
            raise ValueError("SamplingPress needs a DynamicCache (past_key_values), not a quantized or missing one")
        layer = cache.layers[module.layer_idx]
        pi = self.proposal(module, hidden_states, layer.keys, layer.values, kwargs)  # (b, H_kv, n)
        self._pending[module.layer_idx] = (module, pi)
        self._cache = cache
        return output

    @torch.no_grad()
    def evict(self, *args) -> None:
        """Draw, cut and pad every layer's cache, and leave the log-weights on each module."""
        if not self._pending:
            return
        pending, cache = self._pending, self._cache
        self._pending, self._cache = {}, None
        layer_ids = sorted(pending)
        pi = torch.stack([pending[i][1] for i in layer_ids])  # (L, b, H_kv, n)
        generator = torch.Generator(device=pi.device).manual_seed(self.seed)
        result = draw(
            pi, self.compression_ratio, self.budget, generator, self.n_sink, self.window, self.alpha, self.coordinated,
            self.inclusion_weights,
        )
        self.last_draw = result
        tau = self.temperature if self.correct else float("inf")
        kept, stored, bytes_kv, bytes_full, bytes_bias = [], [], 0, 0, 0
        for index, layer_idx in enumerate(layer_ids):
            module = pending[layer_idx][0]
            keep, log_weight = result.keep[index], result.log_weight[index]  # (b, H_kv, n)
            layer = cache.layers[layer_idx]
            keys, values = layer.keys, layer.values  # (b, H_kv, n, d)
            counts = keep.sum(dim=-1)  # (b, H_kv)
            n_stored = max(1, int(counts.max()))
            # kept positions first, in prefix order, then padding
            order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :n_stored]  # (b, H_kv, S)
            index_kv = order[..., None].expand(-1, -1, -1, keys.shape[-1])
            bytes_full += keys.numel() * keys.element_size() * 2
            layer.keys = keys.gather(2, index_kv).contiguous()
            layer.values = values.gather(2, index_kv).contiguous()
            bias = torch.full(order.shape, torch.finfo(keys.dtype).min, dtype=torch.float32, device=keys.device)
            is_kept = torch.arange(n_stored, device=keys.device) < counts[..., None]
            weight = log_weight.gather(-1, order) / tau if tau != float("inf") else torch.zeros_like(bias)
            bias = torch.where(is_kept, weight, bias).to(keys.dtype)
            setattr(module, correction.BIAS_ATTR, bias)
            kept.append(counts[0].tolist())
            stored.append(n_stored)
            bytes_kv += layer.keys.numel() * layer.keys.element_size() * 2
            bytes_bias += bias.numel() * bias.element_size()
        n, heads = pi.shape[-1], pi.shape[2]
        kept_total = sum(map(sum, kept))
        head_dim_bytes = bytes_full // (len(layer_ids) * heads * n)  # bytes of one entry (key + value)
        self.stats = {
            "target_ratio": self.compression_ratio,
            "realised_ratio": 1.0 - kept_total / (len(layer_ids) * heads * n),
            "m": result.m[:, 0].tolist() if self.budget != "global" else float(result.m.flatten()[0]),
            "n": n,
            "kept": kept,  # per layer, per KV head
            "stored": stored,  # per layer: the padded length
            "bytes_full": bytes_full,
            "bytes_kept": kept_total * head_dim_bytes,
            "bytes_stored": bytes_kv,
            "bytes_bias": bytes_bias,
            "padding": bytes_kv / max(1, kept_total * head_dim_bytes),
        }

    @contextmanager
    def __call__(self, model: PreTrainedModel):
        decoder = language_model(model)
        hook = decoder.register_forward_hook(self.evict)
        try:
            with super().__call__(model):
                yield
        finally:
            hook.remove()
            self._pending, self._cache = {}, None
