"""SamplingDecodingPress and H2OPress state (issue 25 items 1, 3, 4): padding read in the stored bias's own
dtype, decoding state kept per cache, and what compounding means under a prefill temperature."""

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from kvpress import DecodingPress, PrefillDecodingPress
from transformers import DynamicCache

from kvpress_prob import SamplingPress
from kvpress_prob.correction import bias as correction
from kvpress_prob.decoding import rounds
from kvpress_prob.decoding.press import SamplingDecodingPress
from kvpress_prob.names.decoding import get_decoding_press
from kvpress_prob.decoding.scorers import H2OPress
from kvpress_prob.proposals.attention import MinVarianceProposal
from kvpress_prob.samplers.priority import PrioritySampler
from kvpress_prob.samplers.threshold import ThresholdSampler


# --- item 1: padding of a float16 / bfloat16 prefill bias ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_first_round_sees_the_prefill_kept_counts_plus_the_new_tokens(dtype, monkeypatch):
    """A threshold prefill keeps a different count per head and pads the rest with its bias dtype's lowest
    value (-65504 in float16). The first decoding round must count exactly the prefill's kept entries plus
    the tokens decoded since, per layer and head, in every dtype."""
    model = tiny_model("llama", dtype=dtype)
    ids = random_ids(64 + 8, seed=21)
    prefill = SamplingPress(proposal=MinVarianceProposal(), sampler=ThresholdSampler(), compression_ratio=0.5,
                            budget="head", seed=4)
    decoding = SamplingDecodingPress(target_size=12, compression_interval=8, hidden_states_buffer_size=8,
                                     n_sink=2, window=4, seed=0)
    seen = {}
    original = rounds.fixed_entries

    def spy(real, *args, **kwargs):
        seen.setdefault(len(seen), real.sum(-1)[0].tolist())  # layers run in order: call i is layer i
        return original(real, *args, **kwargs)

    monkeypatch.setattr(rounds, "fixed_entries", spy)
    cache = DynamicCache()
    with torch.no_grad(), PrefillDecodingPress(prefilling_press=prefill, decoding_press=decoding)(model):
        model(ids[:, :64], past_key_values=cache)
        kept = [list(row) for row in prefill.stats["kept"]]  # per layer, per KV head
        assert any(len(set(row)) > 1 for row in kept), kept  # padding exists: the test can catch its misreading
        for t in range(64, 72):
            model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))
    assert [seen[layer] for layer in range(3)] == [[c + 8 for c in row] for row in kept]


def test_extended_bias_reads_padding_in_every_dtype():
    stored = torch.tensor([[[0.5, -1.0, 0.0]]])
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        s = stored.to(dtype).clone()
        s[..., -1] = correction.padding(dtype)
        bias = rounds.extended_bias(s, (1, 1, 5), "cpu")
        assert rounds.is_real(bias)[0, 0].tolist() == [True, True, False, True, True], dtype
        assert bias[0, 0, :2].tolist() == [0.5, -1.0]


# --- item 3: state per cache ---------------------------------------------------------------------------------------

def decode(model, press, streams: dict, order: list[str], prefill: int, chunk: int = 1):
    """Prefill every stream's first ``prefill`` tokens into its own cache, then feed its next chunks in
    ``order`` (a stream name per forward), all inside one ``with press(model)``. Returns name -> cache."""
    caches = {name: DynamicCache() for name in streams}
    fed = {name: prefill for name in streams}
    with torch.no_grad(), press(model):
        for name, ids in streams.items():
            model(ids[:, :prefill], past_key_values=caches[name])
        for name in order:
            t = fed[name]
            model(streams[name][:, t:t + chunk], past_key_values=caches[name],
                  position_ids=torch.arange(t, t + chunk)[None])
            fed[name] = t + chunk
    return caches


def same_cache(a, b) -> bool:
    return all(x.keys.shape == y.keys.shape and torch.equal(x.keys, y.keys) for x, y in zip(a.layers, b.layers))


INTERLEAVINGS = {
    "one after the other": ["a"] * 24 + ["b"] * 24,
    "alternating": ["a", "b"] * 24,
    "irregular": ["b"] * 5 + ["a"] * 3 + ["b", "a"] * 9 + ["a"] * 12 + ["b"] * 10,
}


@pytest.mark.parametrize("name", ["decode_h2o_topk", "prob_decode_h2o_priority", "prob_decode_attn_priority",
                                  "prob_decode_min_variance_priority_floor20_layers"])
