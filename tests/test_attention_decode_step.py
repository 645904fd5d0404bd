"""The corrected attention's fast paths (issue 28 item 4) against a slow, obvious float64 reference.

``attention.corrected_sdpa`` decodes one token (q = 1) with a mask that is the bias padded by zeros,
one row per KV head broadcast over its query heads, and several tokens with a mask filled in place.
The reference below does not use a mask at all: it takes the weights w_i = e^{bias_i} explicitly and
computes, per query head and query, sum_i w_i e^{s_i} v_i / sum_i w_i e^{s_i} in float64 over the
stored entries that are not padding, with w = 1 on the new tokens and the causal cut among them.
float32, bfloat16 and float16 queries; a bias in the query's dtype or float32 (upcast: the bias is
added in float32); GQA; batch 2 with different padding per row; 1 to 6 tokens appended since the
round. No timing here: speed is measured by the decode-speed bench only."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_model
from transformers import DynamicCache

from kvpress_prob.correction import corrected_attention as attention
from kvpress_prob.correction import bias as correction
from kvpress_prob.decoding.press import SamplingDecodingPress
from kvpress_prob.presses.sampling import language_model


def weighted_reference(query, key, value, weights, stored: int):
    """float64 softmax attention with explicit weights: weights (b, H_kv, S) >= 0 (0: padding) on the
    S stored entries, 1 on the new ones; query j of q sees the new tokens up to its own position."""
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    out = torch.zeros(b, q_len, hq, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(q_len):
                seen = stored + (k_len - stored - q_len) + i + 1
                num = torch.zeros(d, dtype=torch.float64)
                den = 0.0
                logits = [float(key[bi, kv, j].double() @ query[bi, h, i].double()) / math.sqrt(d) for j in range(seen)]
                top = max(logits)
                for j in range(seen):
                    w = float(weights[bi, kv, j]) if j < stored else 1.0
                    e = w * math.exp(logits[j] - top)
                    num += e * value[bi, kv, j].double()
                    den += e
                out[bi, i, h] = num / den
    return out


def case(dtype, bias_dtype, q_len, n_new, seed=0):
    """b = 2, H_q = 6 over H_kv = 2, S = 20 stored entries (row 1 padded from 13 on), n_new new tokens
    of which the last q_len are the queries. Weights 1/(q1 q2), two rounds' inclusion probabilities."""
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, s, d = 2, 6, 2, 20, 16
    query = torch.randn(b, hq, q_len, d, generator=g).to(dtype)
    key = torch.randn(b, hkv, s + n_new, d, generator=g).to(dtype)
    value = torch.randn(b, hkv, s + n_new, d, generator=g).to(dtype)
    q1, q2 = torch.rand(b, hkv, s, generator=g) * 0.9 + 0.05, torch.rand(b, hkv, s, generator=g) * 0.9 + 0.05
    bias = (-torch.log(q1) - torch.log(q2)).to(bias_dtype)
    bias[1, :, 13:] = correction.padding(bias_dtype)
    weights = torch.where(correction.is_padding(bias), 0.0, bias.double().exp())  # the weights the bias stores
    return query, key, value, bias, weights


#: the output's rounding in the query's dtype (|out| <= ~2): 2^-23, 2^-8, 2^-11 relative, with room for the
#: kernel's accumulation in that dtype
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-8}
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float16), (torch.float16, torch.float32)]
IDS = ["fp32", "bf16", "bf16-biasfp32", "fp16", "fp16-biasfp32"]


@pytest.mark.parametrize("dtype,bias_dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("q_len,n_new", [(1, 1), (1, 6), (3, 3), (3, 5)])
def test_corrected_attention_equals_the_explicit_weights(dtype, bias_dtype, q_len, n_new):
    query, key, value, bias, weights = case(dtype, bias_dtype, q_len, n_new)
    want = weighted_reference(query, key, value, weights, bias.shape[-1])
    got = attention.corrected_sdpa(query, key, value, bias, None)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=0)


def test_reference_is_not_plain_attention():
    """The weights matter in this case: plain attention over the same entries misses the reference by far
    more than the tolerance (so the test above could fail)."""
    query, key, value, bias, weights = case(torch.float32, torch.float32, 1, 4)
    want = weighted_reference(query, key, value, weights, bias.shape[-1])
    ones = weighted_reference(query, key, value, (weights > 0).double(), bias.shape[-1])
    assert (want - ones).abs().max() > 100 * TOL[torch.float32]


@pytest.mark.parametrize("dtype,bias_dtype", DTYPES, ids=IDS)
def test_one_token_step_runs_the_fast_path_with_a_mask_of_the_query_dtype(dtype, bias_dtype, monkeypatch):
    """A one-token step hands scaled_dot_product_attention one (b, H_kv, 1, k) row per KV head, in the
    dtype the attention computes in (the query's, or float32 beside a float32 bias)."""
    seen, original = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        seen.append((tuple(attn_mask.shape), attn_mask.dtype, q.dtype))
        return original(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    query, key, value, bias, _ = case(dtype, bias_dtype, 1, 4)
    attention.corrected_sdpa(query, key, value, bias, None)
    work = torch.promote_types(dtype, bias_dtype)
    assert seen == [((2, 2, 1, 24), work, work)]


def test_decoding_press_leaves_nothing_on_a_plain_forward(monkeypatch):
    """After a corrected SamplingDecodingPress decoded one cache, a fresh cache decoded without the press
    runs transformers' own attention (no float mask of ours), and the compressed cache still carries its bias."""
    model = tiny_model("llama")
    ids = random_ids(48, seed=3)
    press = SamplingDecodingPress(target_size=16, compression_interval=4, hidden_states_buffer_size=4, n_sink=2,
                                  window=4, proposal="min_variance", floor=0.2, seed=0)
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            model(ids[:, :24], past_key_values=cache)
            for t in range(24, 32):
                model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))
        attn = language_model(model).layers[0].self_attn
        assert correction.bias_of(attn, cache) is not None
        calls = []
        original = attention.corrected_sdpa
        monkeypatch.setattr(attention, "corrected_sdpa", lambda *a, **k: calls.append(1) or original(*a, **k))
        other = DynamicCache()
        model(ids[:, :24], past_key_values=other)
        model(ids[:, 24:25], past_key_values=other, position_ids=torch.tensor([[24]]))
        assert calls == []
        model(ids[:, 32:33], past_key_values=cache, position_ids=torch.tensor([[32]]))
        assert len(calls) == len(language_model(model).layers)
