"""pi_min-h from sampled query rows: unbiased mixture, exact when every row is taken, the model's own
attention weights as the reference."""

import math

import pytest
import torch
from test_proposals import eager_attention, layer_inputs, reference

from kvpress_prob.proposals.attention import MinVarianceProposal, SampledMinVarianceProposal, row_weights, segment_rows

K_SE = 5.0  # standard errors; with ~300 entries P(any |Z| > 5) < 300 * 5.7e-7 under the CLT


def mixture_draws(A, h, s, draws, seed, naive=False):
    """(draws, H_q, n) estimates sum_r w_r A[:, row_r] of the mixture sum_j h_j A[:, j].
    naive: the same rows mixed by their own prior h_r (renormalised), no importance weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        rows, w = segment_rows(h, s, g)
        if naive:
            w = h.double()[rows] / h.double()[rows].sum()
        assert torch.all(rows[1:] > rows[:-1]) and len(rows) <= s  # distinct rows, in order, at most s
        out.append(torch.einsum("r,qrn->qn", w.to(A.dtype), A[:, rows]))
    return torch.stack(out)


def max_z(estimates, exact):
    """Largest |mean - exact| / standard error over the entries that vary, and the largest error on
    the entries that do not (rows every draw takes exactly)."""
    mean, se = estimates.mean(0), estimates.std(0) / math.sqrt(estimates.shape[0])
    varies, error = se > 1e-9, (mean - exact).abs()
    return float((error[varies] / se[varies]).max()), float(error[~varies].max()) if (~varies).any() else 0.0


@pytest.fixture(scope="module")
def attention():
    from conftest import tiny_model

    A = eager_attention(tiny_model("llama")).double()  # (H_q, n, n): the model's own rows p_j
    h, _ = row_weights(A.shape[-1], "harmonic", None, "cpu")
    return A, h, torch.einsum("j,qjn->qn", h.double(), A)


def test_sampled_mixture_is_unbiased_and_the_unweighted_one_is_not(attention):
    A, h, exact = attention
    estimates = mixture_draws(A, h, s=12, draws=3000, seed=0)
    z, fixed = max_z(estimates, exact)
    assert z < K_SE and fixed < 1e-9
    torch.testing.assert_close(estimates.sum(-1), torch.ones(estimates.shape[:2], dtype=A.dtype))  # weights sum to 1
    # the same rows without importance weights: biased towards the recent rows, far beyond the noise
    z_naive, _ = max_z(mixture_draws(A, h, s=12, draws=3000, seed=0, naive=True), exact)
    assert z_naive > 4 * K_SE


def test_uniform_prior_is_unbiased_too(attention):
    A, _, _ = attention
    n = A.shape[-1]
    h, _ = row_weights(n, "uniform", None, "cpu")
    z, fixed = max_z(mixture_draws(A, h, s=9, draws=2000, seed=1), torch.einsum("j,qjn->qn", h.double(), A))
    assert z < K_SE and fixed < 1e-9


def test_recent_rows_are_taken_exactly_and_old_segments_have_equal_mass():
    n, s = 1000, 40
    h, _ = row_weights(n, "harmonic", None, "cpu")
    h = h.double()
    # certainty rows by the rule: the w most recent, w the first count leaving every other row lighter
    # than an equal share of the rest: here w = 6 (34 / 7 > 1 - H_6 / H_1000 in units of 1 / H_1000)
    w = next(w for w in range(s) if (s - w) * h[n - 1 - w] < h[: n - w].sum())
    assert w == 6
    for seed in range(5):
        rows, weight = segment_rows(h, s, torch.Generator().manual_seed(seed))
        assert len(rows) == s  # every segment holds a row: all sampled rows are lighter than a segment
        assert rows[-w:].tolist() == list(range(n - w, n)) and torch.equal(weight[-w:], h[n - w:])
        share = float(h[: n - w].sum()) / (s - w)
        torch.testing.assert_close(weight[:10], torch.full((10,), share, dtype=h.dtype), rtol=0.02, atol=0)
        torch.testing.assert_close(weight.sum(), torch.tensor(1.0, dtype=h.dtype))


@pytest.mark.parametrize("s", [70, 500])
def test_every_row_taken_is_the_exact_proposal(model, s):
    module, hidden, keys, values, kwargs = layer_inputs(model)  # n = 70 rows
    exact = MinVarianceProposal(harmonic=True)(module, hidden, keys, values, kwargs)
    sampled = SampledMinVarianceProposal(query_rows=s)(module, hidden, keys, values, kwargs)
    torch.testing.assert_close(sampled, exact, rtol=1e-6, atol=1e-9)
    windowed = MinVarianceProposal(harmonic=True, query_window=10)(module, hidden, keys, values, kwargs)
    sampled = SampledMinVarianceProposal(query_rows=10, query_window=10)(module, hidden, keys, values, kwargs)
    torch.testing.assert_close(sampled, windowed, rtol=1e-6, atol=1e-9)


def test_sampled_proposal_matches_the_eager_reference_on_its_rows(model):
    module, hidden, keys, values, kwargs = layer_inputs(model)
    proposal = SampledMinVarianceProposal(query_rows=9, chunk_size=4)
    pi = proposal(module, hidden, keys, values, kwargs)
    A = eager_attention(model)
    rows, w = proposal.sample_rows(A.shape[-1], module.layer_idx)
    assert len(rows) < A.shape[-1]
    mixed = torch.zeros_like(A)  # a "matrix" whose last row is the weighted mixture of the sampled rows
    mixed[:, -1] = torch.einsum("r,qrn->qn", w.float(), A[:, rows])
    torch.testing.assert_close(pi[0], reference(mixed, values, "last", True, proposal.floor), rtol=1e-5, atol=1e-7)


def test_same_row_seed_same_proposal_and_layers_draw_their_own_rows(model):
    module, hidden, keys, values, kwargs = layer_inputs(model)
    a = SampledMinVarianceProposal(query_rows=8, row_seed=3)
    b = SampledMinVarianceProposal(query_rows=8, row_seed=4)
    assert torch.equal(a(module, hidden, keys, values, kwargs), a(module, hidden, keys, values, kwargs))
    assert not torch.equal(a(module, hidden, keys, values, kwargs), b(module, hidden, keys, values, kwargs))
    assert not torch.equal(a.sample_rows(500, 0)[0], a.sample_rows(500, 1)[0])


def test_bad_row_count_is_refused():
    with pytest.raises(ValueError, match="query_rows must be >= 1"):
        SampledMinVarianceProposal(query_rows=0)


def test_bench_total_variation_is_zero_only_when_every_row_is_taken(model):
    from conftest import random_ids

    from experiments.sampled_rows import sampled_press, total_variation
    from evaluation.engine import Prefill
    from kvpress_prob.names.registry import get_press

    prefill = Prefill(model, random_ids(60))
    exact = get_press("prob_min_h", 0.5)
    all_rows = total_variation(prefill, exact, sampled_press(60, 0.5, 0))
    some_rows = total_variation(prefill, exact, sampled_press(8, 0.5, 0))
    assert all_rows.shape == some_rows.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads)
    assert float(all_rows.max()) < 1e-6 and float(some_rows.min()) > 1e-4 and float(some_rows.max()) <= 1


def test_paired_score_table_pairs_seed_means_on_shared_examples():
    import pandas as pd

    from experiments.sampled_rows import paired_scores

    rows = []
    for i in range(6):
        common = dict(example_id=f"e{i}", task="fwe", model="m", dataset="ruler", data_dir="1024")
        rows.append(common | dict(press="full", compression_ratio=0.0, seed=0, score=90.0))
        for seed in range(3):
            rows.append(common | dict(press="prob_min_h", compression_ratio=0.5, seed=seed, score=10.0 * i))
            if i < 5:  # e5 has no sampled record: left out of the pairing
                rows.append(common | dict(press="prob_min_h_s256", compression_ratio=0.5, seed=seed,
                                          score=10.0 * i + seed))  # seed mean: +1 on every example
    text = paired_scores(pd.DataFrame(rows))
    assert "5 examples (fwe 5)" in text
    assert "| 0.5 | 20.0 | 21.0 | +1.0 [+1.0, +1.0] | 0/5 |" in text
