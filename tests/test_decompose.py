"""The decomposition bench: step (b) keeps kvpress's own set, the kept-set reader is exact, needles
are found token by token, and the paired changes are what the examples say."""

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import random_ids, tiny_model
from scipy import stats

from evaluation.engine import Prefill
from evaluation.metrics.survival import kept_positions, survival
from evaluation.tasks.ruler.needles import needle_positions
from experiments.decompose.report import paired_changes
from experiments.decompose.steps import step_configs
from kvpress_prob.names.registry import get_press


@pytest.fixture(scope="module")
def prefill():
    return Prefill(tiny_model("llama"), random_ids(150, seed=3))


@pytest.mark.parametrize("family", ["tova", "knorm", "snapkv", "streaming_llm", "h2o"])
@pytest.mark.parametrize("ratio", [0.1, 0.37, 0.75])
def test_head_step_keeps_exactly_kvpress_set(prefill, family, ratio):
    steps = step_configs(family, ratio, [0])
    topk, head = steps["topk"][0].build(), steps["head"][0].build()
    kvpress_kept = kept_positions(prefill, prefill.compress(topk), topk)  # read off the cache's keys
    ours = kept_positions(prefill, prefill.compress(head), head)  # the press's own draw
    assert kvpress_kept.sum(-1).eq(int(150 * (1 - ratio))).all()
    if family == "h2o":  # kvpress's H2O reads eager attention, our proposal recomputes it on sdpa
        agreement = (kvpress_kept == ours).double().mean()
        assert agreement > 0.9, f"h2o at r = {ratio}: {agreement:.3f}"
        return
    assert torch.equal(kvpress_kept, ours), f"{family} at r = {ratio}"


def test_kept_positions_reads_the_cache_exactly(prefill):
    """On a sampled press the cache reader and the press's draw agree (the reader has no other
    reference for kvpress presses)."""
    press = get_press("prob_knorm", 0.5, seed=4)
    cache = prefill.compress(press)
    draw = press.last_draw.keep[:, 0]
    press.compression_ratio = 0.0  # force the reader to match keys instead of reading the draw
    read = kept_positions(prefill, cache, press)
    # every drawn entry is found; a layer's padding holds evicted keys (under the lowest bias),
    # so the reader finds exactly the layer's stored length in every head
    assert read[draw].all()
    stored = torch.tensor(press.stats["stored"])[:, None].expand(read.shape[:2])
    assert torch.equal(read.sum(-1), stored)


def test_needle_positions_spell_the_value(tokenizer):
    text = "noise noise. The special magic number is: 8436384. more noise 8436384"
    ids = tokenizer(text, return_tensors="pt").input_ids
    [positions] = needle_positions(tokenizer, ids, ["8436384"])
    assert tokenizer.decode(ids[0, positions[:7]]).strip() == "8436384"
    assert len(positions) == 14  # digits one by one, both occurrences
    assert needle_positions(tokenizer, ids, ["999"]) == [[]]


def test_survival_counts_heads_holding_every_token():
    keep = torch.ones(2, 3, 10, dtype=torch.bool)  # (L, H, n)
    keep[0, 0, 4] = False  # one head of layer 0 loses one token of the needle
    result = survival(keep, [[3, 4, 5]])
    assert result["survival"] == pytest.approx(5 / 6)
    assert result["per_layer"] == pytest.approx([2 / 3, 1.0])
    assert survival(keep, [[]])["survival"] is None


def test_paired_changes_match_a_paired_t_interval():
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 100, 12)
    delta = rng.normal(-5, 3, 12)
    rows = []
    for i in range(12):
        rows.append(dict(family="tova", compression_ratio=0.5, example_id=f"e{i}", step="topk", score=base[i]))
        rows.append(dict(family="tova", compression_ratio=0.5, example_id=f"e{i}", step="head", score=base[i] + delta[i]))
    changes = paired_changes(pd.DataFrame(rows))
    first = changes[changes["change"] == "topk → head"].iloc[0]
    low, high = stats.t.interval(0.95, 11, loc=delta.mean(), scale=stats.sem(delta))
    assert first["mean"] == pytest.approx(delta.mean())
    assert (first["low"], first["high"]) == pytest.approx((low, high))
    assert first["n_examples"] == 12 and first["better"] + first["worse"] == 12
