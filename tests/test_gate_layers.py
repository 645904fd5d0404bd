"""The fast gate press (kvpress_prob/presses/gate_layers.py): each layer evicted in its own hook to kvpress's count,
the sinks, a recent window and the gate's top, against an independent computation; the evaluation engine's shared
gate scores against a prefill under the press."""

import pytest
import torch
from kvpress.utils import compute_n_kept
from transformers import DynamicCache

from evaluation.engine import Prefill, press_prefill
from kvpress_prob.learned import labels as lb
from kvpress_prob.learned import training as tr
from kvpress_prob.names.registry import get_press
from kvpress_prob.presses.gate import GatePress
from kvpress_prob.presses.gate_layers import LayerGatePress
from kvpress_prob.presses.sampling import language_model
from tests.conftest import random_ids, seen_before_each_layer, tiny_model
from tests.test_gate import random_gates


def expected_kept(scores: torch.Tensor, n_sink: int, window: float, ratio: float) -> list[list[set[int]]]:
    """Per layer and head, the kept positions, by sets: the sinks, the int(window * k) last, then the highest scores
    of the rest, one at a time, in float64."""
    L, H, n = scores.shape
    k = compute_n_kept(n, ratio)
    out = []
    for layer in range(L):
        heads = []
        for head in range(H):
            kept = set(range(min(n_sink, k)))
            kept |= set(range(n - int(window * k), n)) if int(window * k) else set()
            kept = set(sorted(kept, key=lambda i: (i >= n_sink, -i))[:k])  # sinks first, then the latest
            rest = sorted(set(range(n)) - kept, key=lambda i: -float(scores[layer, head, i].double()))
            heads.append(kept | set(rest[: k - len(kept)]))
        out.append(heads)
    return out


def kept_positions(cache, full_keys) -> list[list[set[int]]]:
    """Per layer and head, the positions of the full keys (L of (1, H, n, d)) that the cache holds."""
    out = []
    for layer, keys in zip(cache.layers, full_keys):
        heads = []
        for head in range(keys.shape[1]):
            match = (layer.keys[0, head][:, None, :] == keys[0, head][None, :, :]).all(-1)  # (k, n)
            assert (match.sum(-1) == 1).all()  # every stored key is one of the context's
            heads.append(set(match.int().argmax(-1).tolist()))
        out.append(heads)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,ratio", [(0.0, 0.5), (0.25, 0.75), (0.5, 0.9)])
def test_kept_set_is_sinks_recent_window_and_gate_top(dtype, window, ratio):
    model, n = tiny_model("llama", dtype=dtype), 90
    ids = random_ids(n, seed=11)
    gates = random_gates(model)
    scores = tr.gate_scores(gates, lb.attention_inputs(model, ids))  # the reference: an independent plain prefill
    full = press_prefill(model, ids, None)
    press = LayerGatePress(compression_ratio=ratio, gates=gates, window=window)
    cache = press_prefill(model, ids, press)
    k = compute_n_kept(n, ratio)
    assert all(layer.keys.shape[2] == k for layer in cache.layers)  # kvpress's count in every layer
    assert kept_positions(cache, [layer.keys for layer in full.layers]) == expected_kept(scores, 4, window, ratio)


def test_each_layer_is_evicted_in_its_own_hook():
    """When layer l + 1 starts its attention, layer l holds its kept count already: no full K+V outlives its hook."""
    model, n, ratio = tiny_model("qwen3"), 80, 0.75
    press = LayerGatePress(compression_ratio=ratio, gates=random_gates(model), window=0.25)
    layers = language_model(model).layers
    seen = seen_before_each_layer(model, press, random_ids(n, seed=2), lambda cache_layers, i: [
        c.keys.shape[2] for c in cache_layers if c.keys is not None and c.keys.numel()])
    k = compute_n_kept(n, ratio)
    for layer_idx in range(1, len(layers)):
        assert seen[layer_idx][:layer_idx] == [k] * layer_idx


@pytest.mark.parametrize("name", ["topk_gate_layers_recent25", "topk_gate_widest"])
def test_engine_shares_gate_scores_across_ratios_and_matches_the_press_prefill(name):
    model, n = tiny_model("llama"), 96
    ids = random_ids(n, seed=4)
    gates = random_gates(model)
    presses = [get_press(name, r, gates=gates) for r in (0.5, 0.75, 0.9)]
    shared = Prefill(model, ids, presses)
    assert shared.prefills == 1 and [key[0] for key in shared.stored] == ["gate"]  # one prefill, one set of scores
    for press in presses:
        ours = shared.compress(press)
        theirs = press_prefill(model, ids, get_press(name, press.compression_ratio, gates=gates))
        assert shared.prefills == 1
        for a, b in zip(ours.layers, theirs.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_names_and_refusals():
    assert isinstance(get_press("topk_gate_layers", 0.5), LayerGatePress)
    assert get_press("topk_gate_layers_recent25", 0.5).window == 0.25
    assert isinstance(get_press("topk_gate_layers", 0.5), GatePress)
    with pytest.raises(ValueError, match="window"):
        LayerGatePress(compression_ratio=0.5, window=1.5)
    model = tiny_model("llama")
    press = LayerGatePress(compression_ratio=0.5, gates=random_gates(model))
    with pytest.raises(ValueError, match="batch size 1"):
        with press(model):
            model.model(input_ids=torch.cat([random_ids(16)] * 2), past_key_values=DynamicCache())
