"""Presses evicting into the ragged cache (kvpress_prob/presses/ragged_presses.py): each stores exactly its kept set
(read back entry by entry against the full prefill), holds exactly those entries' bytes, and decodes as an
independent path does: the padded SamplingPress on the same draw, a float64 dense reference with explicit per-head
masks, kvpress's own masked AdaKV."""

import pytest
import torch
from kvpress import AdaKVPress, SnapKVPress
from kvpress.utils import compute_n_kept

from evaluation.engine import Prefill, press_prefill, teacher_forced
from kvpress_prob.cache import RaggedLayer
from kvpress_prob.names.grid import parse_name
from kvpress_prob.names.registry import get_press
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.presses.per_head import kvpress_count_ratio
from kvpress_prob.presses.ragged_presses import KVzipRaggedPress, RaggedAdaKVPress, RaggedSamplingPress, held_bytes
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.testing.reference import dense_reference, float64_copy, masked_keep
from tests.conftest import random_ids, tiny_model

N = 96  # context length: above SnapKV's window of 64


def _stored_exactly(cache, full, keep, log_weight=None):
    """Every layer is a RaggedLayer whose head h holds, in prefix order, the full prefill's K and V at the
    positions keep[l, 0, h] marks (an explicit loop), with log_weight there as its bias; and nothing more."""
    for l, layer in enumerate(cache.layers):
        assert isinstance(layer, RaggedLayer)
        for h in range(len(layer.lengths)):
            k, v, bias = layer.head(h)
            positions = [i for i in range(N) if keep[l, 0, h, i]]
            assert len(positions) == len(k)
            assert torch.equal(k, full.layers[l].keys[0, h, positions])
            assert torch.equal(v, full.layers[l].values[0, h, positions])
            if log_weight is not None and bias is not None:
                assert torch.equal(bias, log_weight[l, 0, h, positions].to(bias.dtype))
        d, size = layer.flat_keys.shape[-1], layer.flat_keys.element_size()
        kv, bias_bytes = held_bytes(layer)
        slots = sum(layer.capacity)  # the kept entries, and after decoding the slots of appended tokens
        assert slots == sum(layer.lengths) or layer.appended > 0
        assert kv == 2 * slots * d * size  # exactly the kept entries' K and V (and the appended slots)
        assert bias_bytes == (0 if layer.bias is None else slots * layer.bias.element_size())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prob_min_h_ragged_stores_its_draw_and_decodes_as_the_padded_press(dtype):
    """The same draw (the padded press at the ragged press's draw ratio, same seed), stored without padding, with
    the bias in the keys' dtype; its logits equal the padded corrected route's: in fp32 within 1e-4 of their
    scale, in bf16 no further from the fp32 logits than twice the padded route's bf16 error."""
    r, seed = 0.75, 3
    logits = {}
    for dt in dict.fromkeys([torch.float32, dtype]):
        model = tiny_model("llama", dt)
        ids, fed = random_ids(N, seed=21), random_ids(6, seed=22)
        ragged = get_press("prob_min_h_ragged", r, seed=seed)
        assert isinstance(ragged, RaggedSamplingPress) and ragged.budget == "global"
        padded = get_press("prob_min_h", kvpress_count_ratio(N, r), seed=seed)
        cache, padded_cache = press_prefill(model, ids, ragged), press_prefill(model, ids, padded)
        assert torch.equal(ragged.last_draw.keep, padded.last_draw.keep)
        keep = ragged.last_draw.keep
        assert len({tuple(layer.lengths) for layer in cache.layers} | {c for layer in cache.layers
                                                                         for c in layer.lengths}) > 2  # ragged
        _stored_exactly(cache, press_prefill(model, ids, None), keep, ragged.last_draw.log_weight)
        assert all(layer.bias is not None and layer.bias.dtype == dt for layer in cache.layers)
        assert ragged.stats["bytes_stored"] == 2 * int(keep.sum()) * 16 * torch.finfo(dt).bits // 8
        assert ragged.stats["bytes_stored"] < padded.stats["bytes_stored"]  # the padded press pads
        logits[dt] = (teacher_forced(model, cache, fed, N)[0], teacher_forced(model, padded_cache, fed, N)[0])
    a, b = logits[torch.float32]
    scale = b.abs().max()
    assert (a - b).abs().max() <= 1e-4 * scale
    if dtype != torch.float32:
        ragged_err = (logits[dtype][0] - b).abs().max()
        padded_err = (logits[dtype][1] - b).abs().max()
        assert ragged_err <= 2 * padded_err


