"""Calibrated proposals: the entropy-matched temperature hits its target, the rank map keeps the
order, and on a real prefill the calibrated pi has the entropy of the window queries' attention."""

import math

import pytest
import torch
from kvpress import KeyDiffPress

from kvpress_prob.proposals.calibrated import (
    CalibratedProposal,
    entropy,
    match_temperature,
    rank_weights,
    standardise,
    window_entropy,
)
from kvpress_prob.proposals.attention import rope_queries
from kvpress_prob.proposals.base import scores_to_weights
from tests.conftest import random_ids, tiny_model


def test_match_temperature_reaches_the_target_entropy():
    g = torch.Generator().manual_seed(0)
    z = standardise(torch.randn(3, 4, 200, generator=g))
    target = torch.tensor([0.5, 2.0, 4.0, math.log(200) - 0.01]).expand(3, 4)
    t = match_temperature(z, target)
    got = entropy(torch.softmax(z / t[..., None], -1))
    assert torch.allclose(got, target.double(), atol=1e-6)


def test_rank_weights_are_one_over_rank_in_the_scores_order():
    scores = torch.tensor([[0.3, -1.0, 2.0, 0.31]])
    assert torch.equal(rank_weights(scores), torch.tensor([[1 / 3, 1 / 4, 1.0, 1 / 2]], dtype=torch.float64))


def test_flat_scores_give_a_near_uniform_shift_proposal_but_not_a_calibrated_one():
    """Scores in a narrow band far from their minimum (KeyDiff-like): shift-and-normalise is near
    uniform; the entropy-matched softmax reaches a low target entropy whatever the band."""
    g = torch.Generator().manual_seed(1)
    scores = -0.9 + 0.01 * torch.rand(1, 1, 500, generator=g)
    scores[..., 0] = -1.0  # the minimum sits far below the band
    shifted = scores_to_weights(scores) / scores_to_weights(scores).sum(-1, keepdim=True)
    assert entropy(shifted).item() > math.log(500) - 0.15
    t = match_temperature(standardise(scores), torch.tensor([[2.0]]))
    assert entropy(torch.softmax(standardise(scores) / t[..., None], -1)).item() == pytest.approx(2.0, abs=1e-6)


@torch.no_grad()
def test_calibrated_proposal_matches_the_window_attention_entropy_on_a_prefill():
    model = tiny_model("llama")
    ids = random_ids(96)
    seen = {}

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        seen[module.layer_idx] = (module, kwargs["hidden_states"], layer.keys, layer.values, kwargs)

    from transformers import DynamicCache

    handle = model.model.layers[1].self_attn.register_forward_hook(hook, with_kwargs=True)
    try:
        model.model(input_ids=ids, past_key_values=DynamicCache())
    finally:
        handle.remove()
    module, hidden, keys, values, kwargs = seen[1]
    proposal = CalibratedProposal(scorer=KeyDiffPress(), calibration="entropy", query_window=16, floor=0.0)
    pi = proposal(module, hidden, keys, values, kwargs)  # (1, H_kv, n)
    # slow reference of the target: each query head's mean attention over the last 16 rows, explicitly
    q = rope_queries(module, hidden, kwargs["position_embeddings"])[0]  # (H_q, n, d)
    n, d = q.shape[1], q.shape[2]
    g = q.shape[0] // keys.shape[1]
    targets = []
    for head in range(q.shape[0]):
        k = keys[0, head // g]
        rows = [torch.softmax((q[head, j] @ k[: j + 1].T) / math.sqrt(d), -1) for j in range(n - 16, n)]
        mean = torch.stack([torch.nn.functional.pad(r, (0, n - len(r))) for r in rows]).mean(0)
        targets.append(entropy(mean))
    target = torch.stack(targets).view(-1, g).mean(-1)
    assert torch.allclose(window_entropy(module, hidden, keys, kwargs, 16, 7)[0], target, atol=1e-5)
    assert torch.allclose(entropy(pi[0]), target, atol=1e-4)
    # the scorer's order is kept: pi never decreases along increasing scores
    scores = KeyDiffPress().score(module, hidden, keys, values, None, kwargs)[0]
    ordered = pi[0].gather(-1, scores.argsort(-1))
    assert (ordered.diff(dim=-1) >= -1e-7).all()


def test_bad_calibration_is_refused_with_its_name():
    with pytest.raises(ValueError, match="calibration"):
        CalibratedProposal(scorer=KeyDiffPress(), calibration="softmax")
    with pytest.raises(ValueError, match="query_window"):
        CalibratedProposal(scorer=KeyDiffPress(), query_window=0)
