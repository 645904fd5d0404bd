"""The cross-proposal stratified sampler (its two proposals are in ``proposals.pairs``).

A cross-proposal hybrid keeps, in each KV head, a deterministic exact set chosen by one score (a
query-agnostic retrieval scorer such as KeyDiff, over blocks of neighbouring positions) and fills the
rest of the head's budget by priority sampling from another proposal (pi_min-h), with the
Horvitz-Thompson weights of that draw, which the decode-time SNIS correction reads. The exact set is
a stratum kept with weight 1; the sampled rest is unbiased for the sum over the positions outside it,
so sum_kept w_i f_i is unbiased for sum_i f_i (the shape of a fixed top set plus a sampled tail with a
Hajek correction, as in Error Certificates, arXiv 2607.21475, with the two strata scored by different
proposals).

- ``PairProposal``: both proposals of one layer, stacked as (b, H_kv, 2, n): row 0 chooses the
  exact set, row 1 is sampled from. Only a ``CrossStratifiedSampler`` reads it.
- ``CrossStratifiedSampler``: the draw, with a per-head budget (int((1 - r) n) entries, kvpress's
  count), so the cache holds what kvpress's top-k holds plus the correction bias.
- ``CrossTopSampler``: the same exact set, the rest of each head the top of the other proposal
  (deterministic, weight 1).
- ``UniformProposal``: pi_i = 1 / n. With priority sampling and a per-head budget it is uniform
  random per-head eviction (arXiv 2609.03430's baseline); its weights are all equal, so the
  correction changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvpress.utils import compute_n_kept

from kvpress_prob.samplers.base import Draw, Sampler, check_ratio, renormalise, top_by_rank
from kvpress_prob.samplers.priority import priority_draw


@dataclass(kw_only=True)
class CrossStratifiedSampler(Sampler):
    """Exact blocks by one proposal, the rest priority-sampled from another (per-head budget only).

    pi (L, b, H, 2, n) from ``PairProposal``. Each head keeps k = floor((1 - r) n) positions:
    the floor(alpha k / size) blocks of ``size`` positions with the largest sums of row 0 (the last
    block may be shorter), kept with weight 1; then the k - |exact| positions drawn by priority
    sampling from row 1 restricted to the other positions and renormalised, with weights
    max(pi_i, t) / pi_i (``priority_draw``). Exactly k positions are kept in every head.

    Parameters
    ----------
    alpha : float, default 0.5
        Share of each head's budget given to the exact blocks, in [0, 1]. 0 is priority sampling
        from row 1 alone, 1 is a top-k of row 0's blocks (up to the rounding to whole blocks).
    size : int, default 8
        Positions per exact block, >= 1.
    """

    alpha: float = 0.5
    size: int = 8

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size must be an integer >= 1, got {self.size!r}")
        self.whole_count = True

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        check_ratio(compression_ratio)
        if scope != "head":
            raise ValueError(f"CrossStratifiedSampler needs budget='head' (one count per head), got {scope!r}")
        check_pair(pi)
        L, b, H, _, n = pi.shape
        k = compute_n_kept(n, compression_ratio)
        draw = self.keep_counts(pi, torch.full((L, b, H), k, dtype=torch.long, device=pi.device), generator)
        draw.stats = {"exact_blocks_per_head": min(int(self.alpha * k) // self.size, -(-n // self.size)),
                      "kept_per_head": k}
        return draw

    def keep_counts(self, pi: torch.Tensor, counts: torch.Tensor, generator) -> Draw:
        """The draw with each head's own count: pi (L, b, H, 2, n) from ``PairProposal``, counts (L, b, H) long in
        [0, n]. Head h keeps floor(alpha k_h / size) exact blocks by row 0 (at most every block), then fills to k_h
        from row 1 outside them (``fill``); ``__call__`` is this with kvpress's count in every head."""
        check_pair(pi)
        pi = pi.double()
        exact_pi, sample_pi = pi[..., 0, :], pi[..., 1, :]  # (L, b, H, n)
        L, b, H, n = exact_pi.shape
        if counts.shape != (L, b, H) or bool((counts < 0).any()) or bool((counts > n).any()):
            raise ValueError(f"counts must be (L, b, H) = {(L, b, H)} in [0, {n}], got shape {tuple(counts.shape)} "
                             f"in [{int(counts.min())}, {int(counts.max())}]")
        counts = counts.to(pi.device).long()
        blocks = -(-n // self.size)
        block_pi = F.pad(exact_pi, (0, blocks * self.size - n)).view(L, b, H, blocks, self.size).sum(-1)
        n_blocks = (torch.floor(self.alpha * counts.double()).long() // self.size).clamp(max=blocks)  # (L, b, H)
        top = top_by_rank(block_pi, n_blocks).repeat_interleave(self.size, dim=-1)[..., :n]  # (L, b, H, n)
        rest = renormalise(sample_pi, ~top)
        target = (counts - top.sum(-1)).clamp(min=0)  # (L, b, H)
        sampled, log_w = self.fill(rest, target, generator)
        keep = top | sampled
        log_weight = torch.where(top, 0.0, torch.where(sampled, log_w, float("-inf")))
        return Draw(keep=keep, log_weight=log_weight.float())

    def fill(self, rest: torch.Tensor, target: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions that fill each head after its exact set, and their log-weights: a priority draw of
        ``target`` (L, b, H) positions from ``rest`` (L, b, H, n), row 1 renormalised outside the exact set."""
        return priority_draw(rest, target, generator)


def check_pair(pi: torch.Tensor) -> None:
    if pi.dim() != 5 or pi.shape[3] != 2:
        raise ValueError(f"pi must be (L, b, H, 2, n) from a PairProposal, got shape {tuple(pi.shape)}")


@dataclass(kw_only=True)
class CrossTopSampler(CrossStratifiedSampler):
    """``CrossStratifiedSampler``'s exact set by row 0, the rest of each head's k the top of row 1 (weight 1).

    Deterministic: two scores' top sets side by side in every head, with nothing to correct, so the cache
    holds kvpress top-k's bytes. Parameters as ``CrossStratifiedSampler``'s.
    """

    def __post_init__(self):
        super().__post_init__()
        self.random = False

    def fill(self, rest, target, generator):
        """The ``target`` (L, b, H) positions of largest row 1 outside the exact set, log-weight 0."""
        top = top_by_rank(rest, target)
        return top, torch.zeros_like(rest)


__all__ = ["CrossStratifiedSampler", "CrossTopSampler"]
