"""KVzip's kept set with real eviction (kvpress_prob/presses/kvzip_alloc.py) and the honesty of kvzip's mask: on every
later forward, kvpress's masked cache (as the harness decodes it) gives the logits of an explicit eviction of
exactly its masked set and of a float64 reference with explicit weights; equal-memory allocations fit the bytes."""

import pytest
import torch

from evaluation.engine import Compressed, cache_summary, generate_batch, press_prefill, teacher_forced
from evaluation.tasks.prose.measure import masks_as_bias
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.presses.allocations import allocation_keep, kvzip_keep, top_counts, widest_fit
from kvpress_prob.presses.kvzip_alloc import KVzipAllocatedPress
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.names.registry import get_press
from kvpress_prob.testing.reference import dense_reference, float64_copy, masked_keep
from tests.conftest import random_ids, tiny_model


def _scores(press, n):
    scores = kvzip_scoring.SCORES.stored()[0].float().clone()
    scores[..., : press.n_sink] = scores.amax() + 1
    return scores


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kvzip_mask_equals_explicit_eviction_and_a_float64_reference(arch):
    model, n, t = tiny_model(arch), 64, 12
    model64 = float64_copy(model)
    layers = language_model(model).layers
    ids, fed = random_ids(n, seed=11), random_ids(t, seed=12)
    kvzip_scoring.clear_scores()
    cache = press_prefill(model, ids, get_press("kvzip", 0.5))
    keep = masked_keep(layers, n)
    assert 0.4 < keep.double().mean() < 0.6 and not keep.all(dim=-1).all()  # ragged: some head loses entries
    assert masks_as_bias(cache, layers)  # the prose / recall path, right after the press (a prefill drops masks)
    masked, _ = teacher_forced(model, cache, fed, n)
    for layer in layers:
        correction.reset(layer.self_attn)
    ragged = get_press("topk_kvzip_padded", 0.5)
    evicted_cache = press_prefill(model, ids, ragged)
    assert torch.equal(allocation_keep(_scores(ragged, n), 0.5, "padded"), keep)  # exactly kvpress's set
    assert ragged.kept == keep[:, 0].sum(-1).tolist()
    evicted, _ = teacher_forced(model, evicted_cache, fed, n)
    reference = dense_reference(model64, ids, fed, keep).float()
    full = dense_reference(model64, ids, fed, None).float()
    assert (full - reference).abs().max() > 1e-2  # the masked entries matter: a leak would show
    assert torch.allclose(masked, reference, atol=1e-4, rtol=0)
    assert torch.allclose(evicted, reference, atol=1e-4, rtol=0)


def test_kvpress_native_mask_of_one_decoding_step_matches_the_eviction():
    """kvpress's own path (its attention patch's fake keys, ``masked_key_indices`` left on the modules) for one
    decoding step against the explicit eviction of the masked set."""
    model, n = tiny_model("llama"), 64
    ids, token = random_ids(n, seed=16), random_ids(1, seed=17)
    cache = press_prefill(model, ids, get_press("kvzip", 0.75))
    native, _ = teacher_forced(model, cache, token, n)
    for layer in language_model(model).layers:
        del layer.self_attn.masked_key_indices
    evicted, _ = teacher_forced(model, press_prefill(model, ids, get_press("topk_kvzip_padded", 0.75)), token, n)
    full, _ = teacher_forced(model, press_prefill(model, ids, None), token, n)
    assert (full - evicted).abs().max() > 1e-2
    assert torch.allclose(native, evicted, atol=1e-4, rtol=0)


