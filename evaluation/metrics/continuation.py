"""Teacher-forced continuation metrics: how far a compressed cache's next-token distributions move
from the full cache's, per scored position.

Both take the (T, V) logits of one teacher-forced forward (``evaluation.engine.teacher_forced``); row t
is the prediction of target t. Pure torch, float64.
"""

from __future__ import annotations

import torch


def kl_per_position(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) || softmax(logits)) per row (in nats, float64, clamped at 0)."""
    p = torch.log_softmax(reference_logits.double(), dim=-1)
    q = torch.log_softmax(logits.double(), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1).clamp_min(0.0)


def nll_per_position(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[t, targets[t]] per row (nats, float64); ``targets`` (T,) token ids."""
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets must have shape ({logits.shape[0]},) to match the logits' rows, got {tuple(targets.shape)}")
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets.to(logits.device)[:, None].long())[:, 0]
