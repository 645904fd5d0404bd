"""Block (cluster) sampling: whole runs of neighbouring positions are kept or evicted together."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvpress_prob.samplers.base import Draw, Sampler, check_ratio, ratio_keeping
from kvpress_prob.samplers.threshold import ThresholdSampler

#: heads that share one budget in each scope, as a function of (layers, heads)
GROUP_HEADS = {"global": lambda L, H: L * H, "layer": lambda L, H: H, "head": lambda L, H: 1}


@dataclass(kw_only=True)
class BlockSampler(Sampler):
    """Cluster sampling over blocks of ``size`` consecutive positions (beyond the paper).

    A block's proposal is the sum of its positions' pi; the ``inner`` design chooses blocks from
    these block proposals under the same ratio and scope, and every position of a kept block is
    kept with the block's weight. A block is one unit of a Horvitz-Thompson (or count) estimator, so
    E[w_i 1{i kept}] = 1 still holds for every position and the correction is unchanged. A token
    that only makes sense with its neighbours (one digit of a number that the tokenizer splits
    digit by digit) then survives or dies with them, where independent designs keep each digit
    with its own probability and a whole number only with their product.

    The budget in blocks is (1 - r) times the block count, per head. A random inner that keeps a
    whole count (priority sampling, a priority hybrid) would round it down and spend up to a block
    less than the budget; here the scope's block budget is rounded at random instead, up with
    probability its fractional part (one uniform from the generator, independent of the inner's
    draw, so the weights stay unbiased), so the expected kept count meets the budget. A
    deterministic inner (top-k) keeps the rounded-down count.

    Parameters
    ----------
    size : int, default 8
        Positions per block, >= 1 (the last block of the prefix may be shorter).
    inner : Sampler, default ThresholdSampler()
        The design applied to the blocks; not a ``BlockSampler``, and without sinks or a window
        (those count positions, and would count blocks here).
    """

    size: int = 8
    inner: Sampler = field(default_factory=ThresholdSampler)

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not isinstance(self.inner, Sampler) or isinstance(self.inner, BlockSampler):
            raise TypeError(f"inner must be a non-block Sampler, got {type(self.inner).__name__}")
        if getattr(self.inner, "n_sink", 0) or getattr(self.inner, "window", 0):
            raise ValueError(
                f"inner must have n_sink = window = 0, got {self.inner.n_sink} and {self.inner.window}: they count "
                f"positions, and inside a BlockSampler they would count blocks")
        self.random = self.inner.random

    def block_ratio(self, compression_ratio: float, scope: str, L: int, H: int, blocks: int,
                    generator: torch.Generator) -> float:
        """The compression ratio handed to the inner design: ``compression_ratio`` itself, or for a
        random whole-count inner the ratio whose block budget is the scope's (1 - r) blocks rounded
        at random (up with probability its fractional part)."""
        check_ratio(compression_ratio)
        if scope not in GROUP_HEADS:
            raise ValueError(f"budget must be one of {tuple(GROUP_HEADS)}, got {scope!r}")
        if not (self.inner.random and self.inner.whole_count):
            return compression_ratio
        heads = GROUP_HEADS[scope](L, H)
        budget = heads * blocks * (1.0 - compression_ratio)  # blocks kept by each group, in expectation
        whole = math.floor(budget + 1e-6)  # 1e-6: the float noise of a whole budget, not a fraction to round
        if budget - whole > 1e-6:
            whole += int(torch.rand((), generator=generator, device=generator.device, dtype=torch.float64)
                         < budget - whole)
        return ratio_keeping(whole, heads * blocks) if whole > 0 else 1.0 - whole / (heads * blocks)

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        L, b, H, n = pi.shape
        blocks = -(-n // self.size)
        padded = F.pad(pi.double(), (0, blocks * self.size - n))  # (L, b, H, blocks * size)
        block_pi = padded.view(L, b, H, blocks, self.size).sum(-1)  # (L, b, H, blocks)
        ratio = self.block_ratio(compression_ratio, scope, L, H, blocks, generator)
        result = self.inner(block_pi, ratio, scope, generator)
        keep = result.keep.repeat_interleave(self.size, dim=-1)[..., :n]
        log_weight = result.log_weight.repeat_interleave(self.size, dim=-1)[..., :n]
        return Draw(keep=keep, log_weight=log_weight.float(), stats={**result.stats, "block_size": self.size})
