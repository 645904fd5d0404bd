"""Proposals: valid distributions, and the chunked attention proposals against a dense reference."""

import math

import pytest
import torch
from conftest import random_ids
from kvpress import KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress
from transformers import DynamicCache

from kvpress_prob.proposals import H2OProposal, MinVarianceProposal, ScoreProposal, normalise, scores_to_weights
from kvpress_prob.registry import EagerObservedAttentionPress


def layer_inputs(model, n=70, layer=1):
    """(module, hidden_states, keys, values, kwargs) of one layer's prefill."""
    grabbed = {}

    def grab(module, args, kwargs, output):
        cache_layer = kwargs["past_key_values"].layers[module.layer_idx]
        grabbed["x"] = (module, kwargs["hidden_states"], cache_layer.keys, cache_layer.values, kwargs)

    hook = model.model.layers[layer].self_attn.register_forward_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model.model(input_ids=random_ids(n), past_key_values=DynamicCache())
    hook.remove()
    return grabbed["x"]


def dense_attention(module, hidden, keys, kwargs):
    """The full causal attention matrix (H_q, n, n), explicit softmax: the slow reference."""
    from kvpress_prob.proposals import rope_queries

    q = rope_queries(module, hidden, kwargs["position_embeddings"])[0].float()  # (H_q, n, d)
    g = q.shape[0] // keys.shape[1]
    k = keys[0].float().repeat_interleave(g, dim=0)  # (H_q, n, d)
    logits = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    n = logits.shape[-1]
    logits = logits.masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def reference(A, values, rows, value_norm, floor, centred=False):
    hq, n, _ = A.shape
    hkv = values.shape[1]
    g = hq // hkv
    if rows == "last":
        mass = A[:, -1]
    else:
        j = torch.arange(n, dtype=torch.float32)
        h = torch.ones(n) if rows == "uniform" else 1.0 / (n - j)
        mass = (h[None, :, None] * A).sum(1) / h.sum()
    v = values[0].float().repeat_interleave(g, dim=0)  # (H_q, n, d)
    if value_norm:
        if centred:
            o = (mass[:, :, None] * v).sum(1, keepdim=True)
            mass = mass * (v - o).norm(dim=-1)
        else:
            mass = mass * v.norm(dim=-1)
    mass = mass / mass.sum(-1, keepdim=True)
    pi = mass.view(hkv, g, n).mean(1)
    return (1 - floor) * pi + floor / n


@pytest.mark.parametrize(
    "proposal,rows,value_norm,centred",
    [
        (MinVarianceProposal(harmonic=False, chunk_size=7), "last", True, False),
        (MinVarianceProposal(harmonic=True, chunk_size=7), "harmonic", True, False),
        (MinVarianceProposal(harmonic=False, centred=True), "last", True, True),
        (H2OProposal(harmonic=False, chunk_size=16), "uniform", False, False),
        (H2OProposal(harmonic=True, chunk_size=100), "harmonic", False, False),
    ],
)
def test_attention_proposals_match_dense_reference(model, proposal, rows, value_norm, centred):
    module, hidden, keys, values, kwargs = layer_inputs(model)
    pi = proposal(module, hidden, keys, values, kwargs)
    A = dense_attention(module, hidden, keys, kwargs)
    torch.testing.assert_close(pi[0], reference(A, values, rows, value_norm, proposal.floor, centred), rtol=1e-5, atol=1e-7)


def test_query_window_restricts_rows(model):
    module, hidden, keys, values, kwargs = layer_inputs(model)
    A = dense_attention(module, hidden, keys, kwargs)
    pi = MinVarianceProposal(harmonic=True, query_window=10)(module, hidden, keys, values, kwargs)
    n = A.shape[-1]
    h = 1.0 / (n - torch.arange(n - 10, n, dtype=torch.float32))
    mass = (h[None, :, None] * A[:, -10:]).sum(1)
    v = values[0].float().repeat_interleave(2, dim=0)
    mass = mass * v.norm(dim=-1)
    mass = mass / mass.sum(-1, keepdim=True)
    ref = 0.99 * mass.view(2, 2, n).mean(1) + 0.01 / n
    torch.testing.assert_close(pi[0], ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "proposal",
    [
        ScoreProposal(scorer=StreamingLLMPress(compression_ratio=0.5)),
        ScoreProposal(scorer=SnapKVPress(window_size=8)),
        ScoreProposal(scorer=TOVAPress()),
        ScoreProposal(scorer=KnormPress()),
        H2OProposal(),
        MinVarianceProposal(harmonic=True, head_shared=True),
    ],
)
def test_every_proposal_is_a_strictly_positive_distribution(model, proposal):
    module, hidden, keys, values, kwargs = layer_inputs(model)
    pi = proposal(module, hidden, keys, values, kwargs)
    assert pi.shape == (1, model.config.num_key_value_heads, keys.shape[2])
    assert torch.isfinite(pi).all() and (pi >= proposal.floor / keys.shape[2] - 1e-9).all()
    torch.testing.assert_close(pi.sum(-1), torch.ones(1, pi.shape[1]))


def test_head_shared_is_the_mean_over_heads(model):
    module, hidden, keys, values, kwargs = layer_inputs(model)
    own = MinVarianceProposal(harmonic=True, floor=0.0)(module, hidden, keys, values, kwargs)
    shared = MinVarianceProposal(harmonic=True, floor=0.0, head_shared=True)(module, hidden, keys, values, kwargs)
    torch.testing.assert_close(shared, own.mean(1, keepdim=True).expand_as(own))


def test_score_map_keeps_order_and_floor():
    scores = torch.tensor([[[-3.0, -1.0, -2.0, -1.0]]])  # K-norm style, negative
    w = scores_to_weights(scores)
    torch.testing.assert_close(w, torch.tensor([[[0.0, 2.0, 1.0, 2.0]]]))
    constant = scores_to_weights(torch.full((1, 1, 5), 0.3))
    torch.testing.assert_close(constant, torch.ones(1, 1, 5))


def test_h2o_baseline_switches_to_eager_and_back(model):
    press = EagerObservedAttentionPress(compression_ratio=0.5)
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, k, o: seen.append(m.config._attn_implementation), with_kwargs=True
    )
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=random_ids(40), past_key_values=cache)
    hook.remove()
    assert seen == ["eager"] and model.config._attn_implementation == "sdpa"
    assert cache.layers[0].keys.shape[2] == 20


@pytest.mark.parametrize(
    "scores,match",
    [
        (torch.tensor([[[1.0, float("nan"), 2.0]]]), "finite"),
        (torch.tensor([[[1.0, float("inf"), 2.0]]]), "finite"),
        (torch.zeros(1, 1, 3), "all zero"),
    ],
)
def test_bad_scores_are_refused(scores, match):
    with pytest.raises(ValueError, match=match):
        scores_to_weights(scores)


def test_negative_weights_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        normalise(torch.tensor([[0.5, -0.1, 0.6]]))


def test_floor_range():
    with pytest.raises(ValueError, match="floor"):
        MinVarianceProposal(floor=1.0)