def test_prob_min_h_ragged_nocorr_matches_a_float64_dense_reference():
    """Without the correction the ragged cache is attention over exactly the kept entries: the float64 dense
    model with the same per-head masks gives the same logits within 1e-4 of their scale."""
    model = tiny_model("qwen3")
    model64 = float64_copy(model)
    ids, fed = random_ids(N, seed=23), random_ids(5, seed=24)
    press = get_press("prob_min_h_ragged_nocorr", 0.5, seed=1)
    cache = press_prefill(model, ids, press)
    assert all(layer.bias is None for layer in cache.layers) and press.stats["bytes_bias"] == 0
    got, _ = teacher_forced(model, cache, fed, N)
    reference = dense_reference(model64, ids, fed, press.last_draw.keep).float()
    full = dense_reference(model64, ids, fed, None).float()
    assert (full - reference).abs().max() > 1e-2  # the evicted entries matter
    assert (got - reference).abs().max() <= 1e-4 * reference.abs().max()


@pytest.mark.parametrize("name", ["cross_kvzip_block1_a75_toprest_ragged", "cross_kvzip_block4_a50_ragged"])
def test_cross_kvzip_ragged_keeps_each_head_its_count_in_kvzip_global_top(name):
    """Each head keeps its count in KVzip's global top L H compute_n_kept(n, r) (snapkv's total), its top
    alpha-share of KVzip's scores among them; stored exactly; decodes as the float64 dense reference with its
    per-head masks (toprest: no bias) or differs from it only by its weights (sampled rest)."""
    model, r = tiny_model("llama"), 0.75
    model64 = float64_copy(model)
    ids, fed = random_ids(N, seed=25), random_ids(5, seed=26)
    kvzip_scoring.clear_scores()
    press = get_press(name, r)
    assert isinstance(press, KVzipRaggedPress)
    cache = press_prefill(model, ids, press)
    scores = kvzip_scoring.SCORES.stored()[0].float().clone()  # (L, 1, H, n)
    scores[..., : press.n_sink] = scores.amax() + 1
    L, _, H, n = scores.shape
    ranked = scores.reshape(-1).argsort(descending=True)[: L * H * compute_n_kept(n, r)]
    counts = torch.bincount(ranked // n, minlength=L * H).view(L, H)  # explicit: the global top's share per head
    assert [list(layer.lengths) for layer in cache.layers] == counts.tolist() == press.kept
    keep = torch.zeros(L, 1, H, n, dtype=torch.bool)
    assert len(set(counts.flatten().tolist())) > 1  # the heads keep different counts
    full = press_prefill(model, ids, None)
    for l in range(L):
        for h in range(H):
            k = int(counts[l, h])
            flat = full.layers[l].keys[0, h]
            stored = cache.layers[l].head(h)[0]
            rows = [i for i in range(n) if any(torch.equal(flat[i], s) for s in stored)]
            keep[l, 0, h, rows] = True
            if name.endswith("toprest_ragged"):  # block1: the top floor(0.75 k) by KVzip are in the set
                top = scores[l, 0, h].argsort(descending=True)[: int(0.75 * k)].tolist()
                assert set(top) <= set(rows)
    _stored_exactly(cache, full, keep)
    got, _ = teacher_forced(model, cache, fed, N)
    reference = dense_reference(model64, ids, fed, keep).float()
    if "toprest" in name:
        assert all(layer.bias is None for layer in cache.layers)
        assert (got - reference).abs().max() <= 1e-4 * reference.abs().max()
    else:
        assert any(layer.bias is not None for layer in cache.layers)  # the sampled rest carries its weights


def test_adakv_ragged_evicts_kvpress_adakv_set_and_decodes_as_its_masks():
    """kvpress's AdaKVPress(SnapKVPress) masks a set; adakv_snapkv_ragged stores exactly that set (from its own
    prefill and from the engine's shared prefill) and gives kvpress's masked logits within 1e-4 of their scale."""
    model = tiny_model("llama")
    layers = language_model(model).layers
    ids, fed = random_ids(N, seed=27), random_ids(4, seed=28)
    masked_cache = press_prefill(model, ids, AdaKVPress(press=SnapKVPress(compression_ratio=0.75)))
    keep = masked_keep(layers, N)
    masked, _ = teacher_forced(model, masked_cache, fed, N)
    for layer in layers:
        del layer.self_attn.masked_key_indices
    press = get_press("adakv_snapkv_ragged", 0.75)
    assert isinstance(press, RaggedAdaKVPress)
    cache = press_prefill(model, ids, press)
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in layers)  # no mask
    _stored_exactly(cache, press_prefill(model, ids, None), keep)
    assert len({c for layer in cache.layers for c in layer.lengths}) > 1
    got, _ = teacher_forced(model, cache, fed, N)
    assert (got - masked).abs().max() <= 1e-4 * masked.abs().max()
    replayed = Prefill(model, ids, [press]).compress(press)
    assert [layer.lengths for layer in replayed.layers] == [layer.lengths for layer in cache.layers]
    assert all(torch.equal(a.head(h)[0], b.head(h)[0]) for a, b in zip(replayed.layers, cache.layers) for h in range(2))


