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
