"""experiments/fast_cache.py: positions of held keys and the needle survival summary, on hand-made caches."""

import torch

from experiments.fast_cache import kept_positions, survival


def test_held_keys_are_matched_to_their_positions():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(20, 4, generator=g)
    positions = torch.tensor([0, 3, 7, 19])
    held = full[positions] + 1e-7 * torch.randn(4, 4, generator=g)  # a recomputation's rounding
    found, distance = kept_positions(full, held)
    assert found.tolist() == positions.tolist() and 0 < distance < 1e-5


def test_survival_counts_whole_needles_layers_and_the_recent_share():
    keep = torch.zeros(2, 3, 10, dtype=torch.bool)  # (L, H, n)
    keep[0, 0, [2, 3, 9]] = True  # keeps the needle {2, 3} whole, and the last entry
    keep[0, 1, [2, 5]] = True  # half the needle
    keep[1, 2, [2, 3, 4, 8]] = True  # whole
    out = survival(keep, [[2, 3]])
    assert out["heads_whole"] == 2 / 6 and out["layers_any_head"] == 2
    assert out["needle_tokens_kept"] == 5 / 12  # (2 + 1 + 2) of 6 heads x 2 tokens
    assert (out["count_min"], out["count_max"]) == (0, 4)
    assert out["last10_share"] == 1 / 9  # position 9 of the 9 kept entries
