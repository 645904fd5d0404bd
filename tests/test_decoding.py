"""SamplingDecodingPress: compounded weights, a dense reference of decoding, kvpress's top-k, the pipeline."""

import gc
import math

import pytest
import torch
from conftest import TIE, boundary_gap, random_ids, tiny_model
from kvpress import DecodingPress, KnormPress, KVPressTextGenerationPipeline, PrefillDecodingPress, TOVAPress
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob import SamplingPress, get_press
from kvpress_prob.correction import bias as correction
from kvpress_prob.decoding import rounds
from kvpress_prob.names.decoding import DECODING_PRESSES, get_decoding_press
from kvpress_prob.decoding.press import SamplingDecodingPress
from kvpress_prob.proposals.attention import MinVarianceProposal
from kvpress_prob.samplers import TopKSampler
from kvpress_prob.samplers.priority import PrioritySampler
from kvpress_prob.samplers.stratified import StratifiedSampler
from kvpress_prob.samplers.threshold import ThresholdSampler


# --- compounding: Monte Carlo over the functional rounds -------------------------------------------------------

def chain(sampler, n_rounds: int, trials: int, compound: bool, seed: int = 0):
    """``trials`` independent caches (rows) under fixed attention: 40 entries, then ``n_rounds`` rounds
    (cut to 20, sinks 2 and window 4 exact, the rest drawn from a fixed proposal), 10 new entries
    appended after each but the last. Returns (estimates of the prefix sum (trials,), the true sum).
    compound=False drops the compounding: each round's bias restarts from 0."""
    g = torch.Generator().manual_seed(123)
    total = 40 + 10 * (n_rounds - 1)
    f = torch.rand(total, generator=g, dtype=torch.float64) * torch.rand(total, generator=g, dtype=torch.float64).exp()
    proposal = (f + 0.3) ** 0.5  # fixed, not proportional to f: weights matter
    generator = torch.Generator().manual_seed(seed)
    index = torch.arange(40, dtype=torch.float64).expand(1, trials, 40)[..., None]  # (1, R, n, 1): the entry ids
    keys, values = index.clone(), index.clone()
    bias = torch.zeros(1, trials, 40)
    for r in range(n_rounds):
        real = rounds.is_real(bias)
        fixed = rounds.fixed_entries(real, 2, 4)
        candidates = real & ~fixed
        ids = keys[..., 0].long()
        pi = rounds.proposal_over(proposal[ids], candidates, 0.0)
        k = torch.minimum(20 - fixed.sum(-1), candidates.sum(-1))
        drawn, log_weight = rounds.draw(pi, candidates, k, sampler, generator)
        keep = fixed | drawn
        log_weight = torch.where(fixed, 0.0, log_weight)
        keys, values, bias, _ = rounds.cut(keys, values, bias if compound else torch.where(real, 0.0, bias),
                                           keep, log_weight, correct=True)
        if r < n_rounds - 1:
            new = torch.arange(40 + 10 * r, 50 + 10 * r, dtype=torch.float64).expand(1, trials, 10)[..., None]
            keys, values = torch.cat([keys, new], 2), torch.cat([values, new], 2)
            bias = torch.cat([bias, torch.zeros(1, trials, 10)], -1)
    ids = keys[..., 0].long()
    estimate = (bias.double().exp() * f[ids]).sum(-1)[0]  # sum_kept w_i f_i; exp(LOWEST) = 0 on padding
    return estimate, float(f.sum())


SAMPLERS = [PrioritySampler(), ThresholdSampler(), StratifiedSampler(alpha=0.5)]


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("n_rounds", [2, 3])
def test_compounded_weights_give_an_unbiased_prefix_sum(sampler, n_rounds):
    """E[sum_kept w_i f_i] = sum_i f_i over 2 and 3 rounds; |z| < 4 (a fixed seed; a 4-sigma band has a
    false-failure probability of 6e-5). Dropping the compounding is rejected by the same test (|z| > 4)."""
    trials = 20000
    estimate, truth = chain(sampler, n_rounds, trials, compound=True)
    z = (estimate.mean() - truth) / (estimate.std() / math.sqrt(trials))
    assert abs(z) < 4, (float(estimate.mean()), truth, float(z))
    dropped, _ = chain(sampler, n_rounds, trials, compound=False)
    z_dropped = (dropped.mean() - truth) / (dropped.std() / math.sqrt(trials))
    assert z_dropped < -4, float(z_dropped)  # the older entries lose the weights of earlier rounds


