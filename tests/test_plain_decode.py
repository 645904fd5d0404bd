"""A top-k cache decodes as kvpress's: no bias is stored where every kept weight is 1 and a layer holds no
padding, and every later forward runs the model's own attention function (the corrected ones never run), in
float32, bfloat16 and float16. Layers of different lengths (KVzip's widest allocation) get a mask of their own
length in a forward of several tokens, and the logits match a float64 dense reference with explicit weights."""

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from evaluation.engine import press_prefill
from kvpress_prob import attention_dispatch
from kvpress_prob.correction import bias as correction
from kvpress_prob.correction import corrected_attention as attention
from kvpress_prob.correction import corrected_flex as flex
from kvpress_prob.names.registry import get_press
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.presses.allocations import allocation_keep, evict_keep
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.testing.reference import dense_reference, float64_copy
from tests.conftest import random_ids, tiny_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def spy(monkeypatch):
    """The query lengths the model's own sdpa function ran with; the corrected functions raise if called."""
    calls = []

    def own(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((query.shape[2], key.shape[2], attention_mask is None))
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("the corrected attention ran on a top-k cache")

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", own)
    monkeypatch.setattr(attention, "corrected_sdpa", refused)
    monkeypatch.setattr(flex, "flex_corrected", refused)
    return calls


def _no_bias(model, cache):
    return all(correction.bias_of(layer.self_attn, cache) is None for layer in language_model(model).layers)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_widest_stores_no_bias(dtype):
    model = tiny_model("llama", dtype)
    kvzip_scoring.clear_scores()
    cache = press_prefill(model, random_ids(64, seed=3), get_press("topk_kvzip_widest", 0.5))
    assert _no_bias(model, cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layers_of_different_lengths_decode_through_the_models_sdpa(spy, dtype):
    """An eviction to widths 40, 24 and 32 per head (``evict_keep``, as widest evicts), then a forward of 5
    tokens and 3 decoding steps: each runs the model's sdpa on its layer's own length."""
    model, n = tiny_model("llama", dtype), 64
    modules = [layer.self_attn for layer in language_model(model).layers]
    cache = press_prefill(model, random_ids(n, seed=3), None)
    g = torch.Generator().manual_seed(0)
    keep = torch.zeros(len(modules), 1, 2, n, dtype=torch.bool)
    for layer, width in enumerate([40, 24, 32]):
        for head in range(2):
            keep[layer, 0, head, torch.randperm(n, generator=g)[:width]] = True
    evict_keep(cache, modules, keep)
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    assert lengths == [40, 24, 32] and _no_bias(model, cache)
    spy.clear()
    fed = random_ids(5, seed=4)
    out = model(input_ids=fed, past_key_values=cache, position_ids=torch.arange(n, n + 5)[None])
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(3):
        out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[n + 5 + step]]))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    assert [c[0] for c in spy] == [5] * 3 + [1] * 9
    assert [k for _, k, _ in spy[:3]] == [length + 5 for length in lengths]
    assert all(mask_none for q, _, mask_none in spy if q == 1)  # a decoding step: no mask, any kernel
    assert torch.isfinite(out.logits).all() and _no_bias(model, cache)


def test_widest_matches_a_float64_reference_with_explicit_weights():
    model, n, t = tiny_model("llama"), 64, 6
    model64 = float64_copy(model)
    ids, fed = random_ids(n, seed=5), random_ids(t, seed=6)
    press = get_press("topk_kvzip_widest", 0.5)
    kvzip_scoring.clear_scores()
    cache = press_prefill(model, ids, press)
    scores = kvzip_scoring.SCORES.stored()[0].float().clone()  # (L, 1, H_kv, n), the sinks raised as the press does
    scores[..., : press.n_sink] = scores.amax() + 1
    keep = allocation_keep(scores, 0.5, "widest")
    assert len({int(k.sum()) for k in keep}) > 1  # layers of different widths
    got = model(input_ids=fed, past_key_values=cache, position_ids=torch.arange(n, n + t)[None]).logits[0].double()
    reference = dense_reference(model64, ids, fed, keep)
    full = dense_reference(model64, ids, fed, None)
    error = (got - reference).abs().max().item()
    assert error < 1e-4 * reference.abs().max().item(), error  # float32 rounding of logits of size ~1
    assert (full - reference).abs().max().item() > 100 * error  # the eviction itself shows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_topk_sampling_press_under_generate_holds_no_bias(spy, dtype):
    model, n = tiny_model("qwen3", dtype), 80
    ids = random_ids(n, seed=7)
    press = get_press("topk_keydiff_block8", 0.5)
    seen = []
    hook = language_model(model).layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(correction.bias_of(module, kwargs["past_key_values"])),
        with_kwargs=True)
    try:
        with press(model):
            model.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=DynamicCache())
    finally:
        hook.remove()
    assert press.stats["bytes_bias"] == 0
    decode = [c for c in spy if c[0] == 1]
    assert decode and all(k <= n // 2 + 3 for _, k, _ in decode)  # the compressed cache decodes
    assert all(b is None for b in seen[1:])  # no forward after the prefill reads a bias


def test_a_sampled_press_keeps_its_bias():
    """The other side: weights that are not all 1 keep their bias and the corrected attention."""
    model, n = tiny_model("llama"), 64
    press = get_press("prob_min_h", 0.5)
    cache = press_prefill(model, random_ids(n, seed=8), press)
    assert not _no_bias(model, cache) and press.stats["bytes_bias"] > 0


def test_a_padded_mask_cannot_be_refitted():
    query, key = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 10, 16)
    mask = torch.ones(1, 1, 3, 8, dtype=torch.bool).tril(diagonal=5)
    refit = attention_dispatch.own_length_mask(mask, query, key)
    assert refit.shape == (1, 1, 3, 10) and refit[..., :7].all() and torch.equal(refit[..., 7:], mask[..., 5:])
    mask[..., 0] = False  # a padded stored entry
    with pytest.raises(ValueError, match="padding"):
        attention_dispatch.own_length_mask(mask, query, key)
