"""Per-token scores of a compressed stream against the full-cache pass of the same stream.

At a scored position t the model predicts token t + 1 from logits l_t. With p = softmax(full logits)
and q = softmax(compressed logits):

    nll_full = -log p[y],   nll = -log q[y],   kl = sum_v p_v (log p_v - log q_v)   (nats)

The NLL increase of a stream is mean(nll - nll_full) over its scored tokens.
"""

from __future__ import annotations

import torch

FIELDS = ("nll_full", "nll", "nll_increase", "kl")


def token_scores(full_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Scores (T,) float64 of T positions: ``full_logits`` (T, V) the full cache's logits, ``logits`` (T, V)
    the compressed cache's, ``targets`` (T,) the next tokens. Both go through one float64 log-softmax."""
    if full_logits.shape != logits.shape or targets.shape != logits.shape[:1]:
        raise ValueError(f"shapes must be (T, V), (T, V), (T,), got {tuple(full_logits.shape)}, "
                         f"{tuple(logits.shape)}, {tuple(targets.shape)}")
    p_log = full_logits.double().log_softmax(dim=-1)  # (T, V)
    q_log = logits.double().log_softmax(dim=-1)  # (T, V)
    rows = torch.arange(len(targets), device=targets.device)
    nll_full, nll = -p_log[rows, targets], -q_log[rows, targets]
    kl = (p_log.exp() * (p_log - q_log)).sum(dim=-1).clamp_min(0.0)  # rounding can leave -1e-17
    return {"nll_full": nll_full, "nll": nll, "nll_increase": nll - nll_full, "kl": kl}


def summary(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Means over every scored token of the chunks' ``token_scores``, and ``n_scored``."""
    joined = {k: torch.cat([p[k] for p in parts]) for k in FIELDS}
    return {k: float(v.mean()) for k, v in joined.items()} | {"n_scored": int(len(joined["nll"]))}