def test_priority_fast_path_draws_what_the_sampler_draws():
    """``draw`` calls priority sampling directly for a plain PrioritySampler (no solve for k): the same kept
    sets and weights as the sampler itself (a subclass, which takes the sampler's own path)."""

    class Slow(PrioritySampler):
        pass

    g = torch.Generator().manual_seed(0)
    pi = rounds.proposal_over(torch.rand(1, 6, 50, generator=g, dtype=torch.float64), torch.ones(1, 6, 50, dtype=torch.bool), 0.01)
    candidates = torch.rand(1, 6, 50, generator=g) < 0.8
    k = torch.minimum(torch.tensor([[10, 20, 5, 30, 39, 0]]), candidates.sum(-1))
    fast = rounds.draw(pi, candidates, k, PrioritySampler(), torch.Generator().manual_seed(4))
    slow = rounds.draw(pi, candidates, k, Slow(), torch.Generator().manual_seed(4))
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    assert torch.equal(fast[0].sum(-1), k)


# --- a dense slow-loop reference of decoding ---------------------------------------------------------------------

def reference_attention(state):
    """An attention function: dense causal softmax at prefill; at a decoding step, for every query head
    an explicit weighted softmax over the (position, weight) list its KV head holds in ``state``."""

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, hq, q_len, d = query.shape
        hkv = key.shape[1]
        scale = scaling if scaling is not None else d ** -0.5
        out = torch.zeros(b, q_len, hq, d)
        for h in range(hq):
            kv = h // (hq // hkv)
            for t in range(q_len):
                if q_len > 1:  # prefill: every earlier position, weight 1
                    entries = [(p, 1.0) for p in range(t + 1)]
                else:
                    entries = state[module.layer_idx][kv] + [(key.shape[2] - 1, 1.0)]
                positions = torch.tensor([p for p, _ in entries])
                w = torch.tensor([w for _, w in entries], dtype=torch.float64)
                logits = (key[0, kv, positions].double() @ query[0, h, t].double()) * scale
                a = w * torch.exp(logits - logits.max())
                out[0, t, h] = ((a[:, None] * value[0, kv, positions].double()).sum(0) / a.sum()).float()
        return out, None

    return attend


def test_dense_reference_of_decoding_with_a_prefill_draw_and_two_decoding_draws(monkeypatch):
    """Prefill under a SamplingPress (pi_min, priority, half kept), then decoding under the press (target
    20, a round every 6 steps: two rounds in 16 steps). The reference recomputes every decoding step on
    a full cache with an explicit weighted softmax, each kept entry weighing the product of its inclusion
    weights, 1/(q_prefill q_1 q_2), multiplied here from the draws alone, never from the cache's bias."""
    model = tiny_model("llama")
    ids = random_ids(64, seed=3)
    prefill = SamplingPress(proposal=MinVarianceProposal(), sampler=PrioritySampler(), compression_ratio=0.5,
                            budget="head", seed=1)
    decoding = SamplingDecodingPress(target_size=20, compression_interval=6, hidden_states_buffer_size=6,
                                     n_sink=2, window=4, seed=2)
    draws = []
    original = rounds.draw

    def spy(*args, **kwargs):
        keep, log_weight = original(*args, **kwargs)
        draws.append((keep.clone(), log_weight.clone()))
        return keep, log_weight

    monkeypatch.setattr(rounds, "draw", spy)
    cache, logits = DynamicCache(), []
    with torch.no_grad(), PrefillDecodingPress(prefilling_press=prefill, decoding_press=decoding)(model):
        model(ids[:, :48], past_key_values=cache)
        for t in range(48, 64):
            logits.append(model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]])).logits[0, -1])
    assert len(draws) == 2 * 3  # two rounds x three layers
    n_layers, heads = 3, 2
    keep0, lw0 = prefill.last_draw.keep[:, 0], prefill.last_draw.log_weight[:, 0]  # (L, H, 48)
    state = {l: [[(p, math.exp(float(lw0[l, h, p]))) for p in range(48) if keep0[l, h, p]] for h in range(heads)]
             for l in range(n_layers)}
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", reference_attention(state))
    reference, cache, done = [], DynamicCache(), 0
    with torch.no_grad():
        model(ids[:, :48], past_key_values=cache)
        for step, t in enumerate(range(48, 64), start=1):
            reference.append(model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]])).logits[0, -1])
            for l in range(n_layers):
                for h in range(heads):
                    state[l][h].append((t, 1.0))
            if step % 6 == 0:  # a round after this step's forward, in every layer
                for l in range(n_layers):
                    keep, log_weight = draws[done + l]
                    for h in range(heads):
                        entries = state[l][h]
                        n = len(entries)
                        fixed = [i < 2 or i >= n - 4 for i in range(n)]
                        state[l][h] = [(p, w * (1.0 if fixed[i] else math.exp(float(log_weight[0, h, i]))))
                                       for i, (p, w) in enumerate(entries) if fixed[i] or keep[0, h, i]]
                        assert len(state[l][h]) == 20
                done += n_layers
    for step, (ours, ref) in enumerate(zip(logits, reference)):
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=f"decoding step {step}")
    # the compounding mattered: the prefill entries still in the cache carry weights far from 1
    heaviest = max(w for l in state for h in state[l] for _, w in h)
    assert heaviest > 2.0


