"""Span-aware units: words stay whole, the budget holds with the widening, priority sampling over
units stays unbiased, and SpanPress leaves no hook or token ids behind."""

import pytest
import torch
from kvpress import KeyDiffPress, TOVAPress
from transformers import DynamicCache

from evaluation.engine import Prefill
from kvpress_prob.proposals.base import ScoreProposal
from kvpress_prob.presses.spans import SpanPress
from kvpress_prob.samplers.spans import SpanSampler, greedy_fill, pack_units, word_starts
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


def slow_fill(order, starts, ends, capacity, widen):
    covered = set()
    for position, u in enumerate(order):
        span = set(range(max(0, starts[u] - widen), min(ends[-1], ends[u] + widen)))
        if len(covered | span) > capacity:
            return position, covered
        covered |= span
    return len(order), covered


def random_units(lengths):
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [0] + ends[:-1], ends


def test_greedy_fill_matches_a_slow_reference_and_keeps_what_it_charges():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        starts, ends = random_units(torch.randint(1, 9, (15,), generator=g).tolist())
        order = torch.randperm(15, generator=g).tolist()
        capacity = int(torch.randint(0, ends[-1], (1,), generator=g))
        widen = trial % 3
        taken, stop, covered = greedy_fill(order, starts, ends, capacity, widen)
        ref_stop, ref_covered = slow_fill(order, starts, ends, capacity, widen)
        assert stop == ref_stop and taken == order[:stop] and len(ref_covered) <= capacity
        assert {i for i, c in enumerate(covered) if c} == ref_covered


def draw(pi, units, inner, widen, ratio, seed):
    sampler = SpanSampler(inner=inner, widen=widen)
    sampler.units = units
    return sampler(pi, ratio, "head", torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("widen", [0, 1, 2, 3])
def test_topk_keeps_exactly_the_widened_best_units_that_fit(widen):
    """Against a brute-force fill over unequal units: units by their summed pi, best first, each
    widened span added while the union holds at most 20 tokens; the kept set is that union, so
    what is kept is exactly what is charged (widen >= 2 once charged tokens it never kept)."""
    n = 40
    lengths = [3, 5, 2, 6, 4, 1, 5, 3, 7, 4]  # unequal units, 40 tokens
    units = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts, ends = random_units(lengths)
    pi = torch.rand(2, 1, 3, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    pi /= pi.sum(-1, keepdim=True)
    result = draw(pi, units, "topk", widen, 0.5, 0)
    assert (result.log_weight[result.keep] == 0).all() and torch.isinf(result.log_weight[~result.keep]).all()
    for layer in range(2):
        for h in range(3):
            p = pi[layer, 0, h].tolist()
            mass = [sum(p[starts[u]:ends[u]]) for u in range(len(lengths))]
            best_first = sorted(range(len(lengths)), key=lambda u: -mass[u])
            _, covered = slow_fill(best_first, starts, ends, 20, widen)
            kept = set(result.keep[layer, 0, h].nonzero()[:, 0].tolist())
            assert kept == covered, (widen, layer, h)
            assert result.stats["kept_per_head"][layer][h] == len(covered) <= 20


def test_priority_over_unequal_units_is_unbiased_without_widening():
    """widen = 0, units of unequal sizes under a token budget: given the other units' priorities a
    unit is kept exactly when its own priority exceeds a threshold, which is then the stopping
    priority t, so E[w_i 1{i kept}] = 1 for every token. 20000 draws (the heads of one call); per
    token |z| < 4.5 against the Monte Carlo standard error (48 tokens: a false alarm below 1e-3)."""
    n, reps = 48, 20000
    lengths = [1, 4, 2, 7, 3, 3, 5, 1, 6, 2, 8, 6]
    units = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    g = torch.Generator().manual_seed(5)
    pi = torch.rand(n, generator=g, dtype=torch.float64) ** 2 + 0.01
    pi = (pi / pi.sum()).expand(1, 1, reps, n)
    result = draw(pi, units, "priority", 0, 0.5, 0)
    w = torch.where(result.keep, result.log_weight.double().exp(), 0.0)[0, 0]  # (reps, n)
    z = (w.mean(0) - 1) / (w.std(0) / reps ** 0.5).clamp_min(1e-12)
    assert z.abs().max() < 4.5, z
    assert (result.keep.sum(-1) <= 24).all()
    kept = result.keep[0, 0].double().mean(0)
    assert ((kept > 0.05) & (kept < 0.95)).sum() > 20  # most tokens are sampled, not kept surely


def test_priority_with_widening_or_a_unit_beyond_the_budget_is_refused():
    with pytest.raises(ValueError, match="widen must be 0 with inner='priority'"):
        SpanSampler(inner="priority", widen=1)
    units = torch.repeat_interleave(torch.arange(3), torch.tensor([2, 5, 3]))
    pi = torch.full((1, 1, 1, 10), 0.1, dtype=torch.float64)
    with pytest.raises(ValueError, match="a unit of 5 tokens exceeds the head's capacity of 4"):
        draw(pi, units, "priority", 0, 0.6, 0)


def span_press(ratio=0.5, inner="topk", tokenizer=None, proposal=None, seed=0):
    sampler = SpanSampler(inner=inner, widen=0 if inner == "priority" else 1)
    return SpanPress(proposal=proposal or ScoreProposal(scorer=KeyDiffPress()), sampler=sampler,
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
