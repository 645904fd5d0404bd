"""kvpress_prob.cache.held_counts / head_entries: what each KV head holds, read the same way from a dense layer and a
RaggedLayer, against the dense tensors and the keep mask the ragged layer was built from."""

import torch
from transformers import DynamicCache

from kvpress_prob.cache import RaggedLayer, evict_ragged, head_entries, held_counts


def dense_cache(H=3, n=10, d=4, seed=0) -> DynamicCache:
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    cache.update(torch.randn(1, H, n, d, generator=g), torch.randn(1, H, n, d, generator=g), 0)
    return cache


def test_a_dense_layer_holds_its_length_in_every_head():
    cache = dense_cache()
    layer = cache.layers[0]
    assert held_counts(layer) == (10, 10, 10)
    for h, (k, v) in enumerate(head_entries(layer)):
        assert torch.equal(k, layer.keys[0, h]) and torch.equal(v, layer.values[0, h])


def test_a_ragged_layer_holds_each_heads_kept_entries_then_the_appended_tokens():
    cache = dense_cache()
    keys, values = cache.layers[0].keys.clone(), cache.layers[0].values.clone()
    keep = torch.zeros(1, 3, 10, dtype=torch.bool)
    keep[0, 0, [0, 3, 9]] = True
    keep[0, 1, :7] = True
    keep[0, 2, [5]] = True
    layer = evict_ragged(cache, 0, keep)
    assert isinstance(layer, RaggedLayer) and held_counts(layer) == (3, 7, 1)
    assert layer.get_seq_length() == 10  # the logical length is not what a head holds
    for h, (k, v) in enumerate(head_entries(layer)):
        assert torch.equal(k, keys[0, h][keep[0, h]]) and torch.equal(v, values[0, h][keep[0, h]])
    new_k, new_v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
    cache.update(new_k, new_v, 0)
    assert held_counts(cache.layers[0]) == (5, 9, 3)
    for h, (k, v) in enumerate(head_entries(cache.layers[0])):
        assert torch.equal(k, torch.cat([keys[0, h][keep[0, h]], new_k[0, h]]))
        assert torch.equal(v, torch.cat([values[0, h][keep[0, h]], new_v[0, h]]))
