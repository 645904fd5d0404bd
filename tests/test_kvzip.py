"""KVzip's scores under our designs (kvpress_prob/presses/kvzip.py): equal memory on the cache, the kept set of the
top-k twin is KVzip's per-head top-k of its own scores, sampled designs depend on the seed, scores reused."""

import pytest
import torch
from kvpress import KVzipPress

from evaluation.engine import cache_summary, press_prefill
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.names.registry import RECOMMENDED_SLOW, get_press
from tests.conftest import random_ids, tiny_model

N = 64  # context tokens of every prefill here


@pytest.fixture
def prefilled():
    """``prefilled(arch, seed, press)``: (model, ids, cache) of ``press`` on N random tokens (``seed``) of a
    tiny ``arch`` model, KVzip's score store emptied first (and after the test), so that it holds this
    prefill's scores only."""

    def prefill(arch: str, seed: int, press):
        model, ids = tiny_model(arch), random_ids(N, seed=seed)
        kvzip_scoring.clear_scores()
        return model, ids, press_prefill(model, ids, press)

    yield prefill
    kvzip_scoring.clear_scores()


def only_scores() -> torch.Tensor:
    """The (L, 1, H, n) KVzip scores in the store, which must hold one prefill's: computed once, kept."""
    assert len(kvzip_scoring.SCORES) == 1
    return kvzip_scoring.SCORES.stored()[0]


