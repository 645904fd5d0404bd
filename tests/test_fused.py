"""The fused corrected attention (FlexAttention, ``kvpress_prob.correction.corrected_flex``; issue 27 item 1) against a
dense float64 reference, in float32 and bfloat16, with GQA, padding, several new tokens (causal among
them) and a compounding bias; and its routing: CUDA and flash-attention models run it, FA2 keeps
the prefill, one log line says so."""

import logging
import math

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob import SamplingPress, attention_dispatch
from kvpress_prob.correction import corrected_attention as attention
from kvpress_prob.correction import bias as correction
from kvpress_prob.correction import corrected_flex as fused


def reference(query, key, value, bias, scale=None):
    """softmax(q k * scale + bias) v in float64, entry by entry: the stored prefix with its bias
    (padding left out), the new tokens with bias 0 and causal. Returns (b, q, H_q, d)."""
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    s = bias.shape[-1]
    scale = scale if scale is not None else 1 / math.sqrt(d)
    out = torch.zeros(b, q_len, hq, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(q_len):
                real = [j for j in range(s) if not bool(correction.is_padding(bias[bi, kv, j]))]
                new = list(range(s, s + (k_len - s - q_len) + i + 1))
                idx = torch.tensor(real + new)
                logits = key[bi, kv, idx].double() @ query[bi, h, i].double() * scale
                logits += torch.cat([bias[bi, kv, real].double(), torch.zeros(len(new), dtype=torch.float64)])
                out[bi, i, h] = torch.softmax(logits, -1) @ value[bi, kv, idx].double()
    return out


def case(dtype, bias_dtype, q_len=3, seed=0):
    """b = 2, H_q = 4 over H_kv = 2 (GQA), S = 24 stored entries, row 1 padded after 17, q_len new
    tokens plus 2 earlier ones; the bias compounds two rounds' log-weights (log 1/q1 + log 1/q2)."""
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, s, d = 2, 4, 2, 24, 16
    k_len = s + 2 + q_len
    query = torch.randn(b, hq, q_len, d, generator=g).to(dtype)
    key = torch.randn(b, hkv, k_len, d, generator=g).to(dtype)
    value = torch.randn(b, hkv, k_len, d, generator=g).to(dtype)
    q1, q2 = torch.rand(b, hkv, s, generator=g) * 0.9 + 0.05, torch.rand(b, hkv, s, generator=g) * 0.9 + 0.05
    bias = (-torch.log(q1) - torch.log(q2)).to(bias_dtype)
    bias[1, :, 17:] = correction.padding(bias_dtype)
    return query, key, value, bias


TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}  # bf16: its output rounding (2^-9 of |out| <= ~2) plus its inputs'


@pytest.mark.parametrize("dtype,bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-biasfp32"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_fused_equals_the_float64_reference(dtype, bias_dtype, q_len):
    query, key, value, bias = case(dtype, bias_dtype, q_len)
    want = reference(query, key, value, bias)
    got = fused.flex_corrected(query, key, value, bias, None)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=0)
    sdpa = attention.corrected_sdpa(query, key, value, bias, None)  # the SDPA route: the same attention
    torch.testing.assert_close(sdpa.double(), want, atol=TOL[dtype], rtol=0)


def test_fused_scale_and_lengths_checked():
    query, key, value, bias = case(torch.float32, torch.float32, 1)
    torch.testing.assert_close(fused.flex_corrected(query, key, value, bias, 0.3).double(),
                               reference(query, key, value, bias, 0.3), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="expects the 1 new tokens after the 40 stored ones"):
        fused.flex_corrected(query, key, value, torch.zeros(2, 2, 40), None)


def test_routing_by_device_implementation_and_mode():
    cpu = torch.zeros(1)
    assert not fused.use_fused(cpu, "sdpa")
    assert fused.use_fused(cpu, "flash_attention_2")
    previous = attention_dispatch.set_route(corrected="fused")
    try:
        assert fused.use_fused(cpu, "sdpa")
        attention_dispatch.set_route(corrected="sdpa")
        assert not fused.use_fused(cpu, "flash_attention_2")
    finally:
        attention_dispatch.set_route(**previous)
    with pytest.raises(ValueError, match="corrected must be one of"):
        attention_dispatch.set_route(corrected="flash")


def test_flash_attention_model_prefills_with_fa2_and_decodes_a_biased_cache_fused(monkeypatch, caplog):
    """An attention function registered as flash_attention_2 (a stand-in: flash_attn is not
    installed here) runs the prefill; the decoding of the compressed cache runs the fused kernel,
    never FA2, and one log line says so; the logits equal the SDPA route's."""
    calls = {"fa2": 0, "fused": 0}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def fake_fa2(module, query, key, value, attention_mask, *args, **kwargs):
        calls["fa2"] += 1
        assert query.shape[2] == key.shape[2] or attention.active_bias(module) is None
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    original = fused.flex_corrected

    def spy(*args, **kwargs):
        calls["fused"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(fused, "flex_corrected", spy)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", attention_dispatch.wrap(fake_fa2, "flash_attention_2"))
    monkeypatch.setattr(fused, "_SAID", set())
    model = tiny_model("llama")
    ids = random_ids(36, seed=4)
    outputs = {}
    for implementation in ("sdpa", "flash_attention_2"):
        model.config._attn_implementation = implementation
        cache = DynamicCache()
        with torch.no_grad():
            with SamplingPress(compression_ratio=0.5, seed=0)(model):
                model.model(ids[:, :32], past_key_values=cache)
            outputs[implementation] = torch.stack([
                model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]])).logits[0, -1]
                for t in range(32, 36)])
        if implementation == "sdpa":
            assert calls == {"fa2": 0, "fused": 0}
    model.config._attn_implementation = "sdpa"
    assert calls["fa2"] == 3  # the prefill's three layers, one forward (the default prefill on a CPU)
    assert calls["fused"] == 4 * 3  # every decoding step of every layer
    said = [r for r in caplog.records if "runs FlexAttention" in r.getMessage()]
    assert len(said) == 1
    torch.testing.assert_close(outputs["flash_attention_2"], outputs["sdpa"], atol=1e-4, rtol=0)
