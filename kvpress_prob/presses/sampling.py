"""SamplingPress: probabilistic KV cache eviction with a global soft budget and SNIS correction."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from torch import nn
from transformers import Cache, Gemma3ForConditionalGeneration, PreTrainedModel, QuantizedCache

from kvpress_prob import attention_dispatch
from kvpress_prob.correction import corrected_attention  # noqa: F401  registers the "corrected" handler
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses import prefill_modes
from kvpress_prob.presses.prefill_plan import PrefillPlan
from kvpress_prob.correction import wrappers
from kvpress_prob.samplers.budget import SCOPES
from kvpress_prob.proposals.attention import AttentionProposal, MinVarianceProposal
from kvpress_prob.proposals.base import Proposal, ScoreProposal
from kvpress_prob.samplers import Draw, PoissonSampler, Sampler
from kvpress_prob.samplers.base import check_ratio


def language_model(model: PreTrainedModel) -> nn.Module:
    """The decoder stack (``model.model``, or its ``language_model`` for multimodal wrappers)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


@dataclass
class SamplingPress(BasePress):
    """Probabilistic KV cache eviction (Geh, Chen, Israel, Grover, Van den Broeck, "A Probabilistic
    Interpretation of KV Cache Eviction", 2026).

    At prefill each layer's proposal pi (batch, kv_heads, n) is computed; the ``sampler`` turns the
    proposals of the budget's scope into kept masks and log-weights (the default, ``PoissonSampler``,
    is the paper's draws with replacement), the entries not kept are evicted, and each layer's cache
    is cut to its kept entries, padded only to that layer's largest head. A per-layer or per-head
    budget cuts each layer at its own hook, as kvpress's presses do; a global budget needs every
    layer's proposal, and ``prefill`` says how the prefill gets them without holding the full cache
    (``kvpress_prob.presses.prefill_modes``).
    Each layer of that cache carries the log-weights / temperature, read at decode time by
    ``kvpress_prob.correction.bias`` (self-normalised importance sampling): the
    correction belongs to that one cache, so nothing outlives it on the model. A prefill that skips
    a hooked layer, repeats one or stops before the last raises instead of evicting nothing.

    Inside kvpress's wrappers: last in a ``ComposedPress`` and as a ``PrefillDecodingPress``'s
    ``prefilling_press`` it runs as alone; every other wrapper (``wrappers.REFUSED`` and any unknown
    one) is refused with the alternative to use, before its first prefill evicts or skips anything
    (``kvpress_prob.correction.wrappers``; README table). Importing this package changes no kvpress class and no
    attention function: entering the press wraps the attention functions (``kvpress_prob.attention_dispatch``, whose
    "corrected" handler is ``kvpress_prob.correction.corrected_attention``).

    The kept count is random for a random design ("soft" budget): its expectation is
    (1 - compression_ratio) * n per head on average over the budget's scope, its realisation is in
    ``stats``.

    Public compression API (used by the evaluation engine to replay a recorded prefill):
    ``propose(module, kwargs)`` gives one layer's proposal from its hook arguments, and
    ``evict(cache, proposals)`` draws, cuts the cache and installs the correction;
    ``proposal_at_ratio`` is the proposal ``propose`` computes (the engine's key for sharing it).

    Parameters
    ----------
    proposal : Proposal, default MinVarianceProposal(harmonic=True)
        Maps a layer's prefill to pi (see ``kvpress_prob.proposals.attention``).
    sampler : Sampler, default PoissonSampler()
        The sampling design: maps the proposals and the budget to kept masks and log-weights (see
        ``kvpress_prob.samplers``).
    compression_ratio : float, default 0.0
        Fraction of the prefix evicted, in [0, 1). 0 leaves the cache untouched.
    temperature : float, default 1.0
        tau > 0; the log-weights are divided by it. 1 is the full correction, larger values trade
        bias for variance, ``float("inf")`` is plain renormalisation over the kept entries.
    correct : bool, default True
        False turns the correction off (the same as temperature = inf).
    budget : {"global", "layer", "head"}, default "global"
        The scope of the budget: one scale for the whole model, one per layer, or one per head.
    seed : int, default 0
        Seed of the sampler: the same seed gives the same kept set.
    bias_dtype : {"keys", "float32"}, default "keys"
        Precision of the stored correction bias: the keys' dtype, or float32 (the corrected attention
        then adds it in float32).
    prefill : {"auto", "recompute", "deferred", "offload"}, default "auto"
        How a prefill under the global budget holds the cache until the draw (a per-layer or
        per-head budget never waits). "recompute": a first forward computes only the proposals
        (one layer's full keys and values alive at a time), the draw is made over all of them, and
        the real forward cuts each layer at its hook: the peak of a kvpress press, one more forward.
        "deferred": every layer's full keys and values wait on the device for the last layer.
        "offload": they wait in host memory (pinned, non-blocking copies on CUDA), and only the
        kept entries come back; on a CPU it is "deferred". "auto" (``prefill_modes.resolve``, chosen
        by measurement): "offload" on CUDA, "deferred" on a CPU whose
        memory holds the full K+V, else "recompute". All give the same kept sets and
        weights for a seed. Inside a kvpress wrapper (``ComposedPress``, ``PrefillDecodingPress``),
        which owns the hooks, "recompute" runs as "deferred".
    """

    proposal: Proposal = field(default_factory=lambda: MinVarianceProposal(harmonic=True))
    sampler: Sampler = field(default_factory=PoissonSampler)
    compression_ratio: float = 0.0
    temperature: float = 1.0
    correct: bool = True
    budget: str = "global"
    seed: int = 0
    bias_dtype: str = "keys"
    prefill: str = "auto"
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    last_draw: Draw | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_ratio(self.compression_ratio)  # at once; the sampler checks it again at each draw (a later edit)
        if not self.temperature > 0:  # also catches NaN
            raise ValueError(f"temperature must be > 0 (inf turns the correction off), got {self.temperature}")
        if self.bias_dtype not in ("keys", "float32"):
            raise ValueError(f"bias_dtype must be 'keys' or 'float32', got {self.bias_dtype!r}")
        if self.budget not in SCOPES:
            raise ValueError(f"budget must be one of {SCOPES}, got {self.budget!r}")
        prefill_modes.check_mode(self.prefill)
        if not isinstance(self.proposal, Proposal):
            raise TypeError(f"proposal must be a kvpress_prob Proposal, got {type(self.proposal).__name__}")
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must be a kvpress_prob Sampler, got {type(self.sampler).__name__}")
        self._pending: dict[nn.Module, torch.Tensor | None] = {}  # attention module -> its proposal, this prefill
        self._layers: list[int] = []  # indices of the hooked attention layers (set by post_init_from_model)
        self._at_ratio: tuple | None = None  # (proposal, ratio, proposal_at_ratio): see ``proposal_at_ratio``
        self._collecting: dict | None = None  # "recompute": the proposals of its first forward, while it runs
        self._recomputed: tuple[dict, dict] | None = None  # "recompute": (those proposals, the draw's memo)
        self._devices: dict[nn.Module, torch.device] = {}  # "offload": each layer's device, this prefill

    def post_init_from_model(self, model: PreTrainedModel):
        """Called on entry (by this press's ``__call__`` or by a wrapper's): wraps the attention
        functions (whose wrapper checks, at every prefill, the kvpress wrappers hooked around this
        press: ``wrappers.check_hooks``) and readies the scorer of ``proposal_at_ratio``. Sets
        nothing on the model."""
        self._layers = hooked_layers(model)
        self._pending = {}
        attention_dispatch.check_implementation(model, "SamplingPress")
        attention_dispatch.install()
        if isinstance(self.proposal, ScoreProposal):
            self.proposal_at_ratio.scorer.post_init_from_model(model)

    @property
    def proposal_at_ratio(self) -> Proposal:
        """The proposal pi is computed with at this press's ``compression_ratio``: ``proposal``
        itself, except a ``ScoreProposal`` whose scorer's scores read the ratio (StreamingLLM's;
        ``ScoreProposal.at_ratio``), then a copy at this ratio. ``proposal`` and its scorer are never
        written. Equal for every ratio otherwise, so a shared prefill computes it once."""
        if not isinstance(self.proposal, ScoreProposal):
            return self.proposal
        if self._at_ratio is None or self._at_ratio[0] is not self.proposal or self._at_ratio[1] != self.compression_ratio:
            self._at_ratio = (self.proposal, self.compression_ratio, self.proposal.at_ratio(self.compression_ratio))
        return self._at_ratio[2]

    def prefill_plan(self, model: PreTrainedModel, n: int) -> PrefillPlan:
        """After a shared full-cache prefill: ``evict`` on the proposals ``propose`` computed in its hooks, keyed
        by ``proposal_at_ratio`` (shared by every seed, and by every ratio it does not read); nothing at ratio 0."""
        if self.compression_ratio == 0:
            return PrefillPlan("full")
        return PrefillPlan("sampling", ("proposal", repr(self.proposal_at_ratio)),
                           lambda module, kwargs, output: self.propose(module, kwargs))

    @torch.no_grad()
    def propose(self, module: nn.Module, kwargs: dict) -> torch.Tensor:
        """One layer's proposal pi (b, H_kv, n) from the keyword arguments of its attention
        module's prefill forward (``hidden_states``, ``past_key_values`` holding the layer's full
        keys and values, ``position_embeddings``, ...)."""
        hidden_states = kwargs["hidden_states"]
        if hidden_states.shape[0] != 1:
            raise ValueError(
                f"SamplingPress supports batch size 1 (heads keep different counts per example), "
                f"got batch size {hidden_states.shape[0]}"
            )
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, Cache) or isinstance(cache, QuantizedCache):
            raise ValueError("SamplingPress needs a DynamicCache (past_key_values), not a quantized or missing one")
        layer = cache.layers[module.layer_idx]
        if isinstance(self.proposal, AttentionProposal) and layer.keys.shape[2] != hidden_states.shape[1]:
            raise ValueError(
                f"layer {module.layer_idx} holds {layer.keys.shape[2]} keys for a prefill of {hidden_states.shape[1]} "
                f"tokens: a press before this SamplingPress (in ComposedPress) shortened the cache, and "
                f"{type(self.proposal).__name__} recomputes attention over the whole prefix. Put no sequence press "
                f"before it, or use a ScoreProposal (prob_snapkv, prob_tova, prob_knorm, prob_streaming_llm)"
            )
        return self.proposal_at_ratio(module, hidden_states, layer.keys, layer.values, kwargs)

    @torch.no_grad()
    def forward_hook(self, module: nn.Module, input: list, kwargs: dict, output: list):
        """At prefill, keep this layer's proposal; the last hooked layer draws and evicts every layer.

        The layers must come in order, each once, up to the last one: a prefill that skips a layer,
        repeats one or starts again before the last layer raises instead of evicting nothing."""
        if not is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            return output
        if self._collecting is not None:  # "recompute"'s first forward: the proposal only, then free the layer
            self._collecting[module] = self.propose(module, kwargs)
            prefill_modes.empty_layer(kwargs["past_key_values"], module.layer_idx)
            return output
        layers = self._layers or list(range(module.config.num_hidden_layers))
        if module.layer_idx == layers[0]:
            wrappers.check(self, module)
            if self._pending:
                self._abandon(f"a new prefill started at layer {module.layer_idx}")
        expected = layers[len(self._pending)] if len(self._pending) < len(layers) else None
        if module.layer_idx != expected:
            seen = [m.layer_idx for m in self._pending]
            self._pending, self._recomputed, self._devices = {}, None, {}
            raise RuntimeError(
                f"SamplingPress saw layer {module.layer_idx} after layers {seen}, expected layer {expected}: its "
                f"eviction needs every hooked layer {layers[0]}..{layers[-1]} of one prefill, in order"
            )
        cache = kwargs["past_key_values"]
        self._pending[module] = self._at_layer(module, kwargs, cache) if self.compression_ratio > 0 else None
        if module.layer_idx == layers[-1]:
            pending, self._pending = self._pending, {}
            if self.compression_ratio > 0:
                self._at_last_layer(cache, pending)
        return output

    def _cut_here(self) -> bool:
        """Whether each layer is cut at its own hook: a per-layer or per-head budget, or a global one
        whose draw the first forward of "recompute" made possible."""
        return self.budget != "global" or self._recomputed is not None

    def _at_layer(self, module: nn.Module, kwargs: dict, cache: Cache):
        """This layer's share of the prefill: cut now (-> its (draw, stats)) or its proposal (deferred)."""
        if self.budget != "global":
            self.evict(cache, {module: self.propose(module, kwargs)})
            return self.last_draw, self.stats
        if self._recomputed is not None:
            proposals, memo = self._recomputed
            with prefill_modes.global_draw(proposals, memo):
                self.evict(cache, {module: proposals[module]})
            return self.last_draw, self.stats
        pi = self.propose(module, kwargs)
        layer = cache.layers[module.layer_idx]
        if self._mode(layer.keys.device, 2 * layer.keys.numel() * layer.keys.element_size()) == "offload":
            self._devices[module] = layer.keys.device
            layer.keys, layer.values = prefill_modes.to_host(layer.keys), prefill_modes.to_host(layer.values)
        return pi

    def _at_last_layer(self, cache: Cache, pending: dict):
        """Every layer cut at its hook: merge their draws and stats; else draw and cut all layers now."""
        if self._cut_here():
            memo = self._recomputed[1] if self._recomputed is not None else {}
            self._recomputed = None
            self.last_draw = prefill_modes.merge_draws([part[0] for part in pending.values()])
            self.stats = prefill_modes.merge_stats([part[1] for part in pending.values()])
            for draw in memo.values():  # the global draw's own figures, as the deferred path reports them
                self.stats.update(draw.stats)
            return
        devices, self._devices = self._devices, {}
        prefill_modes.wait_for_host(devices.values())
        self.evict(cache, pending)
        if devices:
            prefill_modes.bring_back(cache, sorted(pending, key=lambda module: module.layer_idx), devices)

    def _before_decoder(self, decoder: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook on the decoder stack: before a prefill under a global budget with
        ``prefill="recompute"``, a first forward computes every layer's proposal only."""
        if (self._collecting is not None or self.compression_ratio == 0 or self.budget != "global"
                or self.prefill not in ("recompute", "auto")):
            return None
        inputs = kwargs.get("input_ids")
        inputs = inputs if inputs is not None else (args[0] if args else kwargs.get("inputs_embeds"))
        cache = kwargs.get("past_key_values")
        if inputs is None or inputs.shape[1] <= 1 or (cache is not None and cache.get_seq_length() > 0):
            return None  # not a prefill: the hooks will not evict
        config = decoder.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_layer = 2 * inputs.shape[0] * config.num_key_value_heads * inputs.shape[1] * head_dim
        element = next(decoder.parameters()).element_size()
        if self._mode(inputs.device, per_layer * element) != "recompute":
            return None
        self._collecting = {}
        try:
            proposals = prefill_modes.proposals_pass(decoder, args, kwargs, self._collecting)
        finally:
            self._collecting = None
        done = sorted(module.layer_idx for module in proposals)
        if done != self._layers:
            raise RuntimeError(
                f"the first forward of prefill='recompute' stopped after layers {done} without reaching the last "
                f"layer {self._layers[-1]}: nothing was evicted")
        self._recomputed = (proposals, {})
        return None

    def _mode(self, device, layer_bytes: int) -> str:
        """The prefill mode this prefill runs (``prefill_modes.resolve``), a layer's K+V ``layer_bytes``."""
        return prefill_modes.resolve(self.prefill, device, layer_bytes * max(1, len(self._layers)))

    def _abandon(self, why: str):
        done = [m.layer_idx for m in self._pending]
        cut = "those layers were cut, the others not" if self._cut_here() else "nothing was evicted"
        self._pending, self._recomputed, self._devices = {}, None, {}
        raise RuntimeError(
            f"{why}, but the previous prefill under SamplingPress stopped after layers {done} without reaching "
            f"the last layer {self._layers[-1] if self._layers else '?'}: {cut} (if that prefill "
            f"raised, enter the press's context again)"
        )

    def score(self, module=None, *args, **kwargs):
        """Refused: kvpress's wrappers that call ``score`` take a top-k of it (``wrappers.REFUSED``)."""
        raise TypeError(wrappers.refusal_message(self, module, "score"))

    def compress(self, module=None, *args, **kwargs):
        """Refused: SamplingPress evicts every layer at once at the end of the prefill (``evict``)."""
        raise TypeError(wrappers.refusal_message(self, module, "compress"))

    @torch.no_grad()
    def evict(self, cache: Cache, proposals: dict[nn.Module, torch.Tensor]) -> Draw:
        """Draw from ``proposals`` (attention module -> its pi (b, H_kv, n)), cut and pad those
        layers of ``cache``, and give each of them its log-weights / temperature as the correction
        bias (``correction.store``: it belongs to ``cache``; a layer whose bias would be all 0, weight 1 and
        no padding, stores none and decodes through the model's own attention). Returns the draw (also kept as
        ``last_draw``); fills ``stats``."""
        if not proposals:
            raise ValueError("evict needs the proposal of at least one layer")
        attention_dispatch.install()
        modules = sorted(proposals, key=lambda module: module.layer_idx)
        device = proposals[modules[0]].device  # layers may sit on several devices: draw on the first one's
        pi = torch.stack([proposals[module].to(device) for module in modules]).double()  # (L, b, H_kv, n)
        ratio = self.draw_ratio(pi.shape[-1])
        result = prefill_modes.draw(self.sampler, modules, pi, ratio, self.budget, self.seed)
        self.last_draw = result
        tau = self.temperature if self.correct else float("inf")
        kept, stored, bytes_kv, bytes_full, bytes_bias = [], [], 0, 0, 0
        for index, module in enumerate(modules):
            keys = cache.layers[module.layer_idx].keys  # (b, H_kv, n, d)
            keep, log_weight = result.keep[index].to(keys.device), result.log_weight[index].to(keys.device)  # (b, H_kv, n)
            bytes_full += keys.numel() * keys.element_size() * 2
            n_stored, layer_kv, layer_bias = self.store(cache, module, keep, log_weight, tau)
            bytes_kv += layer_kv
            bytes_bias += layer_bias
            kept.append(keep.sum(dim=-1)[0].tolist())
            stored.append(n_stored)
        n, heads = pi.shape[-1], pi.shape[2]
        kept_total = sum(map(sum, kept))
        entry_bytes = bytes_full // (len(modules) * heads * n)  # bytes of one entry (key + value)
        self.stats = {
            "target_ratio": self.compression_ratio,
            "realised_ratio": 1.0 - kept_total / (len(modules) * heads * n),
            **result.stats,
            "n": n,
            "kept": kept,  # per layer, per KV head
            "stored": stored,  # per layer: the padded length
            "bytes_full": bytes_full,
            "bytes_kept": kept_total * entry_bytes,
            "bytes_stored": bytes_kv,
            "bytes_bias": bytes_bias,
            "padding": bytes_kv / max(1, kept_total * entry_bytes),
        }
        return result

    def draw_ratio(self, n: int) -> float:
        """The compression ratio the draw is made at, for a prefix of ``n`` entries: ``compression_ratio``."""
        return self.compression_ratio

    def store(self, cache: Cache, module: nn.Module, keep: torch.Tensor, log_weight: torch.Tensor,
              tau: float) -> tuple[int, int, int]:
        """Cut layer ``module.layer_idx`` of ``cache`` to ``keep`` (b, H_kv, n): each head's kept entries first, in
        prefix order, padded to the layer's largest count, with log_weight (b, H_kv, n) / ``tau`` as the correction
        bias (``correction.store``). Returns (the stored length, bytes of K and V stored, bytes of the bias)."""
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values  # (b, H_kv, n, d)
        counts = keep.sum(dim=-1)  # (b, H_kv)
        n_stored = max(1, int(counts.max()))
        # kept positions first, in prefix order, then padding
        order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :n_stored]  # (b, H_kv, S)
        index_kv = order[..., None].expand(-1, -1, -1, keys.shape[-1])
        layer.keys = keys.gather(2, index_kv).contiguous()
        layer.values = values.gather(2, index_kv).contiguous()
        dtype = keys.dtype if self.bias_dtype == "keys" else torch.float32  # the stored bias's
        lowest = torch.full(order.shape, correction.padding(dtype), dtype=torch.float32, device=keys.device)
        is_kept = torch.arange(n_stored, device=keys.device) < counts[..., None]
        weight = log_weight.gather(-1, order) / tau if tau != float("inf") else torch.zeros_like(lowest)
        bias = torch.where(is_kept, weight, lowest).to(dtype)
        bytes_bias = correction.store(module, bias, cache)  # none when it is all 0 (top-k, no padding)
        return n_stored, layer.keys.numel() * layer.keys.element_size() * 2, bytes_bias

    @contextmanager
    def __call__(self, model: PreTrainedModel):
        """Hook every attention layer of ``model`` for the prefills run inside the block; on a clean
        exit, a prefill left without its eviction (it never reached the last layer) raises."""
        self._pending, self._recomputed, self._devices = {}, None, {}
        handle = language_model(model).register_forward_pre_hook(self._before_decoder, with_kwargs=True)
        try:
            with super().__call__(model):
                yield
        except BaseException:
            self._pending, self._recomputed, self._devices = {}, None, {}
            raise
        finally:
            handle.remove()
            self._collecting = None
        if self._pending:
            self._abandon("the press's context exited")


def hooked_layers(model: PreTrainedModel) -> list[int]:
    """Indices of the attention layers kvpress's ``BasePress.__call__`` hooks (Gemma3: not the
    sliding-window ones), in order: a SamplingPress evicts when the last of them is reached."""
    layers = language_model(model).layers
    gemma3 = isinstance(model, Gemma3ForConditionalGeneration)
    return [layer.self_attn.layer_idx for layer in layers if not (gemma3 and layer.self_attn.is_sliding)]
