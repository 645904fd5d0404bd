"""The paper's correction on KVzip's scores under the widest allocation (``cross_kvzip_block1_a<pct>_widest``):
each layer holds ``widest_fit``'s width, the top share of KVzip's scores exactly and the rest sampled from
pi_min-h with its SNIS bias, at the bytes of ``topk_kvzip_widest`` plus that bias."""

import pytest
import torch
from transformers import DynamicCache

from evaluation.engine import Compressed, generate_batch, press_prefill
from kvpress_prob.correction import bias as correction
from kvpress_prob.names.registry import get_press
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.presses.allocations import widest_fit
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.sampling import language_model
from tests.conftest import random_ids, tiny_model


def _scores(press):
    scores = kvzip_scoring.SCORES.stored()[0].float().clone()  # (L, 1, H, n)
    scores[..., : press.n_sink] = scores.amax() + 1
    return scores


def _widest_prefill(dtype, seed: int, name: str, ratio: float, n: int = 96):
    """The tiny model, its cache compressed by ``name`` at ``ratio``, a plain prefill's cache, KVzip's pinned scores
    and widest's widths."""
    model, ids = tiny_model("llama", dtype=dtype), random_ids(n, seed=seed)
    kvzip_scoring.clear_scores()
    press = get_press(name, ratio)
    cache = press_prefill(model, ids, press)
    plain = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=plain)
    scores = _scores(press)
    return model, cache, plain, scores, widest_fit(scores, ratio)[1]


def _positions(plain: torch.Tensor, held: torch.Tensor) -> list[set[int]]:
    """Per head, the prefix positions whose key rows ``held`` (H, s, d) holds, matched bit for bit to ``plain`` (H, n, d)."""
    out = []
    for head in range(plain.shape[0]):
        where = {bytes(row.float().numpy().tobytes()): p for p, row in enumerate(plain[head])}
        out.append({where[k] for row in held[head] if (k := bytes(row.float().numpy().tobytes())) in where})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio, alpha", [(0.75, 75), (0.9, 90)])
def test_widths_exact_top_and_a_bias_in_the_keys_dtype(dtype, ratio, alpha):
    n = 96
    model, cache, plain, scores, widths = _widest_prefill(dtype, 21, f"cross_kvzip_block1_a{alpha}_widest", ratio, n)
    assert int(widths.sum()) <= len(widths) * (n - int(n * ratio))  # within the equal-memory budget
    sampled = 0
    for layer, module in enumerate(m.self_attn for m in language_model(model).layers):
        held = cache.layers[layer].keys[0]  # (H, w, d)
        width = int(widths[layer])
        assert held.shape[1] == width, (layer, held.shape, width)
        bias = correction.bias_of(module, cache)
        assert bias is not None and bias.dtype == held.dtype  # the SNIS weights, stored in the keys' dtype
        kept = _positions(plain.layers[layer].keys[0], held)
        for head, positions in enumerate(kept):
            assert len(positions) == width  # every stored row is a distinct prefix entry (no padding)
            exact = set(scores[layer, 0, head].topk(int(alpha / 100 * width)).indices.tolist())
            assert exact <= positions, (layer, head)
            top = set(scores[layer, 0, head].topk(width).indices.tolist())
            sampled += len(positions - top)
    assert sampled > 0  # the tail was drawn from pi_min-h, not KVzip's next scores


def test_same_seed_same_set_another_seed_another():
    model, n = tiny_model("llama"), 96
    ids = random_ids(n, seed=22)

    def held(seed):
        cache = press_prefill(model, ids, get_press("cross_kvzip_block1_a75_widest", 0.75, seed=seed))
        return [layer.keys.clone() for layer in cache.layers]

    first, again, other = held(0), held(0), held(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_decodes_after_the_block_and_generate_inside_on_the_compressed_cache(tokenizer):
    """Like every KVzip press: decoding runs after the block (kvpress's pipeline), and ``generate`` inside the
    block decodes on the cache compressed at its first decoding step, not on the full cache."""
    model, n = tiny_model("llama"), 96
    ids, question = random_ids(n, seed=23), random_ids(6, seed=24)
    layers = language_model(model).layers
    press = get_press("cross_kvzip_block1_a75_widest", 0.75)
    item = Compressed.take(press_prefill(model, ids, press), layers)
    full = Compressed.take(press_prefill(model, ids, None), layers)
    sampled, reference = generate_batch(model, tokenizer, question, [item, full], n, 8)
    assert isinstance(sampled, str) and isinstance(reference, str)
    cache = DynamicCache()
    with press(model):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=2)
    assert out.shape[1] == n + 2 and cache.get_seq_length() < n


def test_refusals():
    with pytest.raises(ValueError, match="layers and widest"):
        KVzipSampledPress(compression_ratio=0.5, layers=True, widest=True)
    for name in ("cross_kvzip_block1_a75_layers_widest", "cross_snapkv_block1_a75_widest",
                 "topk_kvzip_block1_widest"):
        with pytest.raises(ValueError):
            get_press(name, 0.5)
    with pytest.raises(ValueError, match="budget"):
        get_press("cross_kvzip_block1_a75_widest", 0.5, budget="global")  # every head keeps its layer's width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_top_rest_keeps_two_top_sets_and_stores_no_bias(dtype):
    """``toprest``: KVzip's exact top of each layer's width, the rest pi_min-h's top, weight 1: no bias on the
    cache (kvpress top-k's bytes), the widths of ``widest_fit``, and entries outside KVzip's own top set."""
    ratio = 0.75
    model, cache, plain, scores, widths = _widest_prefill(dtype, 23, "cross_kvzip_block1_a50_toprest_widest", ratio)
    outside = 0
    for layer, module in enumerate(m.self_attn for m in language_model(model).layers):
        width = int(widths[layer])
        assert cache.layers[layer].keys.shape[2] == width
        assert correction.bias_of(module, cache) is None  # nothing to correct: top-k's bytes
        for head, positions in enumerate(_positions(plain.layers[layer].keys[0], cache.layers[layer].keys[0])):
            assert len(positions) == width
            assert set(scores[layer, 0, head].topk(width // 2).indices.tolist()) <= positions
            outside += len(positions - set(scores[layer, 0, head].topk(width).indices.tolist()))
    assert outside > 0  # pi_min-h's top filled part of the width
    with pytest.raises(ValueError, match="nothing to correct"):
        get_press("cross_kvzip_block1_a50_toprest_widest_nocorr", ratio)
