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

from kvpress_prob.learned.labels import ids_digest, kvzip_labels
from kvpress_prob.presses import artefacts
from kvpress_prob.presses.budget_profile import PROFILE_FILE, Profile, profile_path
from kvpress_prob.presses.per_head import global_counts

#: The ratios a profile holds (``profile_counts`` interpolates between them).
GRID = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
#: The first positions every head keeps (the gate presses pin them).
N_SINK = 4


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


def learn_profile(model, contexts: list[torch.Tensor], command: str, package: bool = False) -> Path:
    """Fit ``model``'s profile on the KVzip labels (cached) of ``contexts`` (development (1, n) ids) at ``GRID`` and
    write it, with the model key, the contexts' digests and ``command``, to the user's cache
    (``artefacts.model_dir``), or to the package's artefacts when ``package``. Returns the file's path."""
    key = artefacts.model_key(model)
    labels = [kvzip_labels(model, ids)[0] for ids in contexts]
    meta = {"model_key": key, "source": "KVzip's global top (per_head.global_top), mean share per head",
            "context_digests": [ids_digest(c) for c in contexts], "command": command}
    path = profile_path(key) if package else artefacts.model_dir(model, key) / PROFILE_FILE
    save_profile(fit_profile(labels, GRID, N_SINK, meta), path)
    return path


__all__ = ["GRID", "N_SINK", "fit_profile", "learn_profile", "save_profile"]