def test_two_caches_keep_in_any_interleaving_the_sets_each_keeps_alone(name):
    """Two caches decoded in one ``with press(model)``: the accumulated attention, buffered queries, step
    counts and round counts (which seed the draws) are each cache's own, so every interleaving keeps in each
    cache exactly the entries (keys) it keeps when decoded alone."""
    model = tiny_model("llama")
    streams = {"a": random_ids(40 + 24, seed=31), "b": random_ids(40 + 24, seed=32)}
    make = lambda: get_decoding_press(name, 20, 6, window=4, seed=3)  # noqa: E731
    alone = {s: decode(model, make(), {s: streams[s]}, [s] * 24, 40)[s] for s in streams}
    for label, order in INTERLEAVINGS.items():
        assert sorted(order) == ["a"] * 24 + ["b"] * 24
        together = decode(model, make(), streams, order, 40)
        for s in streams:
            assert together[s].layers[0].keys.shape[2] < 40 + 24  # rounds ran
            assert same_cache(together[s], alone[s]), (label, s)


def test_h2o_scorer_sums_are_per_cache():
    """kvpress's DecodingPress over H2OPress, a round after every forward of 8 tokens (the streaming
    benchmark's schedule: kvpress's own buffers are emptied by each round): two caches interleaved forward
    by forward keep the sets each keeps alone, because each carries its own accumulated sums."""
    model = tiny_model("llama")
    streams = {"a": random_ids(32 + 64, seed=33), "b": random_ids(32 + 64, seed=34)}
    make = lambda: DecodingPress(H2OPress(n_recent=4), compression_interval=1, target_size=24)  # noqa: E731
    alone = {s: decode(model, make(), {s: streams[s]}, [s] * 8, 32, chunk=8)[s] for s in streams}
    together = decode(model, make(), streams, ["a", "b"] * 8, 32, chunk=8)
    for s in streams:
        assert together[s].layers[0].keys.shape[2] == 24
        assert same_cache(together[s], alone[s]), s


# --- item 4: compounding under a prefill temperature, or without a correction ---------------------------------

def first_round_bias(prefill_kwargs: dict, decoding_kwargs: dict, monkeypatch):
    """Prefill 48 tokens under a SamplingPress (pi_min, priority, half kept per head), decode 6 under a
    SamplingDecodingPress (target 20, one round). Returns, for layer 0: the prefill's kept positions and
    log-weights log 1/q_prefill (H, 24) each, the round's raw draw (keep, log 1/q_1) over the 30 entries,
    and the bias the cache carries after the round (H, 20), read from the cache."""
    model = tiny_model("llama", layers=1)
    ids = random_ids(54, seed=41)
    prefill = SamplingPress(proposal=MinVarianceProposal(), sampler=PrioritySampler(), compression_ratio=0.5,
                            budget="head", seed=5, **prefill_kwargs)
    decoding = SamplingDecodingPress(target_size=20, compression_interval=6, hidden_states_buffer_size=6,
                                     n_sink=2, window=4, seed=6, **decoding_kwargs)
    draws, original = [], rounds.draw

    def spy(*args, **kwargs):
        draws.append(original(*args, **kwargs))
        return draws[-1]

    monkeypatch.setattr(rounds, "draw", spy)
    cache = DynamicCache()
    with torch.no_grad(), PrefillDecodingPress(prefilling_press=prefill, decoding_press=decoding)(model):
        model(ids[:, :48], past_key_values=cache)
        for t in range(48, 54):
            model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))
        bias = correction.bias_of(model.model.layers[0].self_attn, cache)
    assert len(draws) == 1
    keep0, lw0 = prefill.last_draw.keep[0, 0], prefill.last_draw.log_weight[0, 0].double()  # (H, 48)
    positions = [keep0[h].nonzero().squeeze(-1) for h in range(keep0.shape[0])]
    prefill_lw = torch.stack([lw0[h, p] for h, p in enumerate(positions)])  # (H, 24), in cache order
    return prefill_lw, draws[0][0][0], draws[0][1][0].double(), bias[0].double()


