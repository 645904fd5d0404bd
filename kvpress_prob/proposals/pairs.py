"""Two proposals for the cross-proposal hybrids: ``PairProposal`` (two proposals of one layer, stacked as
(b, H_kv, 2, n): row 0 chooses the exact set, row 1 is sampled from; only a ``CrossStratifiedSampler``
reads it) and ``UniformProposal`` (pi_i = 1 / n: with priority sampling and a per-head budget, uniform random
per-head eviction; its weights are all equal, so the correction changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpress_prob.proposals.attention import MinVarianceProposal
from kvpress_prob.proposals.base import Proposal


@dataclass(kw_only=True)
class UniformProposal(Proposal):
    """The uniform proposal pi_i = 1 / n (random eviction's; Proposal's ``floor`` changes nothing).

    Parameters
    ----------
    floor, head_shared, sharpness : as ``Proposal`` (no effect on a uniform pi).
    """

    def weights(self, module, hidden_states, keys, values, kwargs):
        return torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)  # (b, H_kv, n)


@dataclass(kw_only=True)
class PairProposal(Proposal):
    """Two proposals of one layer stacked as (b, H_kv, 2, n): ``exact`` (row 0: it ranks the units of
    the exact set) and ``sample`` (row 1: the rest is sampled from it). Each row is that proposal's
    own pi (floor included); this object's ``floor``, ``head_shared`` and ``sharpness`` are unused.

    Parameters
    ----------
    exact : Proposal
        The retrieval score choosing each head's exact set (e.g. ``ScoreProposal(KeyDiffPress())``).
    sample : Proposal, default MinVarianceProposal(harmonic=True)
        pi_min-h: the proposal the rest is priority-sampled from, and whose weights the correction reads.
    """

    exact: Proposal
    sample: Proposal = field(default_factory=lambda: MinVarianceProposal(harmonic=True))

    def __post_init__(self):
        super().__post_init__()
        for name in ("exact", "sample"):
            if not isinstance(getattr(self, name), Proposal) or isinstance(getattr(self, name), PairProposal):
                raise TypeError(f"{name} must be a (non-pair) kvpress_prob Proposal, got {type(getattr(self, name)).__name__}")

    @torch.no_grad()
    def __call__(self, module, hidden_states, keys, values, kwargs) -> torch.Tensor:
        exact = self.exact(module, hidden_states, keys, values, kwargs)
        sample = self.sample(module, hidden_states, keys, values, kwargs)
        return torch.stack([exact, sample], dim=2)  # (b, H_kv, 2, n)
