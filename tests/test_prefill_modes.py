"""How a SamplingPress's prefill holds the cache (kvpress_prob.presses.prefill_modes, docs/research/README.md):
per-layer cuts for a per-layer / per-head budget, and the global budget's recompute, deferred and
offload modes."""

import gc
import math

import pytest
import torch
from conftest import random_ids, tiny_model
from test_press import greedy
from kvpress import KVPressTextGenerationPipeline
from scipy.optimize import brentq
from transformers import DynamicCache

from kvpress_prob import SamplingPress, get_press
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.presses.prefill_modes import PREFILL_MODES
from kvpress_prob.samplers import PoissonSampler

from evaluation.engine import Prefill

N = 160
RATIO = 0.5


def prefill(model, press, ids):
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache



def proposals(model, press, ids) -> dict:
    """Each layer's proposal (b, H, n), from the engine's shared prefill (the press's public ``propose``)."""
    return Prefill(model, ids, [press]).proposals_of(press)


def kept_per_layer(press) -> list[int]:
    return [sum(heads) for heads in press.stats["kept"]]


# --- budget="layer" / "head": each layer cut at its own hook ----------------------------------------

def test_per_layer_cuts_keep_the_expected_count_of_the_old_deferred_draw():
    """Per layer, the mean kept count over seeds of the hook path (each layer drawn at its hook from its
    own generator) and of the old deferred draw (the sampler on every layer at once, one generator)
    both match the budget's expectation sum_i q_i, q_i = 1 - exp(-m pi_i) with m solved here by
    scipy's brentq. Counts are sums of independent Bernoulli(q_i): each mean over S seeds has variance
    sum_i q_i (1 - q_i) / S; the tolerance is 4.5 standard errors (the difference: 4.5 sqrt(2))."""
    model = tiny_model("llama")
    ids = random_ids(N, seed=1)
    pi = proposals(model, get_press("prob_snapkv", RATIO, budget="layer"), ids)
    modules = sorted(pi, key=lambda m: m.layer_idx)
    stacked = torch.stack([pi[m] for m in modules]).double()  # (L, 1, H, n)
    L, _, H, n = stacked.shape
    target = (1 - RATIO) * n * H
    variance = []
    for layer in range(L):
        p = stacked[layer, 0]
        m = brentq(lambda m: float((1 - torch.exp(-m * p)).sum()) - target, 1e-9, 1e9, xtol=1e-12)
        q = 1 - torch.exp(-m * p)
        assert float(q.sum()) == pytest.approx(target, rel=1e-9)
        variance.append(float((q * (1 - q)).sum()))
    seeds = 60
    hook, deferred = torch.zeros(L), torch.zeros(L)
    for seed in range(seeds):
        press = get_press("prob_snapkv", RATIO, budget="layer", seed=seed)
        prefill(model, press, ids)
        hook += torch.tensor(kept_per_layer(press), dtype=torch.float64).float()
        old = PoissonSampler()(stacked, RATIO, "layer", torch.Generator().manual_seed(seed))
        deferred += old.keep[:, 0].sum((-1, -2)).float()
    hook, deferred = hook / seeds, deferred / seeds
    for layer in range(L):
        se = math.sqrt(variance[layer] / seeds)
        assert abs(hook[layer] - target) < 4.5 * se, (layer, float(hook[layer]), target, se)
        assert abs(deferred[layer] - target) < 4.5 * se
        assert abs(hook[layer] - deferred[layer]) < 4.5 * math.sqrt(2) * se


