"""SamplingDecodingPress and H2OPress state (issue 25 items 1, 3, 4): padding read in the stored bias's own
dtype, decoding state kept per cache, and what compounding means under a prefill temperature."""

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from kvpress import DecodingPress, PrefillDecodingPress
from transformers import DynamicCache

from kvpress_prob import SamplingPress, correction
from kvpress_prob import decode_round as rounds
from kvpress_prob.decoding import SamplingDecodingPress, get_decoding_press
from kvpress_prob.decoding_scorers import H2OPress
from kvpress_prob.proposals import MinVarianceProposal
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


@pytest.mark.parametrize("name", ["decode_h2o_topk", "prob_decode_h2o_priority", "prob_decode_attn_priority"])
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
