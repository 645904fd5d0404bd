"""A per-head budget profile, learned offline (``learned.profile``): the share of snapkv's count of entries each (layer, KV head) keeps.

A press that evicts each layer in its own hook sees one layer at a time, so it cannot take a global top over the
model's heads. KVzip's global top gives a few heads nearly the whole context and most heads a few entries; the
profile fixes that allocation offline, as LU-KV (arXiv 2602.08585: a [ratio, layer, head] table of prune
fractions profiled offline) and HeadKV (arXiv 2410.19258: per-head budgets from head scores) do. Here each head's
share at a ratio r is the mean, over development contexts, of its count in the global top ``L H compute_n_kept(n, r)``
of KVzip's scores (sinks pinned) divided by that total; between the ratios of the grid it is interpolated linearly
(below the grid's first ratio, towards the uniform share at r = 0; above its last, that last share).

``learned.profile`` fits and writes it. ``profile_counts`` turns the shares into integer counts for a context of n tokens: each head first keeps
``min(n_sink, k)`` entries (its sinks, k = ``compute_n_kept(n, r)``), then the rest of ``L H k`` is split by the
shares by largest remainder over the whole model, no head above n. The counts sum to ``L H k`` exactly: snapkv's
count of entries, at every ratio and length.

A profile is stored as safetensors (``shares`` (G, L, H) float32, ``grid`` (G,) float32) with its metadata (the
model key it was learned for, the grid, the sinks, the contexts' digests, the command); ``load_profile`` refuses a
file learned for another model key or another head count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvpress.utils import compute_n_kept

from kvpress_prob.presses import artefacts
from kvpress_prob.samplers.base import check_ratio


@dataclass(frozen=True)
class Profile:
    """Budget shares ``shares`` (G, L, H) float64, each (L, H) slice summing to 1, at the ratios ``grid`` (G,),
    increasing in (0, 1); ``n_sink`` entries per head kept before the shares; ``meta``: what it was learned from."""

    shares: torch.Tensor
    grid: tuple[float, ...]
    n_sink: int = 4
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.shares.dim() != 3 or self.shares.shape[0] != len(self.grid):
            raise ValueError(f"shares must be (len(grid), L, H), got {tuple(self.shares.shape)} for grid {self.grid}")
        if any(not 0 < r < 1 for r in self.grid) or list(self.grid) != sorted(set(self.grid)):
            raise ValueError(f"grid must be increasing ratios in (0, 1), got {self.grid}")
        if (self.shares < 0).any():
            raise ValueError("shares must be >= 0")
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")

    @property
    def heads(self) -> tuple[int, int]:
        """(layers, KV heads)."""
        return tuple(self.shares.shape[1:])

    def share_at(self, compression_ratio: float) -> torch.Tensor:
        """(L, H) float64 shares at ``compression_ratio``, interpolated on the grid (see the module), summing to 1."""
        check_ratio(compression_ratio)
        L, H = self.heads
        points = [0.0, *self.grid]
        table = torch.cat([torch.full((1, L, H), 1.0 / (L * H), dtype=torch.float64), self.shares.double()])
        if compression_ratio >= points[-1]:
            share = table[-1]
        else:
            i = max(j for j, r in enumerate(points) if r <= compression_ratio)
            t = (compression_ratio - points[i]) / (points[i + 1] - points[i])
            share = (1 - t) * table[i] + t * table[i + 1]
        return share / share.sum()


def largest_remainder(weights: torch.Tensor, total: int, caps: torch.Tensor) -> torch.Tensor:
    """Integer counts (same shape as ``weights``) summing to ``total``, proportional to ``weights`` (>= 0) by largest
    remainder (ties to the lower flat index), none above its ``caps``: a capped entry keeps its cap and the rest is
    split again among the others. Raises when ``total`` exceeds the caps' sum."""
    if total > int(caps.sum()):
        raise ValueError(f"total ({total}) exceeds the caps' sum ({int(caps.sum())})")
    w = weights.double().flatten()
    cap = caps.flatten().long()
    counts = torch.zeros_like(cap)
    free = cap > 0
    left = total
    while left > 0:
        share = torch.where(free, w, 0.0)
        if share.sum() <= 0:  # only zero weights left: split evenly among the free entries
            share = free.double()
        quota = share / share.sum() * left
        base = torch.minimum(quota.floor().long(), cap - counts)
        over = (counts + quota.floor().long() >= cap) & free
        if over.any():  # those entries reach their cap: fix them there, and split what is left again
            left -= int((cap - counts)[over].sum())
            counts[over] = cap[over]
            free &= ~over
            continue
        counts += base
        left -= int(base.sum())
        fraction = torch.where(free, quota - quota.floor(), -1.0)
        order = sorted(range(len(fraction)), key=lambda i: (-float(fraction[i]), i))[:left]
        counts[order] += 1
        left = 0
    return counts.view(weights.shape)


def profile_counts(profile: Profile, compression_ratio: float, n: int) -> torch.Tensor:
    """(L, H) long: each head's kept count for a context of ``n`` tokens (see the module); the sum is exactly
    ``L H compute_n_kept(n, compression_ratio)``."""
    check_ratio(compression_ratio)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (context tokens) must be an integer >= 1, got {n!r}")
    L, H = profile.heads
    k = compute_n_kept(n, compression_ratio)
    floor = min(profile.n_sink, k)
    rest = L * H * (k - floor)
    caps = torch.full((L, H), n - floor, dtype=torch.long)
    return floor + largest_remainder(profile.share_at(compression_ratio), rest, caps)


def read_profile(path: Path) -> Profile:
    """The profile stored at ``path`` (``save_profile``'s format)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        shares = f.get_tensor("shares").double()
    grid = tuple(json.loads(metadata["grid"]))
    meta = {k: v for k, v in metadata.items() if k not in ("grid", "n_sink")}
    return Profile(shares, grid, int(metadata["n_sink"]), meta)


#: A profile's file name, in the user's cache (``artefacts.model_dir``) or the package's artefacts.
PROFILE_FILE = "profile.safetensors"


def profile_path(model_key: str) -> Path:
    """The package's profile file for the model key ``model_key``:
    ``artefacts.PACKAGE_DIR/<model key>/profile.safetensors``."""
    return artefacts.PACKAGE_DIR / model_key / PROFILE_FILE


def load_profile(model_key: str, heads: tuple[int, int], path: Path | None = None) -> Profile:
    """The profile for the model whose key is ``model_key`` and (layers, KV heads) ``heads``: the file ``path``, else
    the user's (``artefacts.model_dir``, written by ``kvprob train-gate``), else the package's (``profile_path``).
    Refuses a file learned for another model key or head count."""
    if path is None:
        user = artefacts.model_dir(None, model_key) / PROFILE_FILE
        path = user if user.is_file() else profile_path(model_key)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no budget profile for the model {model_key!r} at {path}: learn one with "
                                f"`kvprob train-gate --model ...` (it trains the gate and the profile)")
    profile = read_profile(path)
    if profile.meta.get("model_key") != model_key:
        raise ValueError(f"the profile {path.name} was learned for the model {profile.meta.get('model_key')!r}, "
                         f"not {model_key!r}")
    if profile.heads != tuple(heads):
        raise ValueError(f"the profile {path.name} holds (layers, KV heads) {profile.heads}, the model {tuple(heads)}")
    return profile


__all__ = ["Profile", "largest_remainder", "load_profile", "profile_counts", "PROFILE_FILE", "profile_path",
           "read_profile"]