# --- kvpress's top-k, positional order, seeds ---------------------------------------------------------------------

def stream(model, press, ids, prefill: int, every: int):
    """Prefill ``prefill`` tokens, then feed the rest one at a time (at their true positions, as kvpress's
    pipeline and generate do: the compressed cache's length is not the position) under ``press``; after every
    ``every`` steps, the layers' keys (b, H_kv, S, d)."""
    cache, snapshots = DynamicCache(), []
    with torch.no_grad(), press(model):
        model(ids[:, :prefill], past_key_values=cache)
        for step, t in enumerate(range(prefill, ids.shape[1]), start=1):
            model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))
            if step % every == 0:
                snapshots.append([layer.keys.clone() for layer in cache.layers])
    return snapshots, cache


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the rows of a and b (S, d) are the same set, up to order and float error."""
    if a.shape != b.shape:
        return False
    a, b = a.double(), b.double()
    distance = torch.cdist(a, b)
    return bool((distance.min(dim=1).values < 1e-3).all() and (distance.min(dim=0).values < 1e-3).all())


def recording(scorer: type, log: list):
    """A ``scorer`` whose every call of ``score`` appends its scores (b, H_kv, n), in float64, to ``log``."""

    class Recording(scorer):
        def score(self, *args, **kwargs):
            scores = super().score(*args, **kwargs)
            log.append(scores.detach().double().clone())
            return scores

    return Recording()


@pytest.mark.parametrize("scorer, seed", [(KnormPress, 21), (TOVAPress, 12)], ids=["knorm", "tova"])
def test_topk_over_an_order_invariant_scorer_keeps_kvpress_decoding_press_sets(scorer, seed):
    """With no sinks or window and a top-k design, every round keeps exactly the set kvpress's own
    DecodingPress keeps (compared entry by entry, round after round), in positional order.

    kvpress gathers the kept entries unsorted, which changes later summation orders, so the sets are
    compared only where both scorers' k-th and (k+1)-th scores differ by more than float error
    (conftest.TIE, 1e-5; the two presses' scores of one round differ by at most 2e-7 of their size here);
    a head with a tie is reported, not compared, and the rounds after it are not compared (the two caches
    then legitimately differ). The tiny Qwen3 has random k-norm gains (conftest), so its scores
    carry signal, and the prompts are chosen so that every boundary gap is at least 1.1e-4 (10 x TIE):
    every round is compared, on any machine."""
    model = tiny_model("qwen3")
    ids = random_ids(40 + 48, seed=seed)
    mine_scores, their_scores = [], []
    ours = SamplingDecodingPress(base_press=recording(scorer, mine_scores), proposal="scorer", sampler=TopKSampler(),
                                 target_size=24, compression_interval=8, hidden_states_buffer_size=8, n_sink=0,
                                 window=0)
    theirs = DecodingPress(base_press=recording(scorer, their_scores), compression_interval=8, target_size=24,
                           hidden_states_buffer_size=8)
    a, _ = stream(model, ours, ids, 40, 8)
    b, _ = stream(model, theirs, ids, 40, 8)
    assert len(a) == len(b) == 6
    layers = len(a[0])
    assert len(mine_scores) == len(their_scores) == 6 * layers  # one score per round and layer
    ties, compared = [], 0
    for r, (mine, kv) in enumerate(zip(a, b)):
        for layer, (x, y) in enumerate(zip(mine, kv)):
            assert x.shape[2] == y.shape[2] == 24
            s, t = mine_scores[r * layers + layer], their_scores[r * layers + layer]
            gap = torch.minimum(boundary_gap(s, 24), boundary_gap(t, 24))[0]
            scale = s.abs().amax(-1)
            assert ((s.sort(-1).values - t.sort(-1).values).abs().amax(-1) < TIE / 10 * scale).all(), (r, layer)
            for h in range(x.shape[1]):
                if gap[h] < TIE:
                    ties.append((r, layer, h, float(gap[h])))
                    continue
                assert same_rows(x[0, h], y[0, h]), (r, layer, h, float(gap[h]))
                compared += 1
        if ties:  # the caches may differ from here on
            break
    assert not ties and compared == 6 * layers * 2, f"ties (round, layer, head, relative gap): {ties}"


def layer0_positions(model, ids, keys: torch.Tensor) -> list[list[int]]:
    """Positions of layer 0's cached keys (b, H_kv, S, d): layer 0's keys depend only on the token and
    its position, so they are matched against a full cache's."""
    full = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=full)
    reference = full.layers[0].keys[0].double()  # (H_kv, n, d)
    return [torch.cdist(keys[0, h].double(), reference[h]).argmin(-1).tolist() for h in range(keys.shape[1])]


