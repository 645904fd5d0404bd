"""Evicted-set summaries: V virtual entries per (layer, KV head) that stand for the evicted entries.

After eviction each head's evicted entries are split into V groups (V = ``Summary.n_virtual``), by
contiguous position segments or by k-means of their keys (as cached, after RoPE). Group g becomes
one virtual entry (count N_g, key mean mu_g, value mean nu_g) that the decode-time correction adds
to the softmax with log-weight log(tau N_g), tau = ``Summary.weight``: it stands for N_g entries
whose scores are all q . mu_g / sqrt d. tau in (0, 1]
tempers the summary from "absent" (tau -> 0) to the full count (tau = 1). A kept entry that
carried an importance weight w_i (a sampled press) gets 1 + (1 - tau)(w_i - 1): at tau = 1 the
summary, not the extrapolation of the kept entries, stands for the evicted mass, so the expected
total count is n at every tau. tau is the one tempering of a summary press: ``SummarySamplingPress``
refuses a ``temperature`` T other than 1, because no power w^(1/T) keeps that count.

Equal memory: the V virtual entries are stored like real ones (a key and a value each), so a press
with a summary keeps V fewer real entries per head than its compression ratio allows.

Two presses carry a summary, because kvpress's presses are not ours to give a field:
- ``SummaryPress`` wraps a kvpress ``ScorerPress`` (top-k per head, kvpress's count): it keeps the
  top (1 - r) n - V entries by the scorer's scores and summarises the rest, layer by layer;
- ``SummarySamplingPress`` is a ``SamplingPress`` with a ``summary`` field: it draws with
  V / n more compression, then summarises what the draw evicted (its ``evict`` is the public API the
  evaluation engine replays).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from kvpress import ScorerPress
from kvpress.presses.base_press import BasePress
from torch import nn
from transformers import Cache, PreTrainedModel

from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.sampling import SamplingPress

GROUPINGS = ("kmeans", "segments")


@dataclass
class Summary:
    """How the evicted entries of each (layer, KV head) become V virtual entries.

    Parameters
    ----------
    n_virtual : int, default 4
        V >= 1: virtual entries per KV head (each charged against the budget as one entry); capped at
        the head's budget minus one on prompts too short for it (``virtual_count``).
    grouping : {"kmeans", "segments"}, default "kmeans"
        "segments": the evicted entries in position order, cut into V runs of equal count;
        "kmeans": k-means of their keys, started from the segments' means, ``iterations`` Lloyd steps
        (deterministic: no random start).
    weight : float, default 1.0
        tau in (0, 1]: a virtual entry's log-weight is log(tau * count).
    iterations : int, default 8
        Lloyd steps of the k-means (>= 0).
    """

    n_virtual: int = 4
    grouping: str = "kmeans"
    weight: float = 1.0
    iterations: int = 8

    def __post_init__(self):
        if not (isinstance(self.n_virtual, int) and self.n_virtual >= 1):
            raise ValueError(f"n_virtual must be an integer >= 1, got {self.n_virtual!r}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight (tau) must be in (0, 1], got {self.weight}")
        if self.iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {self.iterations}")

    def virtual_count(self, budget: int) -> int:
        """The V used when a head may store ``budget`` entries: ``n_virtual``, capped at budget - 1 so
        that at least one real entry is kept (short prompts)."""
        if budget < 2:
            raise ValueError(f"a summary needs a budget of at least 2 entries per head (1 real, 1 virtual), got {budget}")
        return min(self.n_virtual, budget - 1)

    def groups(self, keys: torch.Tensor, evicted: torch.Tensor) -> torch.Tensor:
        """Group of each entry (b, H, n) long in [0, V), V where not evicted. keys (b, H, n, d)."""
        V = self.n_virtual
        rank = evicted.long().cumsum(-1) - 1  # rank of an evicted entry among its head's evicted ones
        total = evicted.sum(-1, keepdim=True).clamp_min(1)  # (b, H, 1)
        group = torch.where(evicted, rank * V // total, torch.full_like(rank, V))  # segments of equal count
        if self.grouping == "segments":
            return group
        x = keys.float()
        centroids, count = _means(x, group, V)  # (b, H, V, d), (b, H, V)
        for _ in range(self.iterations):
            distance = torch.cdist(x, centroids).square()  # (b, H, n, V)
            distance = distance.masked_fill(count[..., None, :] == 0, float("inf"))  # an empty group attracts nothing
            group = torch.where(evicted, distance.argmin(-1), torch.full_like(group, V))
            new, count = _means(x, group, V)
            centroids = torch.where(count[..., None] > 0, new, centroids)
        return group

    def summarise(self, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor):
        """(count (b, H, V) float32, key means (b, H, V, d), value means (b, H, V, d)) of the evicted
        entries (``evicted`` (b, H, n) bool) of keys, values (b, H, n, d); means in the keys' dtype."""
        group = self.groups(keys, evicted)
        key_mean, count = _means(keys.float(), group, self.n_virtual)
        value_mean, _ = _means(values.float(), group, self.n_virtual)
        return count, key_mean.to(keys.dtype), value_mean.to(values.dtype)

    def log_weights(self, count: torch.Tensor, kept_log_weight: torch.Tensor,
                    real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias of the stored real entries (b, H, S), bias of the virtual entries (b, H, V)), float32.

        kept_log_weight (b, H, S): log w_i of the stored entries (0 for top-k); real (b, H, S) bool:
        which stored entries are kept ones, not padding. A kept entry's bias is
        log(1 + (1 - tau)(w_i - 1)), padding's ``correction.padding``; a virtual entry's
        log(tau N_g), padding where its group is empty."""
        lowest = correction.padding(torch.float32)
        w = kept_log_weight.float().clamp(max=80.0).exp()
        kept_bias = torch.where(real, torch.log1p((1.0 - self.weight) * (w - 1.0)), lowest)
        virtual_bias = torch.where(count > 0, torch.log(self.weight * count.clamp_min(1.0)), lowest)
        return kept_bias, virtual_bias


def _means(x: torch.Tensor, group: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group means (b, H, V, d) of x (b, H, n, d) and counts (b, H, V); group V = no group."""
    onehot = F.one_hot(group, V + 1)[..., :V].to(x.dtype)  # (b, H, n, V)
    count = onehot.sum(-2)  # (b, H, V)
    total = onehot.transpose(-1, -2) @ x  # (b, H, V, d)
    return total / count.clamp_min(1.0)[..., None], count


