"""experiments/fast_cache.py: the needle survival summary on a hand-made kept set (the held keys' positions are
``kvpress_prob.cache.kept_positions``'s, tested in tests/test_one_reader.py)."""

import torch

from experiments.fast_cache import needle_summary


def test_survival_counts_whole_needles_layers_and_the_recent_share():
    keep = torch.zeros(2, 3, 10, dtype=torch.bool)  # (L, H, n)
    keep[0, 0, [2, 3, 9]] = True  # keeps the needle {2, 3} whole, and the last entry
    keep[0, 1, [2, 5]] = True  # half the needle
    keep[1, 2, [2, 3, 4, 8]] = True  # whole
    out = needle_summary(keep, [[2, 3]])
    assert out["heads_whole"] == 2 / 6 and out["layers_any_head"] == 2
    assert out["needle_tokens_kept"] == 5 / 12  # (2 + 1 + 2) of 6 heads x 2 tokens
    assert (out["count_min"], out["count_max"]) == (0, 4)
    assert out["last10_share"] == 1 / 9  # position 9 of the 9 kept entries