def test_equal_memory_and_the_top_k_twin_keeps_the_top_scores(prefilled):
    topk = get_press("topk_kvzip_head", 0.5)
    model, ids, cache = prefilled("llama", 4, topk)
    full = press_prefill(model, ids, None)
    scores = only_scores()
    for layer, (a, b) in enumerate(zip(cache.layers, full.layers)):
        assert a.keys.shape[2] == N // 2  # kvpress's per-head count, no padding
        s = scores[layer, 0].float().clone()
        s[:, : topk.n_sink] = s.max() + 1
        for h in range(a.keys.shape[1]):
            keep = s[h].topk(N // 2).indices.sort().values
            assert torch.equal(a.keys[0, h], b.keys[0, h, keep])
    assert cache_summary(cache, topk, N)[1] == sum(l.keys.numel() * 4 * 2 // 2 for l in full.layers)


def test_sampled_designs_depend_on_the_seed_and_reuse_the_scores(prefilled):
    model, ids, a = prefilled("qwen3", 5, get_press("prob_kvzip_priority_head", 0.5, seed=0))
    calls = []
    original = KVzipPress._perform_kvzip_compression  # kvpress's: the reconstruction passes
    KVzipPress._perform_kvzip_compression = lambda self, m, t: calls.append(1) or original(self, m, t)
    try:
        b = press_prefill(model, ids, get_press("prob_kvzip_priority_head", 0.5, seed=1))
        c = press_prefill(model, ids, get_press("hybrid_kvzip_block8_a50", 0.75, seed=0))
    finally:
        KVzipPress._perform_kvzip_compression = original
    assert calls == []  # the reconstruction passes ran once, for the first press
    assert any(not torch.equal(x.keys, y.keys) for x, y in zip(a.layers, b.layers))
    assert all(x.keys.shape[2] == N // 4 for x in c.layers)


def test_refusals():
    with pytest.raises(ValueError, match="floor"):
        KVzipSampledPress(compression_ratio=0.5, floor=1.0)
    with pytest.raises(ValueError, match="budget"):
        KVzipSampledPress(compression_ratio=0.5, budget="model")


def test_cross_kvzip_keeps_kvzip_blocks_and_a_corrected_min_h_tail(prefilled):
    from evaluation.engine import Prefill
    from kvpress_prob.samplers.cross import CrossStratifiedSampler

    press = get_press("cross_kvzip_block8_a50", 0.5, seed=0)
    assert isinstance(press.sampler, CrossStratifiedSampler) and press.tail is not None
    model, ids, cache = prefilled("llama", 6, press)
    assert all(layer.keys.shape[2] == N // 2 for layer in cache.layers)
    # the tail proposal is the prefill's pi_min-h: the same as a SamplingPress computes in the shared prefill
    shared = Prefill(model, ids, [get_press("prob_min_h_priority_head", 0.5)])
    proposals = shared.proposals_of(get_press("prob_min_h_priority_head", 0.5))
    seen = {}
    hook = KVzipSampledPress._tail_hook

    def spy(self, module, args, kwargs, output):
        out = hook(self, module, args, kwargs, output)
        seen[module.layer_idx] = self._tails[module.layer_idx]
        return out

    KVzipSampledPress._tail_hook = spy
    try:
        press_prefill(model, ids, get_press("cross_kvzip_block8_a50", 0.5, seed=0))
    finally:
        KVzipSampledPress._tail_hook = hook
    for module, pi in proposals.items():
        assert torch.allclose(seen[module.layer_idx], pi, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="tail"):
        KVzipSampledPress(compression_ratio=0.5, sampler=CrossStratifiedSampler())


def test_allocation_over_layers_holds_at_most_kvpress_bytes_without_padding(prefilled):
    press = get_press("topk_kvzip_layers", 0.5)
    model, ids, cache = prefilled("qwen3", 7, press)
    scores = only_scores().float().clone()
    scores[..., : press.n_sink] = scores.amax() + 1
    counts = press.layer_counts(scores)
    assert [layer.keys.shape[2] for layer in cache.layers] == counts  # every head of a layer keeps the same count
    L, H = len(cache.layers), cache.layers[0].keys.shape[1]
    assert sum(counts) * H <= int(0.5 * L * H * N) and sum(counts) * H > int(0.5 * L * H * N) - L * H
    flat = scores.reshape(-1)
    top = flat.topk(int(0.5 * flat.numel())).indices // (H * N)
    assert counts == [max(1, int((top == layer).sum()) // H) for layer in range(L)]


@pytest.mark.parametrize("name", ["topk_kvzip_widest", "topk_kvzip_ragged_fit", "prob_kvzip_priority_head",
                                  "cross_kvzip_block1_a75_mix50_layers", RECOMMENDED_SLOW])
def test_the_shared_prefill_compresses_a_kvzip_press_as_its_own_prefill_does(name):
    """``Prefill.compress`` of a KVzip press (no prefill of its own: the shared cache, the tail proposal from the
    shared hooks; the recommendations' tail + widest path included) leaves the same keys, values and correction bias as a prefill under the press, each computing
    KVzip's scores afresh."""
    from evaluation.engine import Prefill
    from evaluation.engine.prefill import plan
    from kvpress_prob.cache import head_entries, held_counts
    from kvpress_prob.correction.bias import bias_of
    from kvpress_prob.presses.sampling import language_model

    model, ids = tiny_model("qwen3"), random_ids(N, seed=3)
    modules = [layer.self_attn for layer in language_model(model).layers]
    seed = {"seed": 1} if get_press(name, 0.5).sampler.random else {}  # a top-k press refuses a seed it would ignore
    assert plan(model, get_press(name, 0.5, **seed), N).kind == "kvzip"
    for ratio in (0.25, 0.75):
        kvzip_scoring.clear_scores()
        own = press_prefill(model, ids, get_press(name, ratio, **seed))
        own_bias = [bias_of(m, own) for m in modules]
        kvzip_scoring.clear_scores()
        press = get_press(name, ratio, **seed)
        shared = Prefill(model, ids, [press, get_press("prob_min_h_priority_head", 0.5)])
        replayed = shared.compress(press)
        assert shared.prefills == 1 and len(kvzip_scoring.SCORES) == 1
        for m, a, b, bias in zip(modules, own.layers, replayed.layers, own_bias):
            assert held_counts(a) == held_counts(b)  # a dense or a ragged layer, each head its own entries
            assert all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(head_entries(a), head_entries(b)))
            other = bias_of(m, replayed)
            assert (bias is None) == (other is None) and (bias is None or torch.equal(bias, other))
        assert all(torch.equal(k, layer.keys) for k, layer in zip(shared.keys, shared.full_cache.layers))
    kvzip_scoring.clear_scores()