def attach(module: nn.Module, cache: Cache, summary: Summary, keys: torch.Tensor, values: torch.Tensor,
           evicted: torch.Tensor, kept_log_weight: torch.Tensor | None, real: torch.Tensor | None,
           bias_dtype: torch.dtype) -> int:
    """Append the summary of ``evicted`` (b, H, n) of the full keys, values (b, H, n, d) to layer
    ``module.layer_idx`` of ``cache`` (already cut to its S stored entries: ``kept_log_weight``
    (b, H, S) their log w_i, ``real`` (b, H, S) which are kept entries and not padding; None and None
    for S kept entries of weight 1) and give that layer the bias of [stored | virtual]. Returns V."""
    layer = cache.layers[module.layer_idx]
    count, key_mean, value_mean = summary.summarise(keys, values, evicted)
    if kept_log_weight is None:
        kept_log_weight = torch.zeros(layer.keys.shape[:3], dtype=torch.float32, device=keys.device)
        real = torch.ones(layer.keys.shape[:3], dtype=torch.bool, device=keys.device)
    kept_bias, virtual_bias = summary.log_weights(count, kept_log_weight, real)
    layer.keys = torch.cat([layer.keys, key_mean.to(layer.keys.dtype)], dim=2).contiguous()
    layer.values = torch.cat([layer.values, value_mean.to(layer.values.dtype)], dim=2).contiguous()
    bias = correction.cast(torch.cat([kept_bias, virtual_bias], dim=-1), bias_dtype)
    correction.set_bias(module, bias, cache)
    return summary.n_virtual


@dataclass
class SummaryPress(BasePress):
    """kvpress top-k with an evicted-set summary (beyond the paper; cluster and moment summaries of
    evicted KV entries as in SubGen, Zandieh et al. 2024).

    Each head keeps the top int((1 - r) n) - V entries by ``press.score`` (kvpress's count minus the
    V virtual entries, so the cache holds as many entries as ``press`` alone) and stores V virtual
    entries summarising the rest, weighted at decode by the correction's bias.

    Parameters
    ----------
    press : kvpress ScorerPress
        The scorer; its ``compression_ratio`` is the budget (virtual entries included).
    summary : Summary, default Summary()
        Count of virtual entries, grouping and tempering weight.
    """

    press: ScorerPress = None
    summary: Summary = field(default_factory=Summary)

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise TypeError(f"press must be a kvpress ScorerPress, got {type(self.press).__name__}")
        if not isinstance(self.summary, Summary):
            raise TypeError(f"summary must be a Summary, got {type(self.summary).__name__}")

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        self.press.compression_ratio = value

    def post_init_from_model(self, model: PreTrainedModel):
        self.press.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        n = keys.shape[2]
        budget = int(n * (1 - self.compression_ratio))
        n_virtual = self.summary.virtual_count(budget)
        n_real = budget - n_virtual
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)  # (b, H, n)
        index = scores.topk(n_real, dim=-1).indices.sort(dim=-1).values  # (b, H, n_real), in prefix order
        evicted = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, index, False)
        gather = index[..., None].expand(-1, -1, -1, keys.shape[-1])
        cache = kwargs["past_key_values"]
        layer = cache.layers[module.layer_idx]
        layer.keys, layer.values = keys.gather(2, gather), values.gather(2, gather)
        attach(module, cache, replace(self.summary, n_virtual=n_virtual), keys, values, evicted, None, None, keys.dtype)
        return layer.keys, layer.values


