"""The ragged route's attention (kvpress_prob/cache/ragged_attention.py) against a float64 attention with explicit per-head
masks, on random tensors: fp32 within 1e-5 of the output's scale; bf16 and fp16 no further from the reference than
twice dense SDPA's error on the same entries in the same dtype; one decoding step and several new tokens, with and
without a bias."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvpress_prob.cache import evict_ragged
from kvpress_prob.cache.ragged_attention import ragged_sdpa

H, G, D, N = 2, 3, 16, 40  # KV heads, query heads per KV head, head dim, context length


def _case(q_len: int, earlier: int, with_bias: bool, dtype, seed: int = 0, device: str = "cpu"):
    """A ragged layer of random entries (a different kept count per head, ``earlier`` tokens appended before),
    the forward's q_len new tokens appended; returns the context its update returned and float64 inputs."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g)
    keep = torch.rand(1, H, N, generator=g) < torch.tensor([0.3, 0.8])[None, :, None]
    bias = torch.randn(1, H, N, generator=g) if with_bias else None
    new_k, new_v = torch.randn(1, H, earlier + q_len, D, generator=g), torch.randn(1, H, earlier + q_len, D, generator=g)
    query = torch.randn(1, H * G, q_len, D, generator=g) * 2  # logits of a few units
    cache = DynamicCache()
    cache.update(keys.to(device, dtype), values.to(device, dtype), 0)
    layer = evict_ragged(cache, 0, keep, bias)
    if earlier:
        layer.update(new_k[:, :, :earlier].to(device, dtype), new_v[:, :, :earlier].to(device, dtype))
    placeholder, _ = layer.update(new_k[:, :, earlier:].to(device, dtype), new_v[:, :, earlier:].to(device, dtype))
    inputs = dict(keys=keys, values=values, keep=keep, bias=bias, new_k=new_k, new_v=new_v)
    return placeholder.context, query, inputs


def _dense_inputs(query, inputs, dtype):
    """The same entries laid out dense: every head's full context then the appended tokens, a (1, H_q, q, n + t)
    mask hiding each head's evicted entries and the future (causal among new tokens), the bias on kept entries."""
    q_len, t = query.shape[2], inputs["new_k"].shape[2]
    keys = torch.cat([inputs["keys"], inputs["new_k"]], 2).to(dtype)
    values = torch.cat([inputs["values"], inputs["new_v"]], 2).to(dtype)
    visible = torch.cat([inputs["keep"][:, :, None, :].expand(1, H, q_len, N),
                         (torch.arange(t)[None, :] <= torch.arange(q_len)[:, None] + t - q_len).expand(1, H, q_len, t)], -1)
    visible = visible.repeat_interleave(G, dim=1)
    bias = torch.zeros(1, H, N + t, dtype=torch.float64)
    if inputs["bias"] is not None:
        bias[..., :N] = inputs["bias"].double()
    return keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1), visible, bias.repeat_interleave(G, 1)[:, :, None]


def _reference(query, inputs):
    """float64 attention with explicit weights: (1, q, H_q, D)."""
    keys, values, visible, bias = _dense_inputs(query.double(), inputs, torch.float64)
    logits = query.double() @ keys.transpose(-1, -2) * D ** -0.5 + bias
    weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return (weights @ values).transpose(1, 2)


def _dense_sdpa(query, inputs, dtype):
    """Dense SDPA on the same entries in ``dtype``, the per-head mask as a float mask with the bias."""
    keys, values, visible, bias = _dense_inputs(query, inputs, dtype)
    mask = bias.to(dtype).expand(visible.shape).masked_fill(~visible, torch.finfo(dtype).min)
    return F.scaled_dot_product_attention(query.to(dtype), keys, values, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("q_len, earlier", [(1, 0), (1, 3), (5, 0), (7, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_matches_float64_reference(q_len, earlier, with_bias):
    context, query, inputs = _case(q_len, earlier, with_bias, torch.float32)
    out = ragged_sdpa(query, context)
    reference = _reference(query, inputs)
    assert out.shape == (1, q_len, H * G, D)
    assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len, earlier", [(1, 2), (6, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_half_precision_within_twice_dense_sdpa_error(dtype, q_len, earlier, with_bias):
    context, query, inputs = _case(q_len, earlier, with_bias, dtype, seed=1)
    reference = _reference(query.to(dtype), inputs_as(inputs, dtype))
    ragged = (ragged_sdpa(query.to(dtype), context).double() - reference).abs().max()
    dense = (_dense_sdpa(query, inputs_as(inputs, dtype), dtype).double() - reference).abs().max()
    assert dense > 0  # the dtype's rounding shows: the bound is not vacuous
    assert ragged <= 2 * dense


def inputs_as(inputs, dtype):
    """The inputs rounded to ``dtype`` and back (the reference sees the entries the cache holds)."""
    return {k: v if v is None or v.dtype == torch.bool else v.to(dtype).double() for k, v in inputs.items()}


def test_a_head_without_kept_entries_sees_only_the_new_tokens():
    cache = DynamicCache()
    g = torch.Generator().manual_seed(3)
    cache.update(torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g), 0)
    keep = torch.zeros(1, H, N, dtype=torch.bool)
    keep[:, 1, :10] = True
    layer = evict_ragged(cache, 0, keep)
    new_v = torch.randn(1, H, 1, D, generator=g)
    placeholder, _ = layer.update(torch.randn(1, H, 1, D, generator=g), new_v)
    out = ragged_sdpa(torch.randn(1, H * G, 1, D, generator=g), placeholder.context)
    assert torch.allclose(out[0, 0, :G], new_v[0, 0, 0].expand(G, D))  # softmax over one entry: its value


def test_wrong_batch_or_heads_are_refused():
    context, query, _ = _case(1, 0, False, torch.float32)
    with pytest.raises(ValueError, match="batch size 1"):
        ragged_sdpa(query.expand(2, -1, -1, -1), context)
    with pytest.raises(ValueError, match="group"):
        ragged_sdpa(query[:, :5], context)