def test_streaming_llm_keeps_its_sinks_and_positional_order():
    """8 chunks of 32 at a target of 128: the sink-and-window top-k keeps positions 0-3 and the cache stays
    sorted. (kvpress's DecodingPress(StreamingLLMPress) loses them: docs/research/README.md.)"""
    model = tiny_model("llama", layers=1)
    ids = random_ids(128 + 256, seed=7)
    press = get_decoding_press("decode_streaming_llm", 128, 32)
    snapshots, _ = stream(model, press, ids, 128, 32)
    positions = layer0_positions(model, ids, snapshots[-1][0])
    for head in positions:
        assert head[:4] == [0, 1, 2, 3]
        assert head == sorted(head) and len(head) == 128
        assert head[-(128 - 4):] == list(range(384 - 124, 384))


@pytest.mark.parametrize("name", ["prob_decode_attn_priority", "prob_decode_attn_threshold",
                                  "prob_decode_h2o_priority"])
def test_same_seed_same_kept_sets(name):
    model = tiny_model("llama")
    ids = random_ids(100, seed=9)
    runs = [stream(model, get_decoding_press(name, 24, 8, window=4, seed=seed), ids, 40, 8)[0] for seed in (0, 0, 1)]
    assert all(torch.equal(x, y) for x, y in zip(runs[0][-1], runs[1][-1]))
    assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(runs[0][-1], runs[2][-1]))


def test_no_hook_or_state_left_after_the_press():
    model = tiny_model("llama")
    ids = random_ids(80, seed=11)
    modules = [layer.self_attn for layer in model.model.layers]
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]
    with torch.no_grad():
        before = model(ids).logits
    press = get_decoding_press("prob_decode_h2o_priority", 24, 8, window=4)
    _, cache = stream(model, press, ids, 40, 8)
    assert correction.bias_of(modules[0], cache) is not None  # the correction belongs to its cache
    assert not press.hidden_states_buffer and not press._queries and not press._accumulated and not press._rounds
    del cache
    gc.collect()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules] == hooks
    assert not any(m in correction._STATES for m in modules)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)


# --- bad input -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(target_size=36, n_sink=4, window=32), "target_size must be > n_sink \\+ window \\+ protect_values = 36"),
    (dict(target_size=40, protect_values=8), "target_size must be > .* = 44"),
    (dict(compression_interval=0), "compression_interval must be an integer >= 1"),
    (dict(compression_interval=-3), "compression_interval must be an integer >= 1"),
    (dict(target_size=0), "target_size must be an integer >= 1"),
    (dict(window=-1), "window must be an integer >= 0"),
    (dict(proposal="nope"), "proposal must be one of"),
    (dict(floor=1.0), "floor must be in \\[0, 1\\)"),
    (dict(base_press=KnormPress()), "base_press is the scorer of proposal='scorer'"),
])
def test_bad_parameters_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingDecodingPress(**kwargs)


def test_bad_types_name_themselves():
    with pytest.raises(TypeError, match="proposal='scorer' needs a kvpress ScorerPress as base_press"):
        SamplingDecodingPress(proposal="scorer")
    with pytest.raises(TypeError, match="sampler must be a kvpress_prob Sampler"):
        SamplingDecodingPress(sampler="priority")
    with pytest.raises(KeyError, match="unknown decoding press 'nope'"):
        get_decoding_press("nope", 64, 8)