@dataclass
class SummarySamplingPress(SamplingPress):
    """A ``SamplingPress`` whose evicted entries are summarised: it draws with compression ratio
    r + V / n, so that the kept entries plus the V
    virtual ones per head meet the budget r, then appends each head's summary to the cache. A kept
    entry's weight is 1 + (1 - tau)(w_i - 1) from the draw's w_i (1 with ``correct=False``).
    Every parameter of ``SamplingPress`` (``temperature`` must be 1: ``summary.weight`` is the one
    tempering, see the module docstring), plus:

    Parameters
    ----------
    summary : Summary, default Summary()
        Count of virtual entries, grouping and tempering weight tau (tau also tempers the kept
        entries' importance weights, see ``Summary.log_weights``).
    """

    summary: Summary = field(default_factory=Summary)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.summary, Summary):
            raise TypeError(f"summary must be a Summary, got {type(self.summary).__name__}")
        if self.temperature != 1.0:
            raise ValueError(
                f"temperature must be 1 with a summary, got {self.temperature}: a kept entry's weight "
                f"1 + (1 - tau)(w - 1) keeps the expected count n at every tau, which no power w^(1/T) does; "
                f"temper with Summary(weight=tau), or drop the weights with correct=False")

    @torch.no_grad()
    def evict(self, cache, proposals):
        modules = sorted(proposals, key=lambda module: module.layer_idx)
        full = {m: (cache.layers[m.layer_idx].keys, cache.layers[m.layer_idx].values) for m in modules}
        n = full[modules[0]][0].shape[2]
        n_virtual = self.summary.virtual_count(int(n * (1 - self.compression_ratio)))
        ratio = self.compression_ratio + n_virtual / n
        summary = replace(self.summary, n_virtual=n_virtual)
        drawn = replace(self, compression_ratio=ratio)  # a SamplingPress that draws and cuts with V / n more eviction
        draw = SamplingPress.evict(drawn, cache, proposals)
        for index, module in enumerate(modules):
            keys, values = full[module]
            keep = draw.keep[index].to(keys.device)  # (b, H, n)
            stored = cache.layers[module.layer_idx].keys.shape[2]
            # the stored entries: kept positions in prefix order, then padding (as SamplingPress.evict cuts)
            order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :stored]  # (b, H, S)
            real = torch.arange(stored, device=keys.device) < keep.sum(-1, keepdim=True)  # (b, H, S)
            log_w = draw.log_weight[index].to(keys.device).gather(-1, order) if self.correct else None
            log_w = torch.zeros(order.shape, device=keys.device) if log_w is None else log_w
            dtype = keys.dtype if self.bias_dtype == "keys" else torch.float32
            attach(module, cache, summary, keys, values, ~keep, torch.where(real, log_w, 0.0), real, dtype)
        self.last_draw = draw
        stats = dict(drawn.stats)
        heads = len(modules) * draw.keep.shape[2]
        stats["virtual"] = n_virtual
        stats["realised_ratio"] = 1.0 - ((1.0 - stats["realised_ratio"]) * heads * n + heads * n_virtual) / (heads * n)
        stats["stored"] = [s + n_virtual for s in stats["stored"]]
        self.stats = stats
        return draw


def summarised(press: BasePress, summary: Summary) -> BasePress:
    """``press`` with an evicted-set summary: a ``SummarySamplingPress`` with every field of a
    ``SamplingPress``, a ``SummaryPress`` around a kvpress ``ScorerPress``, and a summary press with
    its summary replaced. Any other subclass of ``SamplingPress`` (a ``SpanPress``) is refused: its
    own fields and eviction have no summarised counterpart."""
    if isinstance(press, (SummarySamplingPress, SummaryPress)):
        return replace(press, summary=summary)
    if type(press) is SamplingPress:
        return SummarySamplingPress(**{f.name: getattr(press, f.name) for f in fields(press) if f.init}, summary=summary)
    if isinstance(press, SamplingPress):
        raise TypeError(f"summarised takes a SamplingPress, a kvpress ScorerPress or a summary press, got a "
                        f"{type(press).__name__}, whose own fields a SummarySamplingPress would drop")
    return SummaryPress(press=press, summary=summary)
