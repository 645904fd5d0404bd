"""KVzip's reconstruction attention and score from one set of logits (kvpress_prob/presses/kvzip_fused.py), in
float64: against a dense reference written here (the whole cache's softmax for the output; the softmax over the
sinks, the chunk and the reconstruction tokens, maximum over the rows and the query group, for the score), over
blocks of one, several and all rows, with a row whose mass on KVzip's subset underflows; end to end on a tiny
float64 model with several reconstruction chunks: the scores of kvpress's own KVzipPress, and the same kept
entries as the scoring after each layer's attention for ``topk_kvzip_global`` and the toprest ragged presses."""

import copy

import pytest
import torch

from evaluation.engine import press_prefill
from kvpress_prob.cache import head_entries
from kvpress_prob.names.registry import get_press
from kvpress_prob.presses import kvzip_fused
from kvpress_prob.presses.kvzip_scoring import SCORES, BoundedKVzipPress, clear_scores
from tests.conftest import random_ids, tiny_model
from tests.test_kvzip_scoring import reference_scores

H_Q, H_KV, D, N, Q = 6, 2, 8, 40, 11  # query heads (groups of 3), KV heads, head dim, context, reconstruction rows
SINK, START, END = 3, 14, 29


def dense_reference(query, key, value, scaling, sink, start, end):
    """Output over the whole cache (causal among the last q keys) and KVzip's scores, dense, with repeated KV heads."""
    _, h_q, q_len, d = query.shape
    n, groups = key.shape[2] - q_len, h_q // key.shape[1]
    keys, values = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = query @ keys.transpose(-2, -1) * scaling  # (1, H_q, q, n + q)
    future = torch.ones(q_len, q_len, dtype=torch.bool).triu(1)
    logits[..., n:] = logits[..., n:].masked_fill(future, float("-inf"))
    output = (logits.softmax(-1) @ values).transpose(1, 2)  # (1, q, H_q, d)
    subset = torch.cat([logits[..., :sink], logits[..., start:end], logits[..., n:]], dim=-1).softmax(-1)
    chunk = subset[..., sink : sink + end - start]  # (1, H_q, q, end - start)
    scores = chunk.view(1, h_q // groups, groups, q_len, end - start).amax(dim=(2, 3))
    return output, scores


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return make(1, H_Q, Q, D), 2 * make(1, H_KV, N + Q, D), make(1, H_KV, N + Q, D)


@pytest.mark.parametrize("bound", [1, 3 * H_Q * (N + Q) * 8, 10**9])  # one row, three rows, every row per block
def test_output_and_scores_match_a_dense_float64_reference(bound):
    query, key, value = inputs()
    output, scores = kvzip_fused.fused_attention(query, key, value, D**-0.5, SINK, START, END, bound)
    ref_output, ref_scores = dense_reference(query, key, value, D**-0.5, SINK, START, END)
    assert output.shape == (1, Q, H_Q, D) and scores.shape == (1, H_KV, END - START)
    torch.testing.assert_close(output, ref_output, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-12, atol=1e-14)


def test_a_row_whose_subset_mass_underflows_gets_its_own_softmax(monkeypatch):
    """One key outside the subset takes all of a row's mass over the whole cache (its logit 1000 above the rest):
    the row's subset weights, recomputed from their logits, are still KVzip's."""
    calls = []
    original = kvzip_fused._subset_softmax
    monkeypatch.setattr(kvzip_fused, "_subset_softmax", lambda *a: calls.append(int(a[2].sum())) or original(*a))
    query, key, value = inputs(1)
    key[0, 0, 8] = query[0, 0, 5] * 1000 / query[0, 0, 5].square().sum() / D**-0.5  # query head 0, row 5 -> key 8
    output, scores = kvzip_fused.fused_attention(query, key, value, D**-0.5, SINK, START, END, 10**9)
    ref_output, ref_scores = dense_reference(query, key, value, D**-0.5, SINK, START, END)
    assert scores.isfinite().all() and calls and calls[0] >= 1
    torch.testing.assert_close(output, ref_output, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-12, atol=1e-14)


def test_a_chunk_outside_the_context_is_refused():
    query, key, value = inputs()
    with pytest.raises(ValueError, match="start < end <= n"):
        kvzip_fused.fused_attention(query, key, value, D**-0.5, SINK, START, N + 1, 10**9)


def test_only_the_active_modules_forwards_are_handled():
    model = tiny_model("llama", dtype=torch.float64)
    module = model.model.layers[0].self_attn
    query, key, value = inputs()
    assert kvzip_fused.handler(module, query, key, value, None) is None  # no press running its passes

    class _Press:
        def fused_attention(self, module, query, key, value, scaling):
            return "fused"

    with kvzip_fused.active(_Press(), [module]):
        assert kvzip_fused.handler(module, query, key, value, None, scaling=0.5) == ("fused", None)
        assert kvzip_fused.handler(model.model.layers[1].self_attn, query, key, value, None) is None
    assert kvzip_fused.handler(module, query, key, value, None) is None


CHUNK = 20  # reconstruction chunk of the end-to-end tests: four passes over 72 context tokens


def scores_and_kept(model, ids, name, ratio, fused, monkeypatch):
    monkeypatch.setattr(BoundedKVzipPress, "fused", fused)
    clear_scores()
    cache = press_prefill(model, ids, get_press(name, ratio, chunk_size=CHUNK))
    (scores,) = SCORES.stored(model)
    clear_scores()
    return scores, [[k for k, _ in head_entries(layer)] for layer in cache.layers]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_scores_are_kvpress_float64_scores(arch, monkeypatch):
    model, ids = copy.deepcopy(tiny_model(arch)).double(), random_ids(72, seed=5)
    fused, _ = scores_and_kept(model, ids, "topk_kvzip_global", 0.5, True, monkeypatch)
    exact = reference_scores(model, ids, False, chunk_size=CHUNK).cpu()
    assert (fused[..., 24:] > 0).all()
    torch.testing.assert_close(fused, exact, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", ["topk_kvzip_global", "cross_kvzip_block1_a50_toprest_ragged",
                                  "cross_kvzip_block1_a75_toprest_ragged"])
@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
def test_fused_scoring_keeps_the_same_entries(name, ratio, monkeypatch):
    model, ids = copy.deepcopy(tiny_model("llama")).double(), random_ids(72, seed=6)
    fused, kept_fused = scores_and_kept(model, ids, name, ratio, True, monkeypatch)
    after, kept_after = scores_and_kept(model, ids, name, ratio, False, monkeypatch)
    torch.testing.assert_close(fused, after, rtol=1e-10, atol=1e-14)
    for layer_fused, layer_after in zip(kept_fused, kept_after):
        for keys_fused, keys_after in zip(layer_fused, layer_after):
            assert keys_fused.shape == keys_after.shape and torch.equal(keys_fused, keys_after)
