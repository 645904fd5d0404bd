"""Bytes held on the cache by each configuration on each context: keys and values, and the correction bias."""

from __future__ import annotations

import torch

from evaluation.engine.prefill import Prefill
from evaluation.tasks.prose.measure import compressed


@torch.no_grad()
def held(model, context: torch.Tensor, configs) -> list[dict]:
    """One row per configuration (``evaluation.engine.runner.Config``) on ``context`` (1, n): kv_bytes and
    bias_bytes as the runners record them (measured on the compressed cache), full_bytes (the full cache's
    keys and values in the model's dtype) and realised_ratio."""
    n = context.shape[1]
    shared = Prefill(model, context.to(model.device), [c.build() for c in configs])
    full = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(shared.keys, shared.values))
    rows = []
    for cfg in configs:
        with compressed(shared, cfg, n) as (cache, memory):
            rows.append(dict(press=cfg.label, compression_ratio=cfg.compression_ratio, seed=cfg.seed,
                             full_bytes=full, n_context=n, **memory))
        del cache
    return rows
