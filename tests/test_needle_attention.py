"""experiments/needle_attention.py: attention shares of the question's last token on a compressed cache."""

import pytest
import torch
from conftest import tiny_model

from evaluation.engine import Prefill
from experiments.needle_attention import shares
from kvpress_prob import get_press


def test_shares_sum_to_one_and_see_the_summary():
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (1, 64), generator=torch.Generator().manual_seed(0))
    question = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(1))
    prefill = Prefill(model, ids)
    needle = [10, 11, 12]
    plain = shares(model, prefill, get_press("keydiff", 0.5), question, needle)
    summary = shares(model, prefill, get_press("keydiff_sum4", 0.5), question, needle)
    full = shares(model, prefill, None, question, needle)
    for rows in (plain, summary, full):
        for r in rows:
            assert r["needle"] + r["kept"] + r["virtual"] + r["question"] == pytest.approx(1.0, abs=1e-5)
    assert all(r["virtual"] == 0 for r in plain) and all(r["virtual"] > 0 for r in summary)
    # the full cache holds every needle token: its share there is the plain softmax's
    assert all(r["needle"] > 0 for r in full)