def expected(prefill_term: torch.Tensor, keep: torch.Tensor, log_weight: torch.Tensor, t_dec: float):
    """The bias after the round, per head: the kept entries' prefill term (0 for the 6 new tokens) plus
    log(1/q_1) / t_dec for the drawn ones (0 for sinks and window), in cache order."""
    out = []
    for h in range(keep.shape[0]):
        n = keep.shape[1]
        fixed = torch.zeros(n, dtype=torch.bool)
        fixed[:2], fixed[n - 4:] = True, True
        before = torch.cat([prefill_term[h], torch.zeros(6, dtype=torch.float64)])
        added = torch.where(fixed, 0.0, log_weight[h] / t_dec)
        kept = fixed | keep[h]
        out.append((before + added)[kept])
    return torch.stack(out)


@pytest.mark.parametrize("t_pre, t_dec", [(2.0, 1.0), (2.0, 2.0), (0.5, 1.0), (1.0, 1.0)])
def test_compounding_adds_each_stage_at_its_own_temperature(t_pre, t_dec, monkeypatch):
    """Compounding is stage by stage: bias = log(1/q_prefill) / T_prefill + log(1/q_1) / T_decoding + ...
    (docs/research/README.md). T_decoding = T_prefill gives the one tempered product (1/(q_prefill q_1))^(1/T);
    all at 1 the documented 1/(q_prefill q_1). Checked against the draws' own log-weights, never the cache's."""
    prefill_lw, keep, lw, bias = first_round_bias(dict(temperature=t_pre), dict(temperature=t_dec), monkeypatch)
    want = expected(prefill_lw / t_pre, keep, lw, t_dec)
    torch.testing.assert_close(bias, want, atol=1e-5, rtol=1e-5)
    assert (prefill_lw > 0.05).any() and (lw[keep] > 0.05).any()  # both stages carry weights that count
    if t_pre == t_dec:  # the single tempered product
        torch.testing.assert_close(bias, expected(prefill_lw, keep, lw, 1.0) / t_pre, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefill_correct, decoding_correct", [(False, True), (True, False)])
def test_compounding_without_a_correction_on_one_side(prefill_correct, decoding_correct, monkeypatch):
    """An uncorrected prefill leaves weight 1 (bias 0): the rounds' weights start from there. An uncorrected
    decoding press adds nothing: the prefill's tempered weights are carried with their keys."""
    prefill_lw, keep, lw, bias = first_round_bias(dict(temperature=2.0, correct=prefill_correct),
                                                  dict(correct=decoding_correct), monkeypatch)
    prefill_term = prefill_lw / 2.0 if prefill_correct else torch.zeros_like(prefill_lw)
    want = expected(prefill_term, keep, lw if decoding_correct else torch.zeros_like(lw), 1.0)
    torch.testing.assert_close(bias, want, atol=1e-5, rtol=1e-5)


def test_a_round_at_temperature_one_is_unbiased_for_the_cache_it_cuts():
    """Whatever bias the cache carries before a round (here a tempered prefill's, random), a round at
    temperature 1 keeps E[sum_kept e^(b_new) f] = sum_before e^(b_old) f (|z| < 4 over 20 000 caches); at
    temperature 2 the same round is biased low (z < -4): tempering trades bias for variance."""
    g = torch.Generator().manual_seed(7)
    n, trials = 40, 20000
    f = torch.rand(n, generator=g, dtype=torch.float64) * 2
    old = torch.randn(n, generator=g, dtype=torch.float64) / 2.0  # log w_prefill / T_prefill
    proposal = (f + 0.3) ** 0.5
    truth = float((old.exp() * f).sum())
    for temperature, unbiased in ((1.0, True), (2.0, False)):
        bias = old.float().expand(1, trials, n).clone()
        real = rounds.is_real(bias)
        fixed = rounds.fixed_entries(real, 2, 4)
        candidates = real & ~fixed
        pi = rounds.proposal_over(proposal.expand(1, trials, n), candidates, 0.0)
        k = torch.full((1, trials), 14)
        drawn, lw = rounds.draw(pi, candidates, k, PrioritySampler(), torch.Generator().manual_seed(8))
        lw = torch.where(fixed, 0.0, lw / temperature)
        keys = torch.arange(n, dtype=torch.float64).expand(1, trials, n)[..., None].clone()
        kept, _, new, _ = rounds.cut(keys, keys, bias, fixed | drawn, lw, correct=True)
        estimate = (new.double().exp() * f[kept[..., 0].long()]).sum(-1)[0]
        z = float((estimate.mean() - truth) / (estimate.std() / math.sqrt(trials)))
        assert (abs(z) < 4) if unbiased else (z < -4), (temperature, z)
