"""Span-aware units: words stay whole, the budget holds with the widening, priority sampling over
units stays unbiased, and SpanPress leaves no hook or token ids behind."""

import pytest
import torch
from kvpress import KeyDiffPress, TOVAPress
from transformers import DynamicCache

from evaluation.engine import Prefill
from kvpress_prob.proposals import ScoreProposal
from kvpress_prob.spans import SpanPress, SpanSampler, fixed_units, greedy_fill, pack_units, word_starts
from tests.conftest import random_ids, tiny_model


def test_units_keep_numbers_and_words_whole(tokenizer):
    text = "The special magic number is: 8436384. Remember it, unbelievably well"
    ids = tokenizer.encode(text)
    units = pack_units(word_starts(tokenizer, ids), size=8)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    digits = [i for i, t in enumerate(tokens) if t.isdigit()]
    assert len(digits) == 7 and len(set(units[digits].tolist())) == 1  # the number is one unit
    assert units.bincount().max() <= 8 and torch.all(units.diff() >= 0) and torch.all(units.diff() <= 1)
    word = [i for i, t in enumerate(tokens) if t in ("Ġunbelie", "vably", "Ġunbelievably")]
    assert len(set(units[word].tolist())) == 1


def test_a_word_longer_than_size_is_cut():
    assert pack_units([True, False, False, False, False, True], size=2).tolist() == [0, 0, 1, 1, 2, 2]


def slow_fill(order, starts, ends, budget, widen):
    covered = set()
    for position, u in enumerate(order):
        span = set(range(max(0, starts[u] - widen), min(ends[-1], ends[u] + widen)))
        if len(covered | span) > budget:
            return position, covered
        covered |= span
    return len(order), covered


def test_greedy_fill_matches_a_slow_reference_and_respects_the_budget():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        lengths = torch.randint(1, 9, (15,), generator=g).tolist()
        ends = torch.tensor(lengths).cumsum(0).tolist()
        starts = [0] + ends[:-1]
        order = torch.randperm(15, generator=g).tolist()
        budget = int(torch.randint(0, ends[-1], (1,), generator=g))
        taken, stop = greedy_fill(order, starts, ends, budget, widen=trial % 2)
        ref_stop, ref_covered = slow_fill(order, starts, ends, budget, trial % 2)
        assert stop == ref_stop and taken == order[:stop] and len(ref_covered) <= budget


def draw(pi, units, inner, widen, ratio, seed):
    sampler = SpanSampler(inner=inner, widen=widen)
    sampler.units = units
    return sampler(pi, ratio, "head", torch.Generator().manual_seed(seed))


def test_topk_keeps_the_widened_best_units_within_budget():
    n = 40
    units = fixed_units(n, 5)
    pi = torch.rand(2, 1, 3, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    pi /= pi.sum(-1, keepdim=True)
    result = draw(pi, units, "topk", 1, 0.5, 0)
    assert (result.keep.sum(-1) <= 20).all() and (result.log_weight[result.keep] == 0).all()
    unit_pi = pi.view(2, 1, 3, 8, 5).sum(-1)
    best = unit_pi[0, 0, 0].argmax()
    lo, hi = max(0, 5 * best - 1), min(n, 5 * best + 6)
    assert result.keep[0, 0, 0, lo:hi].all()  # the best unit and one token each side


def test_priority_over_units_is_unbiased_without_widening():
    """Equal units, no widening: exactly priority sampling of units (Duffield et al. 2007), whose
    weighted sums are unbiased; tolerance: 5 standard errors over 3000 draws."""
    n, size = 24, 4
    units = fixed_units(n, size)
    g = torch.Generator().manual_seed(5)
    pi = torch.rand(1, 1, 1, n, generator=g, dtype=torch.float64) + 0.05
    pi /= pi.sum()
    x = torch.randn(n, generator=g, dtype=torch.float64)
    estimates = []
    for seed in range(3000):
        result = draw(pi, units, "priority", 0, 0.5, seed)
        w = torch.exp(result.log_weight[0, 0, 0].double())
        estimates.append(float((w * x).sum()))
    estimates = torch.tensor(estimates)
    se = estimates.std() / len(estimates) ** 0.5
    assert abs(float(estimates.mean() - x.sum())) < 5 * se


def span_press(ratio=0.5, inner="topk", tokenizer=None, proposal=None, seed=0):
    return SpanPress(proposal=proposal or ScoreProposal(scorer=KeyDiffPress()), sampler=SpanSampler(inner=inner),
                     compression_ratio=ratio, budget="head", tokenizer=tokenizer, seed=seed)


@torch.no_grad()
def test_span_press_leaves_no_state_and_replay_equals_a_real_prefill(tokenizer):
    model = tiny_model("llama")
    ids = random_ids(80, seed=2)
    press = span_press(0.5, "priority", tokenizer, ScoreProposal(scorer=TOVAPress()), seed=4)
    embedding = model.get_input_embeddings()
    cache = DynamicCache()
    with press(model):
        assert len(embedding._forward_pre_hooks) == 1
        model.model(input_ids=ids, past_key_values=cache)
    assert len(embedding._forward_pre_hooks) == 0 and press._ids is None
    real = press.last_draw.keep.clone()
    assert (real.sum(-1) <= 40).all() and (real.sum(-1) >= 30).all()
    replayed = span_press(0.5, "priority", tokenizer, ScoreProposal(scorer=TOVAPress()), seed=4)
    Prefill(model, ids).compress(replayed)
    assert torch.equal(replayed.last_draw.keep, real) and replayed._ids is None


def test_span_press_without_token_ids_raises_a_clear_error(tokenizer):
    model = tiny_model("llama")
    prefill = Prefill(model, random_ids(40))
    press = span_press(0.5, "topk", tokenizer)
    press.post_init_from_model(model)
    with pytest.raises(RuntimeError, match="token ids"):
        press.evict(prefill.compress(None), prefill.proposals_of(press))


def test_span_press_refuses_a_non_head_budget_and_a_wrong_sampler():
    with pytest.raises(ValueError, match="budget"):
        SpanPress(proposal=ScoreProposal(scorer=KeyDiffPress()), sampler=SpanSampler(), budget="global")
    with pytest.raises(TypeError, match="SpanSampler"):
        from kvpress_prob.samplers import TopKSampler

        SpanPress(proposal=ScoreProposal(scorer=KeyDiffPress()), sampler=TopKSampler(), budget="head")
    with pytest.raises(ValueError, match="widen"):
        SpanSampler(widen=-1)


def test_span_press_without_a_tokenizer_to_load_names_the_parameter():
    model = tiny_model("llama")
    model.config._name_or_path = ""  # built from a config: no name_or_path to load a tokenizer from
    with pytest.raises(ValueError, match="tokenizer="):
        span_press(0.5, "topk").post_init_from_model(model)
