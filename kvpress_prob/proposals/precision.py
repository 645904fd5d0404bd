"""Matmul precision of the O(n^2) proposals.

``attention_mass`` (``kvpress_prob.proposals.attention``) runs its q k^T and its weighted sums in float32. On
CUDA, ``fast_matmul`` lets those float32 matmuls run on TF32 tensor cores (inputs rounded to 10
mantissa bits, float32 accumulation); elsewhere it changes nothing (a CPU's "high" precision may use
bfloat16 through oneDNN on some processors, which would make results machine-dependent).
``round_tf32`` emulates TF32's input rounding on any device: ``tests/test_nxn.py`` runs the proposal
on TF32-rounded inputs against a float64 reference, and the GPU check compares the CUDA result with
the same tolerance, ``TF32_TOLERANCE`` (total variation between the normalised masses). bfloat16 matmuls are not used: their bfloat16 output rounds a logit of 16 to a
step of 0.125, a 6 % error on its weight.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

TF32_TOLERANCE = 2e-3  # total variation distance between TF32 and float64 normalised attention masses


@contextmanager
def fast_matmul(device):
    """Inside the block, float32 matmuls on a CUDA ``device`` may use TF32; elsewhere nothing changes."""
    if torch.device(device).type != "cuda":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 with its mantissa rounded to TF32's 10 bits (to nearest, ties away from zero)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Half the L1 distance between a and b, each normalised to sum 1 over its last axis (the max over rows)."""
    a, b = a.double(), b.double()
    return float((a / a.sum(-1, keepdim=True) - b / b.sum(-1, keepdim=True)).abs().sum(-1).max() / 2)
