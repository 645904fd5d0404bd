"""kvpress_prob.cache.held, the one reader of what a cache layer holds: its answers against hand-built dense, ragged
and folded layers (bytes with and without a bias, fp32 and bf16, each storage once; the padded view against an
explicit loop; the prompt's entries; kept positions), the refusals every ragged eviction shares, the decode-speed
bench's byte count on a ragged cache, and a grep: outside kvpress_prob/cache/ no code reads a layer's internals."""

import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, QuantizedCache
from transformers.cache_utils import DynamicLayer

from kvpress_prob.cache import (FoldedLayer, RaggedLayer, cache_held_bytes, check_evictable, evict_layers, evict_ragged,
                                held_bytes, held_counts, kept_positions, layer_bias, mean_kept, padded_view,
                                prompt_entries, widest_held)
from kvpress_prob.cache.folded import fold
from kvpress_prob.correction import bias as correction

ROOT = Path(__file__).resolve().parent.parent
H, N, D = 3, 10, 4
LOWEST = torch.finfo(torch.float32).min

#: what only kvpress_prob/cache/ may do: tell the layer kinds apart, read a ragged layer's internals, count storage
FORBIDDEN = {
    "isinstance on a ragged layer": re.compile(r"isinstance\([^)]*\b(RaggedLayer|FoldedLayer)\b"),
    "a ragged layer's internals": re.compile(r"\.(flat_keys|flat_values|appended|prompt_kept)\b|(?<!args)\.lengths\b"),
    "storage counted by hand": re.compile(r"untyped_storage\("),
}


def hits(text: str) -> list[str]:
    return [f"{what}: {line.strip()}" for line in text.splitlines() for what, rule in FORBIDDEN.items()
            if rule.search(line)]


def test_the_grep_sees_each_forbidden_read():
    assert len(hits("if isinstance(layer, (RaggedLayer, dict)):")) == 1
    assert len(hits("x = isinstance(layer, FoldedLayer)")) == 1
    for line in ("k = layer.flat_keys", "layer.flat_values[0]", "n = max(layer.lengths)", "t = layer.appended",
                 "p = layer.prompt_kept", "t.untyped_storage().nbytes()"):
        assert len(hits(line)) == 1, line
    assert hits("lengths = args.lengths or [4096]") == [] and hits("held_counts(layer)  # lengths") == []