@pytest.mark.parametrize("budget", ["layer", "head"])
def test_a_layers_draw_does_not_depend_on_the_order_of_layers(budget):
    """The hook path (layers cut in order at their hooks), the engine's replay (``evict`` given every
    layer) and ``evict`` called one layer at a time in reverse order keep the same sets and weights."""
    model = tiny_model("qwen3")
    ids = random_ids(N, seed=2)
    press = get_press("prob_min_h", RATIO, budget=budget, seed=5)
    cache = prefill(model, press, ids)
    hook_keep, hook_weight = press.last_draw.keep.clone(), press.last_draw.log_weight.clone()

    shared = Prefill(model, ids, [press])
    replayed = shared.compress(press)
    assert torch.equal(press.last_draw.keep, hook_keep) and torch.equal(press.last_draw.log_weight, hook_weight)
    for a, b in zip(cache.layers, replayed.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    pi = shared.proposals_of(press)
    reverse = shared.compress(None)
    for module in sorted(pi, key=lambda m: m.layer_idx, reverse=True):
        draw = press.evict(reverse, {module: pi[module]})
        assert torch.equal(draw.keep[0], hook_keep[module.layer_idx])
        assert torch.equal(draw.log_weight[0], hook_weight[module.layer_idx])
    for a, b in zip(cache.layers, reverse.layers):
        assert torch.equal(a.keys, b.keys)
    # and a different seed draws differently
    other = get_press("prob_min_h", RATIO, budget=budget, seed=6)
    prefill(model, other, ids)
    assert not torch.equal(other.last_draw.keep, hook_keep)


def test_per_layer_cuts_happen_at_each_layers_own_hook():
    """While layer l runs, every earlier layer already holds only its kept entries."""
    model = tiny_model("llama")
    seen = earlier_lengths(model, get_press("prob_snapkv", RATIO, budget="layer"), random_ids(N))
    assert len(seen) == 3 and all(length < N for lengths in seen for length in lengths) and len(seen[-1]) == 2


def earlier_lengths(model, press, ids, first_forward=False) -> list[list[int]]:
    """At each attention layer's start in the prefill's real forward (or in recompute's first forward),
    the stored length of every earlier layer."""
    seen = []

    def watch(module, args, kwargs):
        if (press._collecting is not None) == first_forward:
            layers = kwargs["past_key_values"].layers
            seen.append([layers[j].keys.shape[2] for j in range(module.layer_idx)])

    handles = [layer.self_attn.register_forward_pre_hook(watch, with_kwargs=True) for layer in language_model(model).layers]
    try:
        prefill(model, press, ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


# --- budget="global": recompute, deferred, offload --------------------------------------------------

@pytest.mark.parametrize("name", ["prob_min_h", "prob_snapkv", "prob_min_h_priority"])
def test_recompute_and_offload_equal_deferred_bit_for_bit(model, name, monkeypatch):
    """The three modes keep the same sets, weights, caches and greedy answer. On a CPU ``to_host`` returns the
    tensor itself, so offload would run deferred's path twice: here it returns a distinct copy (as the pinned
    host copy on CUDA is), and the test checks that every layer's full keys and values went through it, that
    the draw and the cut ran on those copies (the cache held them), and that ``bring_back`` was called for
    every layer. The device transfer and the lower peak are checked on CUDA
    (``test_offload_lowers_the_cuda_peak_and_equals_deferred``)."""
    import kvpress_prob.presses.prefill_modes as modes

    copies, held, brought = [], [], []

    def distinct_copy(tensor):
        copies.append(tensor.clone())
        return copies[-1]

    def spy_evict(self, cache, pending):
        if self.prefill == "offload":
            held.append([t for layer in cache.layers for t in (layer.keys, layer.values)])
        return evict(self, cache, pending)

    def spy_bring_back(cache, modules, devices):
        brought.append([m.layer_idx for m in modules])
        return bring_back(cache, modules, devices)

    evict, bring_back = SamplingPress.evict, modes.bring_back
    monkeypatch.setattr(modes, "to_host", distinct_copy)
    monkeypatch.setattr(SamplingPress, "evict", spy_evict)
    monkeypatch.setattr(modes, "bring_back", spy_bring_back)
    ids = random_ids(N, seed=3)
    out = {}
    for mode in PREFILL_MODES:
        press = get_press(name, RATIO, seed=7, prefill=mode)
        cache = prefill(model, press, ids)
        out[mode] = (press.last_draw.keep.clone(), press.last_draw.log_weight.clone(), cache, greedy(model, cache, N),
                     press.stats)
    keep, weight, cache, answer, stats = out["deferred"]
    for mode in ("recompute", "offload"):
        k, w, c, a, s = out[mode]
        assert torch.equal(k, keep) and torch.equal(w, weight) and a == answer
        assert s["realised_ratio"] == pytest.approx(stats["realised_ratio"], abs=1e-12)
        assert {**s, "realised_ratio": 0} == {**stats, "realised_ratio": 0}  # kept, stored, bytes, the design's figures
        for x, y in zip(c.layers, cache.layers):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
    layers = len(cache.layers)
    assert [c.shape[2] for c in copies] == [N] * (2 * layers)  # offload alone: each layer's full K and V, once
    assert len(held) == 1 and all(any(t is c for c in copies) for t in held[0])  # the draw ran on the copies
    assert brought == [list(range(layers))]


def test_recompute_holds_one_full_layer_at_a_time():
    """Recompute's real forward sees every earlier layer already cut, and its first forward empties each
    layer after its hook; deferred holds every layer full until the last one."""
    model = tiny_model("llama")
    recompute = earlier_lengths(model, get_press("prob_min_h", RATIO, prefill="recompute"), random_ids(N))
    first = earlier_lengths(model, get_press("prob_min_h", RATIO, prefill="recompute"), random_ids(N), first_forward=True)
    deferred = earlier_lengths(model, get_press("prob_min_h", RATIO, prefill="deferred"), random_ids(N))
    assert len(recompute) == len(first) == len(deferred) == 3 and len(recompute[-1]) == 2
    assert all(0 < length < N for lengths in recompute for length in lengths)
    assert all(length == 0 for lengths in first for length in lengths)
    assert all(length == N for lengths in deferred for length in lengths)


def test_recompute_through_the_pipeline_and_generate_equals_deferred(tokenizer):
    model = tiny_model("qwen3")
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context = "The quick brown fox jumps over the lazy dog. " * 20
    answers, keeps = {}, {}
    for mode in ("deferred", "recompute"):
        press = get_press("prob_min_h", RATIO, seed=2, prefill=mode)
        answers[mode] = pipe(context, question="What jumps?", press=press, max_new_tokens=8)["answer"]
        keeps[mode] = press.last_draw.keep.clone()
    assert answers["deferred"] == answers["recompute"] and torch.equal(keeps["deferred"], keeps["recompute"])
    ids = random_ids(N, seed=4)
    generated = {}
    for mode in ("deferred", "recompute"):
        press = get_press("prob_snapkv", RATIO, seed=2, prefill=mode)
        with torch.no_grad(), press(model):
            generated[mode] = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=2)
        keeps[mode] = press.last_draw.keep.clone()
        assert press.stats["n"] == N
    assert torch.equal(generated["deferred"], generated["recompute"])
    assert torch.equal(keeps["deferred"], keeps["recompute"])


def test_a_summary_press_under_recompute_equals_deferred():
    """A SummarySamplingPress draws at its own ratio r + c / n: the shared global draw is memoised per ratio."""
    from kvpress_prob.presses.summary import Summary, summarised

    model = tiny_model("llama")
    ids = random_ids(N, seed=5)
    out = {}
    for mode in ("deferred", "recompute"):
        press = summarised(get_press("prob_snapkv", RATIO, seed=1, prefill=mode), Summary(n_virtual=4))
        cache = prefill(model, press, ids)
        out[mode] = (press.last_draw.keep.clone(), cache, greedy(model, cache, N))
    assert torch.equal(out["deferred"][0], out["recompute"][0]) and out["deferred"][2] == out["recompute"][2]
    for a, b in zip(out["deferred"][1].layers, out["recompute"][1].layers):
        assert torch.equal(a.keys, b.keys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload saves device memory only on CUDA; this machine has none")
def test_offload_lowers_the_cuda_peak_and_equals_deferred():
    model = tiny_model("llama", layers=8).cuda()
    ids = random_ids(2048, seed=6).cuda()
    peaks, keeps = {}, {}
    for mode in ("deferred", "offload"):
        press = get_press("prob_snapkv", RATIO, seed=1, prefill=mode)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        cache = prefill(model, press, ids)
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - start
        keeps[mode] = press.last_draw.keep.clone()
        assert all(layer.keys.device.type == "cuda" for layer in cache.layers)
        del cache
    full = 8 * 2 * 2048 * 16 * 2 * 4  # L x K,V x n x d x H_kv x float32 bytes
    assert torch.equal(keeps["deferred"], keeps["offload"])
    assert peaks["offload"] < peaks["deferred"] - 0.5 * full


# --- no state left, bad values refused --------------------------------------------------------------

@pytest.mark.parametrize("mode,budget", [("recompute", "global"), ("offload", "global"), ("deferred", "global"),
                                         ("recompute", "layer"), ("recompute", "head")])
def test_no_hook_or_state_of_ours_is_left(mode, budget):
    model = tiny_model("llama")
    ids = random_ids(N, seed=8)
    with torch.no_grad():
        reference = model(ids).logits
    modules = [model, language_model(model), *[layer.self_attn for layer in language_model(model).layers]]
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]
    press = get_press("prob_min_h", RATIO, prefill=mode, budget=budget)
    cache = prefill(model, press, ids)
    assert cache.layers[0].keys.shape[2] < N  # it did evict
    del cache
    gc.collect()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules] == before
    assert press._collecting is None and press._recomputed is None and press._devices == {} and press._pending == {}
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference)