def test_a_budget_larger_than_the_context():
    """The round refuses to draw more entries than a head holds; the press, at a round whose layer holds at
    most target_size entries, leaves it, warns and counts it (kvpress's DecodingPress skips silently)."""
    pi = torch.full((1, 2, 10), 0.1, dtype=torch.float64)
    candidates = torch.ones(1, 2, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="k \\(entries drawn per head\\) must be in \\[0, the head's candidates m\\]"):
        rounds.draw(pi, candidates, torch.tensor([[4, 11]]), PrioritySampler(), torch.Generator())
    model = tiny_model("llama", layers=1)
    press = get_decoding_press("prob_decode_attn_priority", 64, 8, window=4)
    snapshots, _ = stream(model, press, random_ids(56), 40, 8)
    assert press.stats["skipped"] == 2 and press.stats["rounds"] == 0
    assert snapshots[-1][0].shape[2] == 56


# --- kvpress's pipeline and model.generate -------------------------------------------------------------------------

def test_runs_in_the_pipeline_and_generate_alone_and_behind_a_prefill_press(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context = " ".join(f"word{i}" for i in range(60))
    presses = [get_decoding_press(name, 24, 4, window=4) for name in ("prob_decode_attn_priority",
                                                                       "decode_knorm_topk")]
    presses.append(PrefillDecodingPress(
        prefilling_press=SamplingPress(proposal=MinVarianceProposal(), compression_ratio=0.5),
        decoding_press=get_decoding_press("prob_decode_min_variance_priority", 24, 4, window=4)))
    for prefill in ("snapkv", "keydiff_sum4"):  # a kvpress press; a summary press (virtual entries with weights)
        presses.append(PrefillDecodingPress(prefilling_press=get_press(prefill, 0.5),
                                            decoding_press=get_decoding_press("prob_decode_attn_priority", 24, 4, window=4)))
    ids = tokenizer(context, return_tensors="pt").input_ids
    for press in presses:
        pipe(context, question="What is word7?", press=press, max_new_tokens=12)
        decoding = getattr(press, "decoding_press", press)
        assert decoding.stats["rounds"] > 0
        with torch.no_grad(), press(model):
            out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 return_dict_in_generate=True)
        assert out.sequences.shape[1] == ids.shape[1] + 12
        assert max(layer.keys.shape[2] for layer in out.past_key_values.layers) <= 24 + 4


def test_registry_names_build_presses():
    for name, factory in DECODING_PRESSES.items():
        press = factory(64, 16)
        assert isinstance(press, SamplingDecodingPress), name
        assert press.hidden_states_buffer_size == 16
        assert press.correct == (not name.endswith("_nocorr")), name


def test_value_protection_keeps_the_largest_value_ranges_exactly():
    """VaSE's option: per head, the ``protect_values`` non-sink, non-window entries whose values have the
    largest max - min are kept exactly; padding is never protected."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1, 2, 30, 8, generator=g)
    values[0, 0, 10] *= 50
    values[0, 1, 17] *= 50
    values[0, 1, 25] *= 80  # inside the window: kept anyway, not one of the protected
    real = torch.ones(1, 2, 30, dtype=torch.bool)
    real[0, 0, 20:22] = False  # padding
    values[0, 0, 21] *= 100
    fixed = rounds.fixed_entries(real, 2, 6, values, protect_values=1)
    assert fixed[0, 0].nonzero().squeeze(-1).tolist() == [0, 1, 10, 24, 25, 26, 27, 28, 29]
    assert fixed[0, 1].nonzero().squeeze(-1).tolist() == [0, 1, 17, 24, 25, 26, 27, 28, 29]


def test_uncorrected_twin_keeps_the_same_entries_in_a_round():
    """correct=False changes only the weights: on the same cache the first round keeps the same entries
    (later rounds see caches that the two corrections made different, so their proposals differ)."""
    model = tiny_model("llama")
    ids = random_ids(48, seed=13)
    kept = []
    for name in ("prob_decode_attn_priority", "prob_decode_attn_priority_nocorr"):
        snapshots, cache = stream(model, get_decoding_press(name, 24, 8, window=4, seed=3), ids, 40, 8)
        kept.append((snapshots[0], correction.bias_of(model.model.layers[0].self_attn, cache)))
    assert all(torch.equal(x, y) for x, y in zip(kept[0][0], kept[1][0]))
    assert kept[0][1] is not None and bool((kept[0][1] != 0).any()) and kept[1][1] is None