@pytest.mark.parametrize("name", ["prob_min_h_ragged", "cross_kvzip_block1_a75_toprest_ragged", "adakv_snapkv_ragged",
                                  "adakv_expected_attention_ragged", "prob_min_h_block8_priority_ragged"])
def test_ragged_names_read_back(name):
    assert "ragged" in parse_name(name).options


@pytest.mark.parametrize("name", ["prob_kvzip_ragged", "cross_keydiff_block8_a50_ragged", "snapkv_ragged",
                                  "cross_kvzip_block1_a75_toprest_widest_ragged", "topk_min_h_ragged",
                                  "prob_min_h_span8_priority_nowiden_ragged", "prob_min_h_ragged_sum4"])
def test_ragged_names_refused(name):
    with pytest.raises(ValueError, match="ragged|does not apply|out of order"):
        parse_name(name)


def test_kvzip_ragged_refuses_a_sampler_without_per_head_counts():
    from kvpress_prob.samplers import TopKSampler

    with pytest.raises(ValueError, match="keep_counts"):
        KVzipRaggedPress(compression_ratio=0.5, sampler=TopKSampler())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_ragged_keeps_the_gates_global_top_per_head_under_generate(dtype):
    """topk_gate_ragged: each head keeps its share of the global top L H compute_n_kept(n, r) of the gates' scores
    on an independent plain prefill (sinks pinned: an explicit ranking), stored exactly, under model.generate."""
    from kvpress_prob.learned import labels as lb
    from kvpress_prob.learned import training as tr
    from kvpress_prob.presses.gate import GatePress
    from kvpress_prob.presses.ragged_presses import RaggedGatePress
    from tests.test_gate import random_gates

    model, ratio = tiny_model("llama", dtype=dtype), 0.75
    ids = random_ids(N, seed=29)
    gates = random_gates(model)
    scores = GatePress(gates=gates).pinned(tr.gate_scores(gates, lb.attention_inputs(model, ids))[:, None])
    L, _, H, n = scores.shape
    ranked = scores.reshape(-1).argsort(descending=True, stable=True)[: L * H * compute_n_kept(n, ratio)]
    keep = torch.zeros(L * H * n, dtype=torch.bool)
    keep[ranked] = True
    keep = keep.view(L, 1, H, n)
    press = get_press("topk_gate_ragged", ratio, gates=gates)
    assert isinstance(press, RaggedGatePress)
    with press(model):
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, pad_token_id=2)
    assert press.kept == keep.sum(-1)[:, 0].tolist() and len({c for row in press.kept for c in row}) > 1
    cache = out.past_key_values
    assert all(layer.appended == 2 and layer.get_seq_length() == N + 2 for layer in cache.layers)
    _stored_exactly(cache, press_prefill(model, ids, None), keep)
