"""No attention backend is handed a float mask of a dtype other than the query's (issue 25 item 2):
CUDA's memory-efficient kernel refuses one. A spy on ``scaled_dot_product_attention`` records every
call; bfloat16 and float16 models; SamplingPress with both bias dtypes, SamplingDecodingPress, and the
engine's batched decoding. And the float32 bias keeps its precision: against a float64 reference."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_model
from kvpress import PrefillDecodingPress, SnapKVPress
from transformers import DynamicCache

from evaluation.engine import Compressed, generate_batch
from kvpress_prob import SamplingPress
from kvpress_prob.correction import corrected_attention as attention
from kvpress_prob.correction import bias as correction
from kvpress_prob.decoding.press import SamplingDecodingPress
from kvpress_prob.presses.sampling import language_model

HALF = [torch.bfloat16, torch.float16]


@pytest.fixture
def spy(monkeypatch):
    """Every float mask scaled_dot_product_attention receives: (query dtype, mask dtype, from the correction)."""
    seen, original = [], F.scaled_dot_product_attention
    inside = [False]
    corrected = attention.corrected_sdpa

    def corrected_spy(*args, **kwargs):
        inside[0] = True
        try:
            return corrected(*args, **kwargs)
        finally:
            inside[0] = False

    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            seen.append((query.dtype, attn_mask.dtype, inside[0]))
        return original(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(attention, "corrected_sdpa", corrected_spy)
    return seen


def check(seen, corrected_calls: int):
    assert sum(1 for *_, ours in seen if ours) >= corrected_calls  # the correction did run
    wrong = [(q, m) for q, m, _ in seen if q != m]
    assert not wrong, f"float masks of another dtype than the query's: {wrong[:3]}"


def decode(model, cache, ids, start: int, steps: int):
    for t in range(start, start + steps):
        model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias_dtype", ["keys", "float32"])
def test_sampling_press_decodes_with_masks_of_the_query_dtype(spy, dtype, bias_dtype):
    model = tiny_model("llama", dtype=dtype)
    ids = random_ids(40, seed=1)
    press = SamplingPress(compression_ratio=0.5, bias_dtype=bias_dtype, seed=0)
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            model.model(ids[:, :32], past_key_values=cache)
        want = torch.float32 if bias_dtype == "float32" else dtype
        assert correction.bias_of(language_model(model).layers[0].self_attn, cache).dtype == want
        decode(model, cache, ids, 32, 4)
    check(spy, corrected_calls=4 * 3)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_sampling_decoding_press_float32_bias_meets_masks_of_the_query_dtype(spy, dtype):
    model = tiny_model("llama", dtype=dtype)
    ids = random_ids(64, seed=2)
    prefill = SamplingPress(compression_ratio=0.5, budget="head", seed=1)
    decoding = SamplingDecodingPress(target_size=20, compression_interval=6, hidden_states_buffer_size=6,
                                     n_sink=2, window=4, seed=2)
    cache = DynamicCache()
    with torch.no_grad(), PrefillDecodingPress(prefilling_press=prefill, decoding_press=decoding)(model):
        model(ids[:, :40], past_key_values=cache)
        decode(model, cache, ids, 40, 14)  # two decoding rounds
    bias = correction.bias_of(language_model(model).layers[0].self_attn, cache)
    assert bias is not None and bias.dtype == torch.float32  # the decoding press stores float32
    check(spy, corrected_calls=14 * 3)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_batched_decoding_masks_have_the_query_dtype(spy, dtype, tokenizer):
    """A float32-bias SamplingPress beside a top-k press in one batch: ``stack`` keeps the bias float32."""
    model = tiny_model("llama", dtype=dtype)
    ids = random_ids(48, seed=3)
    layers = language_model(model).layers
    items = []
    for press in (SamplingPress(compression_ratio=0.5, bias_dtype="float32", seed=0), SnapKVPress(compression_ratio=0.5, window_size=8)):
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model.model(ids[:, :40], past_key_values=cache)
        items.append(Compressed.take(cache, layers))
    assert items[0].bias[0].dtype == torch.float32
    generate_batch(model, tokenizer, ids[:, 40:44], items, context_length=40, max_new_tokens=3)
    check(spy, corrected_calls=3 * 3)


def dense(q, k, v, log_w):
    """softmax(k q / sqrt(d) + log w) v in float64: q (d,), k, v (n, d), log_w (n,)."""
    q, k, v, log_w = (x.double() for x in (q, k, v, log_w))
    return torch.softmax(k @ q / math.sqrt(q.shape[-1]) + log_w, -1) @ v


def test_a_float32_bias_beside_bfloat16_keeps_float32_precision():
    """bfloat16 q, k, v and a float32 bias in [16, 16.5): bfloat16's step there is 0.125, so a bias
    rounded to the query's dtype loses the differences that weight the values. The
    SDPA route computes in float32 (its mask float32 beside a float32 query) and the fused route adds
    the bias in float32: both stay within bfloat16's output rounding (2^-8) of the float64 attention
    of the same inputs, while the rounded bias misses it by more than 4x that."""
    g = torch.Generator().manual_seed(0)
    n, d = 256, 16
    k = (0.05 * torch.randn(1, 1, n + 1, d, generator=g)).bfloat16()
    q = torch.randn(1, 1, 1, d, generator=g).bfloat16()
    bias = (16.0 + 0.5 * torch.rand(n, generator=g))[None, None]  # (1, 1, n) float32
    e = bias[0, 0].bfloat16().float() - bias[0, 0]  # what rounding to bfloat16 (ulp 0.125 there) would add
    v = torch.zeros(1, 1, n + 1, d)
    v[0, 0, :n, 0] = (e - e.mean()) / e.std()  # the values follow the rounding: it moves the output
    v[0, 0, :n, 1:] = torch.randn(n, d - 1, generator=g).clamp(-1, 1)
    v = v.bfloat16()
    reference = dense(q[0, 0, 0], k[0, 0], v[0, 0], torch.cat([bias[0, 0].double(), torch.zeros(1, dtype=torch.float64)]))
    rounded = dense(q[0, 0, 0], k[0, 0], v[0, 0], torch.cat([bias[0, 0].bfloat16().double(), torch.zeros(1, dtype=torch.float64)]))
    ours = attention.corrected_sdpa(q, k, v, bias, None)[0, 0, 0]
    from kvpress_prob.correction import corrected_flex as flex

    theirs = flex.flex_corrected(q, k, v, bias, None)[0, 0, 0]
    assert ours.dtype == theirs.dtype == torch.bfloat16
    err_ours = (ours.double() - reference).abs().max().item()
    err_fused = (theirs.double() - reference).abs().max().item()
    err_rounded = (rounded - reference).abs().max().item()
    assert err_ours <= 2**-8 and err_fused <= 2**-8
    assert err_rounded > 4 * 2**-8
