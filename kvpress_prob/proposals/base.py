"""Proposal distributions over the prefix of one layer, one per KV head: the base class and score proposals.

A proposal maps one layer's prefill state (module, hidden states, keys, values, the forward kwargs
with the position embeddings) to a tensor pi of shape (batch, kv_heads, n): finite, strictly
positive, summing to 1 over the n prefix positions. The sampling press draws the kept entries
from it.

Every proposal ends with the same steps (``Proposal.__call__``):
- optional sharpening: pi <- pi^beta / sum pi^beta;
- optional head sharing: the mean over the layer's KV heads, shared by all of them;
- a uniform floor: pi <- (1 - floor) * pi + floor / n, so that every entry can be drawn.

Grouped-query attention: a KV head's proposal is the mean of its query heads' proposals, each
normalised first, so every query head's support is covered.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
from kvpress import CompactorPress, CriticalAdaKVPress, CriticalKVPress, StreamingLLMPress
from kvpress.presses.scorer_press import ScorerPress
from torch import nn



@dataclass(kw_only=True)
class Proposal:
    """Base class. Subclasses implement ``weights`` (non-negative, any scale).

    Parameters
    ----------
    floor : float, default 0.01
        Mass of the uniform component mixed in, in [0, 1): every entry has pi_i >= floor / n.
    head_shared : bool, default False
        Share one proposal (the mean over the layer's KV heads) across all KV heads of the layer.
    sharpness : float, default 1.0
        beta > 0: pi is taken proportional to pi^beta before the floor (beyond the paper). 1 is the
        paper; large beta tends to a top-k of the same scores, small beta to uniform.
    """

    floor: float = 0.01
    head_shared: bool = False
    sharpness: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"floor must be in [0, 1), got {self.floor}")
        if not (self.sharpness > 0 and math.isfinite(self.sharpness)):
            raise ValueError(f"sharpness must be a finite number > 0, got {self.sharpness}")

    def weights(self, module: nn.Module, hidden_states, keys, values, kwargs) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, module: nn.Module, hidden_states, keys, values, kwargs) -> torch.Tensor:
        w = self.weights(module, hidden_states, keys, values, kwargs).float()  # (b, H_kv, n)
        pi = normalise(w, name=f"{type(self).__name__} weights")
        if self.sharpness != 1.0:  # pi^beta / sum pi^beta, computed from the log to stay finite
            pi = torch.softmax(self.sharpness * torch.log(pi.double()), dim=-1).float()
        if self.head_shared:
            pi = pi.mean(dim=1, keepdim=True).expand_as(pi).contiguous()
        n = pi.shape[-1]
        return (1.0 - self.floor) * pi + self.floor / n


def normalise(w: torch.Tensor, name: str = "weights") -> torch.Tensor:
    """w (..., n) finite, >= 0, each row with a positive sum -> rows summing to 1. Else ValueError."""
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} must be finite (got NaN or Inf)")
    if (w < 0).any():
        raise ValueError(f"{name} must be non-negative (got a minimum of {w.min().item():.3g})")
    total = w.sum(dim=-1, keepdim=True)
    if (total <= 0).any():
        raise ValueError(f"{name} must have a positive sum for every head (got an all-zero row)")
    return w / total


def scores_to_weights(scores: torch.Tensor) -> torch.Tensor:
    """Map scorer scores (b, H_kv, n), any sign, to non-negative weights by shift: s - min_i s.

    A constant row (no information) becomes uniform. NaN / Inf and all-zero rows are errors.
    """
    scores = scores.float()
    if not torch.isfinite(scores).all():
        raise ValueError("scores must be finite (the scorer returned NaN or Inf)")
    if (scores == 0).all(dim=-1).any():
        raise ValueError("scores are all zero for a head: the scorer gives no information to sample from")
    shifted = scores - scores.amin(dim=-1, keepdim=True)
    flat = shifted.sum(dim=-1, keepdim=True) == 0
    return torch.where(flat, torch.ones_like(shifted), shifted)


@dataclass(kw_only=True)
class ScoreProposal(Proposal):
    """Proposal from any kvpress ``ScorerPress``: pi = floor-mix of (s - min s) / sum (s - min s).

    The shift maps negative scores (K-norm: -||k||) and 0/1 scores (StreamingLLM) to weights that
    keep the scorer's order; the entry with the lowest score gets only the floor mass.

    Parameters
    ----------
    scorer : kvpress ScorerPress
        Its ``score`` gives (batch, kv_heads, n) scores. Never written: a scorer whose scores read
        its ``compression_ratio`` (``scores_read_ratio``: StreamingLLM's) is copied at the press's
        ratio (``at_ratio``).
    """

    scorer: ScorerPress

    def weights(self, module, hidden_states, keys, values, kwargs):
        scores = self.scorer.score(module, hidden_states, keys, values, None, kwargs)
        return scores_to_weights(scores)

    def at_ratio(self, compression_ratio: float) -> ScoreProposal:
        """This proposal for a press at ``compression_ratio``: itself if its scorer's scores do not
        read the ratio, else a copy holding a deep copy of the scorer at that ratio."""
        if not scores_read_ratio(self.scorer):
            return self
        scorer = copy.deepcopy(self.scorer)
        scorer.compression_ratio = compression_ratio
        return dataclasses.replace(self, scorer=scorer)


#: kvpress scorers whose ``score`` reads their own ``compression_ratio`` (kvpress's source): StreamingLLM
#: (how many middle tokens score 0), Compactor (its blending), CriticalKV (its first-stage budget).
RATIO_SCORERS = (StreamingLLMPress, CompactorPress, CriticalKVPress, CriticalAdaKVPress)


def scores_read_ratio(scorer: ScorerPress) -> bool:
    """Whether ``scorer``'s scores depend on its ``compression_ratio``: a ``RATIO_SCORERS`` one, or
    one whose class kvpress and this package do not define (unknown, so assumed to). Scores that do
    not are shared by every ratio of that scorer."""
    package = type(scorer).__module__.split(".")[0]
    return isinstance(scorer, RATIO_SCORERS) or package not in ("kvpress", "kvpress_prob")
