"""The attention-error bench's measures against slow loops, and its correlation report on
synthetic cells whose answer is known."""

import numpy as np
import pandas as pd
import torch

from evaluation.engine import Prefill, teacher_forced
from experiments.attention.report import correlations
from experiments.attention.run import capture_heads, head_errors, measures
from tests.conftest import random_ids, tiny_model


def test_head_errors_and_needle_weights_match_slow_loops():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 5, 4, 8, generator=g)
    out = ref + 0.1 * torch.randn(3, 5, 4, 8, generator=g)
    err = head_errors(out, ref)
    for layer in range(3):
        for head in range(4):
            slow = (out[layer, :, head] - ref[layer, :, head]).norm() / ref[layer, :, head].norm()
            assert abs(float(err[layer, head]) - float(slow)) < 1e-6
    mass = torch.zeros(3, 4)
    mass[1, 2], mass[2, 0] = 3.0, 1.0
    got = measures(out, ref, mass, top_heads=1)
    assert abs(got["needle_err"] - (0.75 * float(err[1, 2]) + 0.25 * float(err[2, 0]))) < 1e-9
    assert abs(got["needle_top_err"] - float(err[1, 2])) < 1e-9
    slow_layer = [float((out[i] - ref[i]).norm() / ref[i].norm()) for i in range(3)]
    assert np.allclose(got["layer_err"], slow_layer, atol=1e-6)
    assert measures(out, ref, None, 1)["needle_err"] is None


@torch.no_grad()
def test_captured_heads_recombine_into_the_attention_output():
    """o_proj of the captured per-head outputs is the attention module's output."""
    model = tiny_model("llama")
    prefill = Prefill(model, random_ids(30))
    continuation = random_ids(5, seed=1)
    logits, heads = capture_heads(model, prefill.compress(None), continuation, 30)
    outputs = {}

    def hook(module, args, output):
        outputs["o"] = output[0][0].float()

    handle = model.model.layers[1].self_attn.register_forward_hook(hook)
    try:
        plain, _ = teacher_forced(model, prefill.compress(None), continuation, 30)
    finally:
        handle.remove()
    o_proj = model.model.layers[1].self_attn.o_proj
    assert torch.allclose(o_proj(heads[1].flatten(1)), outputs["o"], atol=1e-5)
    assert torch.allclose(logits, plain, atol=1e-5)


def test_correlations_find_a_measure_that_orders_scores_within_ratio():
    rng = np.random.default_rng(0)
    rows = []
    for ratio in (0.25, 0.5, 0.75):
        for p in range(8):
            score = 100 - 80 * ratio - 5 * p
            rows.append({"press": f"p{p}", "compression_ratio": ratio, "score": score, "kl": -score / 100,
                         "mean_layer_err": ratio + rng.normal(0, 0.001), "needle_err": -score,
                         "needle_top_err": rng.normal(), "needle_last_err": -score, "kl_answer": -score})
    table = pd.DataFrame(rows)
    corr = correlations(table, n_permutations=300, n_boot=100).set_index(["measure", "target"])
    assert corr.loc[("needle_err", "score"), "rho_within_ratio"] == -1.0
    assert corr.loc[("needle_err", "score"), "p_within_ratio"] < 0.01
    assert abs(corr.loc[("mean_layer_err", "score"), "rho_within_ratio"]) < 0.6  # ratio only, noise within
    assert corr.loc[("mean_layer_err", "score"), "rho_pooled"] < -0.7  # but pooled, the ratio orders it


def test_retention_weighs_kept_needle_attention_by_head_mass():
    from experiments.attention.run import retention

    attention = torch.zeros(1, 4, 2)  # 1 layer, 4 query heads (2 per KV head), needle of 2 tokens
    attention[0, 0] = torch.tensor([0.3, 0.1])  # KV head 0
    attention[0, 2] = torch.tensor([0.2, 0.2])  # KV head 1
    keep = torch.zeros(1, 2, 6, dtype=torch.bool)
    needle = [3, 5]
    keep[0, 0, 3] = True  # KV head 0 keeps the first needle token only
    keep[0, 1, [3, 5]] = True  # KV head 1 keeps both
    got = retention(attention, keep, needle, top_heads=1)
    assert abs(got["needle_recall"] - (0.4 / 0.8 * 0.75 + 0.4 / 0.8 * 1.0)) < 1e-6
    assert abs(got["needle_whole"] - 0.5) < 1e-6
    assert abs(got["needle_top_recall"] - 0.75) < 1e-6  # ties: head 0 comes first
