"""Learning the per-head budget profile (``presses.budget_profile``) from KVzip's scores of development contexts.

Each head's share at a ratio r of the grid is the mean, over the contexts, of its count in the global top
``L H compute_n_kept(n, r)`` of KVzip's scores (sinks pinned: ``per_head.global_top``'s kept set) over that total.
``save_profile`` writes it as safetensors with its metadata (the model key, the contexts' digests, the command), in
the package's artefacts (``budget_profile.profile_path``) when it ships.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvpress_prob.presses.budget_profile import Profile
from kvpress_prob.presses.per_head import global_counts


def fit_profile(labels: list[torch.Tensor], grid: tuple[float, ...], n_sink: int = 4, meta: dict | None = None
                ) -> Profile:
    """The profile of KVzip's global allocation on ``labels`` (each context's scores (L, H, n)): at each ratio of
    ``grid``, each head's count in the global top of the scores with the first ``n_sink`` pinned, over the total,
    averaged over the contexts."""
    if not labels:
        raise ValueError("fit_profile needs at least one context's labels")
    shares = []
    for ratio in grid:
        per_context = []
        for scores in labels:
            pinned = scores.float().clone()[:, None]  # (L, 1, H, n)
            pinned[..., :n_sink] = pinned.amax() + 1.0
            counts = global_counts(pinned, ratio)[:, 0].double()  # (L, H)
            per_context.append(counts / counts.sum())
        shares.append(torch.stack(per_context).mean(0))
    return Profile(torch.stack(shares), tuple(float(r) for r in grid), n_sink, dict(meta or {}))



def save_profile(profile: Profile, path: Path) -> None:
    """Write ``profile`` as safetensors with its grid, sinks and ``meta`` (strings) as the file's metadata."""
    from safetensors.torch import save_file

    metadata = {"grid": json.dumps(list(profile.grid)), "n_sink": str(profile.n_sink),
                **{k: v if isinstance(v, str) else json.dumps(v) for k, v in profile.meta.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"shares": profile.shares.float().contiguous(), "grid": torch.tensor(profile.grid, dtype=torch.float32)},
              str(path), metadata=metadata)



__all__ = ["fit_profile", "save_profile"]