def test_no_code_outside_the_cache_reads_what_a_layer_holds_by_hand():
    found = []
    for folder in ("kvpress_prob", "evaluation", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(ROOT / "kvpress_prob" / "cache"):
                continue
            found += [f"{path.relative_to(ROOT)}: {hit}" for hit in hits(path.read_text())]
    assert found == [], "read it through kvpress_prob.cache (held.py):\n" + "\n".join(found)


def dense(dtype=torch.float32, seed=0, n=N) -> DynamicCache:
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    cache.update(torch.randn(1, H, n, D, generator=g).to(dtype), torch.randn(1, H, n, D, generator=g).to(dtype), 0)
    return cache


KEEP = torch.zeros(1, H, N, dtype=torch.bool)
KEEP[0, 0, [0, 3, 9]] = True
KEEP[0, 1, :7] = True
KEEP[0, 2, [5]] = True


def ragged(dtype=torch.float32, with_bias=True, bias_dtype=torch.float32):
    """A dense cache's full K, V, the bias it was evicted with, and the cache holding one RaggedLayer of KEEP."""
    cache = dense(dtype)
    keys, values = cache.layers[0].keys.clone(), cache.layers[0].values.clone()
    bias = None
    if with_bias:
        bias = torch.where(KEEP, torch.arange(H * N, dtype=torch.float32).view(1, H, N) / 7 + 0.5, 0.0).to(bias_dtype)
    evict_ragged(cache, 0, KEEP, bias)
    return keys, values, bias, cache


class Attention(torch.nn.Module):
    """What the correction attaches a bias to: a module with a layer index."""

    def __init__(self, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_layer_holds_its_keys_values_and_correction_bias(dtype):
    cache = dense(dtype)
    layer, size = cache.layers[0], torch.finfo(dtype).bits // 8
    assert held_bytes(layer) == (2 * H * N * D * size, 0) and layer_bias(layer) is None
    assert held_counts(layer) == (N,) * H and mean_kept(layer) == N and widest_held(layer) == N
    module = Attention()
    bias = torch.full((1, H, N), 0.25, dtype=torch.float32)
    assert correction.store(module, bias, cache) == H * N * 4  # the correction's own count of what it stores
    assert layer_bias(layer) is correction.bias_of(module, cache)
    assert held_bytes(layer) == (2 * H * N * D * size, H * N * 4)
    assert cache_held_bytes(cache) == held_bytes(layer)
    keys, values, view_bias = padded_view(layer)
    assert keys is layer.keys and values is layer.values and view_bias is bias  # the tensors themselves
    correction.reset(module)
    assert padded_view(layer)[2] is None and held_bytes(layer)[1] == 0


def test_a_view_counts_its_whole_storage_and_a_shared_storage_counts_once():
    cache = dense()
    big = torch.randn(2, 1, H, 2 * N, D)  # K and V as views of one buffer twice their length
    layer = cache.layers[0]
    layer.keys, layer.values = big[0, :, :, :N], big[1, :, :, :N]
    assert held_bytes(layer) == (big.numel() * 4, 0)
    layer.values = layer.keys
    assert held_bytes(layer) == (big.numel() * 4, 0)
    assert held_bytes(DynamicLayer()) == (0, 0)  # not initialised: holds nothing


@pytest.mark.parametrize("dtype, bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_a_ragged_layer_holds_its_kept_entries_its_bias_and_its_free_slots(dtype, bias_dtype):
    size, kept = torch.finfo(dtype).bits // 8, int(KEEP.sum())
    *_, cache = ragged(dtype, with_bias=False)
    layer = cache.layers[0]
    assert held_bytes(layer) == (2 * kept * D * size, 0) and layer_bias(layer) is None
    *_, cache = ragged(dtype, bias_dtype=bias_dtype)
    layer = cache.layers[0]
    bias_size = torch.finfo(bias_dtype).bits // 8
    assert held_bytes(layer) == (2 * kept * D * size, kept * bias_size)
    assert sum(held_bytes(layer)) == layer.nbytes() and cache_held_bytes(cache) == held_bytes(layer)
    assert held_counts(layer) == (3, 7, 1) and mean_kept(layer) == 11 / 3 and widest_held(layer) == 7
    cache.update(torch.randn(1, H, 2, D).to(dtype), torch.randn(1, H, 2, D).to(dtype), 0)
    slots = kept + H * 32  # every region grew by the first append's free slots (the whole buffer is held)
    assert held_bytes(layer) == (2 * slots * D * size, slots * bias_size)
    assert held_counts(layer) == (5, 9, 3) and mean_kept(layer) == 17 / 3 and widest_held(layer) == 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_padded_view_of_a_ragged_layer_is_the_explicit_layout(dtype, with_bias):
    keys, values, bias, cache = ragged(dtype, with_bias=with_bias)
    new_k, new_v = torch.randn(1, H, 2, D).to(dtype), torch.randn(1, H, 2, D).to(dtype)
    cache.update(new_k, new_v, 0)
    view_k, view_v, view_bias = padded_view(cache.layers[0])
    S, t = 7, 2
    assert view_k.shape == view_v.shape == (1, H, S + t, D) and view_bias.dtype == torch.float32
    for h in range(H):
        kept = [j for j in range(N) if KEEP[0, h, j]]
        for slot in range(S + t):
            if slot < len(kept):  # a kept entry, in prefix order, with its stored bias
                want_k, want_v = keys[0, h, kept[slot]], values[0, h, kept[slot]]
                want_bias = 0.0 if bias is None else float(bias[0, h, kept[slot]])
            elif slot < S:  # padding: zeros, the lowest bias
                want_k = want_v = torch.zeros(D, dtype=dtype)
                want_bias = LOWEST
            else:  # an appended token, bias 0
                want_k, want_v, want_bias = new_k[0, h, slot - S], new_v[0, h, slot - S], 0.0
            assert torch.equal(view_k[0, h, slot], want_k) and torch.equal(view_v[0, h, slot], want_v)
            assert float(view_bias[0, h, slot]) == want_bias


def test_a_folded_layer_reads_as_a_ragged_one_and_knows_its_prompt():
    cache = dense()
    keys, values = cache.layers[0].keys, cache.layers[0].values
    prompt = torch.zeros(1, H, N, dtype=torch.bool)
    prompt[..., :6] = True  # positions 0..5 before the prompt's end
    keep = KEEP.clone()
    bias = torch.where(keep, 0.5, 0.0)
    layer = fold(cache, 0, keys, values, keep, bias, N, 6, prompt)
    assert isinstance(layer, FoldedLayer) and isinstance(cache.layers[0], RaggedLayer)
    kept = int(keep.sum())
    assert held_counts(layer) == (3, 7, 1) and held_bytes(layer) == (2 * kept * D * 4, kept * 4)
    _, _, view_bias = padded_view(layer)
    real = view_bias > LOWEST / 2
    length, mask = prompt_entries(layer, real, None, N)
    assert length == 6
    for h in range(H):  # each head's kept entries before position 6 come first
        before = sum(1 for j in range(6) if keep[0, h, j])
        assert mask[0, h].tolist() == [slot < before for slot in range(real.shape[-1])]


def test_a_layer_not_folded_has_its_decoded_tokens_last():
    *_, cache = ragged()
    cache.update(torch.randn(1, H, 3, D), torch.randn(1, H, 3, D), 0)
    _, _, view_bias = padded_view(cache.layers[0])
    real = view_bias > LOWEST / 2
    length, mask = prompt_entries(cache.layers[0], real, N + 1, N + 3)  # decoding began after one appended token
    assert length == N + 1
    for h, c in enumerate((3, 7, 1)):  # the kept entries and the first appended token; the last 2 are decoded
        assert mask[0, h].tolist() == [slot < c or slot == 7 for slot in range(10)]
    with pytest.raises(ValueError, match="first_decoding"):
        prompt_entries(cache.layers[0], real, None, N + 3)


def test_kept_positions_match_each_held_key_to_its_position():
    keys, _, _, cache = ragged()
    found, distance = kept_positions(cache.layers[0], keys)
    assert torch.equal(found, KEEP[0]) and distance == 0.0
    g = torch.Generator().manual_seed(1)
    full = dense(seed=2, n=20)
    positions = torch.tensor([0, 3, 7, 19])
    near = DynamicCache()
    held = full.layers[0].keys[:, :, positions]
    near.update(held + 1e-7 * torch.randn(held.shape, generator=g), held.clone(), 0)  # a recomputation's rounding
    found, distance = kept_positions(near.layers[0], full.layers[0].keys)
    assert found.sum().item() == H * 4 and found[:, positions].all() and 0 < distance < 1e-5
    with pytest.raises(ValueError, match="full_keys"):
        kept_positions(near.layers[0], full.layers[0].keys[0, :2])


def test_evict_layers_is_evict_ragged_on_every_row():
    a, b = dense(seed=4), dense(seed=4)
    a.update(b.layers[0].keys.clone(), b.layers[0].values.clone(), 1)
    b.update(b.layers[0].keys.clone(), b.layers[0].values.clone(), 1)
    keep = torch.stack([KEEP, KEEP.flip(-1)])  # (L, 1, H, n)
    bias = torch.where(keep, 1.5, 0.0)
    layers = evict_layers(a, keep, bias)
    for i in range(2):
        one = evict_ragged(b, i, keep[i], bias[i])
        assert held_counts(layers[i]) == held_counts(one) and held_bytes(layers[i]) == held_bytes(one)
        assert all(torch.equal(x, y) for x, y in zip(padded_view(layers[i]), padded_view(one)))
    with pytest.raises(ValueError, match="one row per layer"):
        evict_layers(dense(), keep, layers=[0])


def test_every_ragged_eviction_refuses_a_quantized_cache_and_a_batch():
    quantized = QuantizedCache.__new__(QuantizedCache)  # the refusal reads its type only
    with pytest.raises(ValueError, match="RaggedAdaKVPress evicts into a ragged cache: a QuantizedCache"):
        check_evictable(quantized, 1, "RaggedAdaKVPress")
    with pytest.raises(ValueError, match="batch size must be 1, got 2"):
        check_evictable(DynamicCache(), 2, "HeadBudgetDecodingPress")
    check_evictable(DynamicCache(), 1, "anyone")
    two = DynamicCache()
    two.update(torch.randn(2, H, N, D), torch.randn(2, H, N, D), 0)
    with pytest.raises(ValueError, match="evict_ragged evicts into a ragged cache.*batch size must be 1, got 2"):
        evict_ragged(two, 0, KEEP)


def test_the_decode_speed_bench_counts_a_ragged_cache():
    """``evaluation.bench.speed.decoding.decode`` under a per-head decoding press (its layers become FoldedLayers):
    the bytes it reports are the reader's, the storage of each layer's buffers."""
    from evaluation.bench.speed.decoding import decode
    from kvpress_prob.names.decoding import get_decoding_press
    from tests.conftest import random_ids, tiny_model

    model = tiny_model("llama")
    ids = random_ids(48, seed=5)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :32], past_key_values=cache)
    press = get_decoding_press("prob_decode_min_variance_priority_floor20_heads", 12, 8, n_sink=2, window=4)
    row = decode(model, cache, press, ids[0, 32:], 32)
    assert row["rounds"] and all(isinstance(layer, FoldedLayer) for layer in cache.layers)
    d, expected_kv, expected_bias = model.config.head_dim, 0, 0
    for layer in cache.layers:  # by hand: the slots of every region (kept entries, appended tokens, free slots)
        expected_kv += 2 * sum(layer.capacity) * d * 4
        expected_bias += 0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size()
    assert (row["final_kv_bytes"], row["bias_bytes"]) == (expected_kv, expected_bias) and expected_bias > 0