def test_a_failed_prefill_under_recompute_leaves_nothing():
    model = tiny_model("llama")
    press = get_press("prob_min_h", RATIO)
    modules = [language_model(model), *[layer.self_attn for layer in language_model(model).layers]]
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]
    with pytest.raises(ValueError, match="batch size 1"):
        with torch.no_grad(), press(model):
            model.model(input_ids=random_ids(2 * N).view(2, N), past_key_values=DynamicCache())
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules] == before
    assert press._collecting is None and press._recomputed is None and press._pending == {}


def test_bad_mode_and_budget_are_refused_with_the_accepted_values():
    with pytest.raises(ValueError, match=r"prefill must be one of \('recompute', 'deferred', 'offload', 'auto'\), got 'lazy'"):
        SamplingPress(compression_ratio=0.5, prefill="lazy")
    with pytest.raises(ValueError, match=r"budget must be one of \('global', 'layer', 'head'\), got 'model'"):
        SamplingPress(compression_ratio=0.5, budget="model")
    with pytest.raises(ValueError, match="prefill must be one of"):
        get_press("prob_min_h", 0.5, prefill="later")


def test_auto_offloads_on_cuda_defers_on_a_cpu_that_holds_the_cache_and_recomputes_otherwise(monkeypatch):
    """Issue 27 item 2: the default prefill runs the model once wherever the full K+V fits."""
    from kvpress_prob.presses import prefill_modes

    monkeypatch.setattr(prefill_modes, "host_available", lambda: 8 * 2**30)
    assert prefill_modes.resolve("auto", "cuda", 100 * 2**30) == "offload"
    assert prefill_modes.resolve("auto", "cpu", 4 * 2**30) == "deferred"
    assert prefill_modes.resolve("auto", "cpu", 4 * 2**30 + 1) == "recompute"
    assert prefill_modes.resolve("recompute", "cuda", 1) == "recompute"
    assert SamplingPress(compression_ratio=0.5).prefill == "auto"
    model = tiny_model("llama")
    runs = []
    handle = model.model.layers[0].self_attn.register_forward_hook(lambda *a: runs.append(1))
    try:
        prefill(model, SamplingPress(compression_ratio=0.5), random_ids(N))  # the default, on this CPU: one forward
        assert len(runs) == 1
        monkeypatch.setattr(prefill_modes, "host_available", lambda: 1000)  # the K+V does not fit: recompute
        prefill(model, SamplingPress(compression_ratio=0.5), random_ids(N))
        assert len(runs) == 3
    finally:
        handle.remove()
