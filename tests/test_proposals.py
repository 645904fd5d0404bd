"""Proposals: valid distributions, and the attention proposals against the model's own eager attention weights."""


import pytest
import torch
from conftest import random_ids, random_norm_gains, tiny_model
from kvpress import KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress
from transformers import DynamicCache

from kvpress_prob.proposals.attention import H2OProposal, MinVarianceProposal
from kvpress_prob.proposals.base import ScoreProposal, normalise, scores_to_weights
from kvpress_prob.presses.h2o import EagerObservedAttentionPress


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


def eager_attention(model, n=70, layer=1):
    """The model's own attention weights (H_q, n, n) of ``layer`` on ``layer_inputs``'s ids: an eager
    forward with ``output_attentions=True``, independent of the code's query reconstruction (RoPE, q-norm)."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids=random_ids(n), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(implementation)
    return attentions[layer][0].float()


def with_random_norms(model):
    """Qwen3's q-norm and k-norm gains are random (conftest): a reconstruction that skips them fails."""
    return random_norm_gains(model)


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


ATTENTION_PROPOSALS = [
    (MinVarianceProposal(harmonic=False, chunk_size=7), "last", True, False),  # pi_min
    (MinVarianceProposal(harmonic=True, chunk_size=7), "harmonic", True, False),  # pi_min-h
    (MinVarianceProposal(harmonic=False, centred=True), "last", True, True),
    (H2OProposal(harmonic=False, chunk_size=16), "uniform", False, False),  # H2O
    (H2OProposal(harmonic=True, chunk_size=100), "harmonic", False, False),
]


def tova_reference(A, floor):
    """TOVA's scores as a proposal: the last row's attention over the earlier keys, averaged over the
    query heads (the last key gets the maximum + 1), shifted by its minimum, normalised, floor-mixed."""
    scores = torch.cat([A[:, -1, :-1].mean(0), A[:, -1, :-1].mean(0).max().view(1) + 1])
    w = scores - scores.min()
    return (1 - floor) * w / w.sum() + floor / w.shape[0]  # (n,): every KV head the same


def check_against_eager(model, layer, n, proposals):
    module, hidden, keys, values, kwargs = layer_inputs(model, n=n, layer=layer)
    A = eager_attention(model, n=n, layer=layer)
    torch.testing.assert_close(A.sum(-1), torch.ones(A.shape[:2]))  # rows of a softmax: a sanity check of A
    for proposal, rows, value_norm, centred in proposals:
        pi = proposal(module, hidden, keys, values, kwargs)[0]
        expected = reference(A, values, rows, value_norm, proposal.floor, centred)
        torch.testing.assert_close(pi, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{proposal}: {m}")
    tova = ScoreProposal(scorer=TOVAPress())
    pi = tova(module, hidden, keys, values, kwargs)[0]
    torch.testing.assert_close(pi, tova_reference(A, tova.floor).expand_as(pi), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_proposals_match_the_models_eager_attention(arch):
    """pi_min, pi_min-h, H2O and TOVA's scores against the attention weights the model itself returns
    (tiny Llama; tiny Qwen3 with random q-norm and k-norm gains)."""
    check_against_eager(with_random_norms(tiny_model(arch)), layer=1, n=70, proposals=ATTENTION_PROPOSALS)


def test_the_eager_reference_detects_a_wrong_query():
    """The comparison can fail: with the q-norm gains changed after the proposal, pi_min-h moves away."""
    model = with_random_norms(tiny_model("qwen3"))
    module, hidden, keys, values, kwargs = layer_inputs(model)
    pi = MinVarianceProposal(harmonic=True)(module, hidden, keys, values, kwargs)[0]
    with torch.no_grad():
        model.model.layers[1].self_attn.q_norm.weight.mul_(1.5)
    expected = reference(eager_attention(model), values, "harmonic", True, 0.01)
    assert not torch.allclose(pi, expected, rtol=1e-4, atol=1e-6)


def test_query_window_restricts_rows(model):
    module, hidden, keys, values, kwargs = layer_inputs(model)
    A = eager_attention(model)
    pi = MinVarianceProposal(harmonic=True, query_window=10)(module, hidden, keys, values, kwargs)
    n = A.shape[-1]
    h = 1.0 / (n - torch.arange(n - 10, n, dtype=torch.float32))
    mass = (h[None, :, None] * A[:, -10:]).sum(1)
    v = values[0].float().repeat_interleave(2, dim=0)
    mass = mass * v.norm(dim=-1)
    mass = mass / mass.sum(-1, keepdim=True)
    ref = 0.99 * mass.view(2, 2, n).mean(1) + 0.01 / n
    torch.testing.assert_close(pi[0], ref, rtol=1e-4, atol=1e-6)


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


@pytest.mark.parametrize("call", ["keyword", "positional", "embeds"])
def test_h2o_baseline_switches_to_eager_and_back(model, call):
    """Input ids by keyword, by position (``model.model(ids, ...)``, issue 25 item 5) or as embeddings;
    above ``max_eager_bytes`` the model's own implementation stays."""
    press = EagerObservedAttentionPress(compression_ratio=0.5)
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, k, o: seen.append(m.config._attn_implementation), with_kwargs=True
    )
    ids, cache = random_ids(40), DynamicCache()
    with torch.no_grad(), press(model):
        if call == "keyword":
            model.model(input_ids=ids, past_key_values=cache)
        elif call == "positional":
            model.model(ids, past_key_values=cache)
        else:
            model.model(inputs_embeds=model.model.embed_tokens(ids), past_key_values=cache)
    with torch.no_grad(), EagerObservedAttentionPress(compression_ratio=0.5, max_eager_bytes=0)(model):
        model.model(ids, past_key_values=DynamicCache())
    hook.remove()
    assert seen == ["eager", "sdpa"] and model.config._attn_implementation == "sdpa"
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
