"""Block (cluster) sampling: whole runs of neighbouring positions are kept or evicted together."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F

from kvpress_prob.samplers.base import Draw, Sampler
from kvpress_prob.samplers.threshold import ThresholdSampler


@dataclass(kw_only=True)
class BlockSampler(Sampler):
    """Cluster sampling over blocks of ``size`` consecutive positions (beyond the paper).

    A block's proposal is the sum of its positions' pi; the ``inner`` design chooses blocks from
    these block proposals under the same ratio and scope, and every position of a kept block is
    kept with the block's weight. A block is one unit of a Horvitz-Thompson (or count) estimator, so
    E[w_i 1{i kept}] = 1 still holds for every position and the correction is unchanged. A token
    that only makes sense with its neighbours (one digit of a number that the tokenizer splits
    digit by digit) then survives or dies with them, where independent designs keep each digit
    with its own probability and a whole number only with their product (docs/method.md,
    "Sampling designs").

    Parameters
    ----------
    size : int, default 8
        Positions per block, >= 1 (the last block of the prefix may be shorter).
    inner : Sampler, default ThresholdSampler()
        The design applied to the blocks.
    """

    size: int = 8
    inner: Sampler = field(default_factory=ThresholdSampler)

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not isinstance(self.inner, Sampler) or isinstance(self.inner, BlockSampler):
            raise TypeError(f"inner must be a non-block Sampler, got {type(self.inner).__name__}")
        self.random = self.inner.random

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        L, b, H, n = pi.shape
        blocks = -(-n // self.size)
        padded = F.pad(pi.double(), (0, blocks * self.size - n))  # (L, b, H, blocks * size)
        block_pi = padded.view(L, b, H, blocks, self.size).sum(-1)  # (L, b, H, blocks)
        result = self.inner(block_pi, compression_ratio, scope, generator)
        keep = result.keep.repeat_interleave(self.size, dim=-1)[..., :n]
        log_weight = result.log_weight.repeat_interleave(self.size, dim=-1)[..., :n]
        return Draw(keep=keep, log_weight=log_weight, stats={**result.stats, "block_size": self.size})