def test_kvzip_mask_holds_in_batched_decoding(tokenizer):
    """The RULER path: kvzip's masks become the lowest bias (``Compressed.take``), decoded greedily beside the
    explicit eviction of its masked set: the same tokens, whatever the batch."""
    model, n = tiny_model("llama"), 64
    ids, question = random_ids(n, seed=13), random_ids(6, seed=14)
    kvzip_scoring.clear_scores()
    layers = language_model(model).layers
    items = [Compressed.take(press_prefill(model, ids, get_press("kvzip", 0.75)), layers),
             Compressed.take(press_prefill(model, ids, get_press("topk_kvzip_padded", 0.75)), layers),
             Compressed.take(press_prefill(model, ids, None), layers)]
    a, b, full = generate_batch(model, tokenizer, question, items, n, 12)
    assert a == b and a != full


@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_equal_memory_allocations_fit_the_bytes(ratio):
    model, n = tiny_model("qwen3", layers=4), 64
    ids = random_ids(n, seed=15)
    kvzip_scoring.clear_scores()
    full = press_prefill(model, ids, None)
    full_bytes = sum(layer.keys.numel() * 4 * 2 for layer in full.layers)
    for allocation in ("widest", "ragged_fit"):
        press = get_press(f"topk_kvzip_{allocation}", ratio)
        cache = press_prefill(model, ids, press)
        held = cache_summary(cache, press, n)[1]
        bias = sum(b.numel() * b.element_size() for b in
                   (correction.bias_of(layer.self_attn, cache) for layer in language_model(model).layers) if b is not None)
        assert held <= (1 - ratio) * full_bytes  # K + V; the bias (ragged_fit's padding) is 4 bytes per stored slot
        slots = sum(layer.keys.shape[1] * layer.keys.shape[2] for layer in cache.layers)
        # widest: no padding, no bias (K and V only); ragged_fit: one float32 per stored slot of a padded layer
        padded = sum(layer.keys.shape[1] * layer.keys.shape[2] for layer, b in zip(cache.layers, (
            correction.bias_of(m.self_attn, cache) for m in language_model(model).layers)) if b is not None)
        assert bias == (0 if allocation == "widest" else 4 * padded) and (allocation == "widest" or padded > 0)
        assert slots > 0
        scores = _scores(press, n)
        k, widths = widest_fit(scores, ratio)
        assert [layer.keys.shape[2] for layer in cache.layers] == widths.tolist()
        assert int(widths.sum()) == int((1 - ratio) * 4 * n)  # one more entry of the global top would not fit
        assert int(top_counts(scores, k + 1).amax(1).clamp(min=1).sum()) > int((1 - ratio) * 4 * n)
        keep = allocation_keep(scores, ratio, allocation)
        top = torch.zeros(scores.numel(), dtype=torch.bool)
        top[scores.reshape(-1).topk(k).indices] = True
        assert bool((keep.reshape(-1) | ~top).all())  # the global top is kept in both
        if allocation == "ragged_fit":
            assert int(keep.sum()) == k
        for layer, w in enumerate(widths.tolist()):  # widest: each head's own top at the layer's width
            for h in range(scores.shape[2]):
                if allocation == "widest":
                    assert torch.equal(keep[layer, 0, h].nonzero().flatten(),
                                       scores[layer, 0, h].topk(w).indices.sort().values)
        teacher_forced(model, cache, random_ids(5, seed=18), n)  # layers of different lengths decode
    ragged = press_prefill(model, ids, get_press("topk_kvzip_padded", ratio))
    assert cache_summary(ragged, None, n)[1] >= (1 - ratio) * full_bytes  # the diagnostic holds more


def test_kvzip_keep_is_kvpress_compress_post_and_refusals():
    scores = torch.rand(3, 1, 2, 40, generator=torch.Generator().manual_seed(0))
    keep = kvzip_keep(scores, 0.5)
    assert int((~keep).sum()) == int(scores.numel() * 0.5)
    assert bool((scores[keep].min() > scores[~keep].max()))  # continuous random scores: no ties
    with pytest.raises(ValueError, match="allocation"):
        KVzipAllocatedPress(compression_ratio=0.5, allocation="ragged")
    with pytest.raises(ValueError, match="batch size"):
        widest_fit(torch.rand(2, 2, 2, 8), 0.5)
