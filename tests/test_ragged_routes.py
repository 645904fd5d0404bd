"""The fused routes over a ragged layer (kvpress_prob/cache/ragged_fused.py) on a CPU, against the float64 attention with
explicit per-head masks of tests/test_ragged_attention.py and against the portable route: FlexAttention (eager
here) and SDPA on nested jagged tensors; flash-attn's varlen layout through a float64 implementation of
``flash_attn_varlen_func``'s documented semantics; the block mask's lists cover every visible slot; the choice of
route. fp32 within 1e-5 of the output's scale; bf16 and fp16 within twice dense SDPA's error on the same entries."""

import math
import sys
import types

import pytest
import torch
from conftest import tiny_model
from test_ragged_attention import _case, _dense_sdpa, _reference, inputs_as
from transformers import DynamicCache

from kvpress_prob import attention_dispatch
from kvpress_prob.cache import evict_ragged
from kvpress_prob.cache import ragged_attention as attention
from kvpress_prob.cache import ragged_fused as fused

FLEX_CASES = [(1, 0, False), (1, 3, True), (5, 0, False), (7, 2, True)]  # (q_len, earlier tokens, with a bias)


def _errors(route, q_len, earlier, with_bias, dtype, seed):
    """(max |route - float64|, max |dense SDPA - float64|, max |float64|) on one case in ``dtype``, the query laid
    out as a model hands it (1, H_q, q, d) transposed from (1, q, H_q, d): not contiguous."""
    context, query, inputs = _case(q_len, earlier, with_bias, dtype, seed=seed)
    reference = _reference(query.to(dtype), inputs_as(inputs, dtype))
    out = route(query.to(dtype).transpose(1, 2).contiguous().transpose(1, 2), context)
    assert out.shape == reference.shape and out.dtype == dtype
    dense = (_dense_sdpa(query, inputs_as(inputs, dtype), dtype).double() - reference).abs().max()
    return (out.double() - reference).abs().max(), dense, reference.abs().max()


@pytest.mark.parametrize("q_len, earlier, with_bias", FLEX_CASES)
def test_flex_fp32_matches_float64_and_the_portable_route(q_len, earlier, with_bias):
    context, query, inputs = _case(q_len, earlier, with_bias, torch.float32)
    reference = _reference(query, inputs)
    out = fused.flex_ragged(query, context).double()
    assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert (out - attention.ragged_sdpa(query, context).double()).abs().max() <= 1e-5 * reference.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len, earlier, with_bias", [(1, 2, True), (6, 1, False), (6, 1, True)])
def test_flex_half_precision_within_twice_dense_sdpa_error(dtype, q_len, earlier, with_bias):
    error, dense, _ = _errors(fused.flex_ragged, q_len, earlier, with_bias, dtype, seed=1)
    assert dense > 0  # the dtype's rounding shows: the bound is not vacuous
    assert error <= 2 * dense


def _long_case(q_len: int, seed: int = 5):
    """Regions over several blocks of 128 slots and queries over two blocks of 128: 3 KV heads of 2 query heads,
    kept counts ~10 / 50 / 90 % of 300, 3 then ``q_len`` tokens appended (the regions re-laid with free slots)."""
    g = torch.Generator().manual_seed(seed)
    H, G, N, D = 3, 2, 300, 8
    cache = DynamicCache()
    cache.update(torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g), 0)
    keep = torch.rand(1, H, N, generator=g) < torch.tensor([0.1, 0.5, 0.9])[None, :, None]
    layer = evict_ragged(cache, 0, keep, torch.randn(1, H, N, generator=g))
    layer.update(torch.randn(1, H, 3, D, generator=g), torch.randn(1, H, 3, D, generator=g))
    placeholder, _ = layer.update(torch.randn(1, H, q_len, D, generator=g), torch.randn(1, H, q_len, D, generator=g))
    return placeholder.context, torch.randn(1, H * G, q_len, D, generator=g) * 2


@pytest.mark.parametrize("q_len", [1, 130])
def test_block_mask_lists_every_visible_slot_and_flex_matches_the_portable_route(q_len):
    from torch.nn.attention.flex_attention import create_mask

    context, query = _long_case(q_len)
    M, hq, B = context.keys.shape[0], query.shape[1], fused.BLOCK
    assert M > 2 * B and len(context.starts) == 3
    mask = fused.block_mask(context, hq, q_len, "cpu")
    listed = mask.to_dense().bool().repeat_interleave(B, -2).repeat_interleave(B, -1)[..., :q_len, :M]
    visible = create_mask(mask.mask_mod, 1, hq, q_len, M, device="cpu")  # (1, H_q, q, M)
    # the mask_mod is each head's region, causal on the new tokens: explicit per-head masks
    expected = torch.zeros(1, hq, q_len, M, dtype=torch.bool)
    for h in range(hq):
        s, c, t = context.starts[h // 2], context.lengths[h // 2], context.tail
        for i in range(q_len):
            expected[0, h, i, s: s + c + t - q_len + i + 1] = True
    assert torch.equal(visible, expected)
    assert not (visible & ~listed).any()  # no visible slot falls in a block the kernel skips
    assert listed.sum() < 0.8 * listed.numel()  # and the lists skip blocks (a full list would test nothing)
    out, portable = fused.flex_ragged(query, context), attention.ragged_sdpa(query, context)
    assert (out - portable).abs().max() <= 1e-5 * portable.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("earlier", [0, 3])
def test_nested_decoding_step_matches_float64(dtype, earlier):
    error, dense, scale = _errors(fused.nested_ragged, 1, earlier, False, dtype, seed=2)
    assert error <= (1e-5 * scale if dtype == torch.float32 else 2 * dense)


def _filled_case(dtype, seed: int = 6):
    """A ragged layer whose regions have no free slot left (16, 15 then 1 token appended fill the MIN_SLOTS = 32
    slots given at the first append): its context at the last token, the query (1, H_q, 1, d), and the float64
    attention with explicit per-head entries (each head's kept context entries, then the 32 tokens)."""
    from kvpress_prob.cache.ragged import MIN_SLOTS

    g = torch.Generator().manual_seed(seed)
    H, G, N, D = 2, 3, 40, 16
    keys, values = torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g)
    new_k, new_v = torch.randn(1, H, MIN_SLOTS, D, generator=g), torch.randn(1, H, MIN_SLOTS, D, generator=g)
    keep = torch.rand(1, H, N, generator=g) < torch.tensor([0.3, 0.8])[None, :, None]
    cache = DynamicCache()
    cache.update(keys.to(dtype), values.to(dtype), 0)
    layer = evict_ragged(cache, 0, keep)
    for a, b in ((0, 16), (16, 31), (31, 32)):
        placeholder, _ = layer.update(new_k[:, :, a:b].to(dtype), new_v[:, :, a:b].to(dtype))
    query = torch.randn(1, H * G, 1, D, generator=g).to(dtype)
    reference = torch.empty(1, 1, H * G, D, dtype=torch.float64)
    for h in range(H):
        k = torch.cat([keys[0, h][keep[0, h]], new_k[0, h]]).to(dtype).double()
        v = torch.cat([values[0, h][keep[0, h]], new_v[0, h]]).to(dtype).double()
        weights = torch.softmax(query[0, h * G: (h + 1) * G, 0].double() @ k.T / math.sqrt(D), -1)
        reference[0, 0, h * G: (h + 1) * G] = weights @ v
    return placeholder.context, query, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nested_and_flash_without_free_slots_between_regions(monkeypatch, dtype):
    """Regions with no free slot left make empty sequences in the varlen layout: the routes still read them."""
    context, query, reference = _filled_case(dtype)
    assert context.tail == 32 and context.starts[1] == context.lengths[0] + 32  # no free slot after region 0
    portable = (attention.ragged_sdpa(query, context).double() - reference).abs().max()
    bound = 1e-5 * reference.abs().max() if dtype == torch.float32 else 2 * portable
    assert (fused.nested_ragged(query, context).double() - reference).abs().max() <= bound
    if dtype != torch.float32:
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_varlen_reference))
        assert (fused.flash_ragged(query, context).double() - reference).abs().max() <= bound


def test_nested_refuses_what_it_cannot_serve():
    context, query, _ = _case(3, 0, False, torch.float32)
    with pytest.raises(ValueError, match="q = 1.*'flex' or 'portable'"):
        fused.nested_ragged(query, context)
    context, query, _ = _case(1, 0, True, torch.float32)
    with pytest.raises(ValueError, match="without a bias"):
        fused.nested_ragged(query, context)


def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                      causal=False):
    """flash_attn_varlen_func's documented semantics in float64: sequence i's queries q[cu_q[i]:cu_q[i+1]]
    (Lq, H, d) attend to k[cu_k[i]:cu_k[i+1]] (Lk, H_k, d), query head j to KV head j // (H / H_k); causal aligned
    to the bottom right (query r sees keys up to r + Lk - Lq); sequences without queries give no rows."""
    assert q.dtype in (torch.float16, torch.bfloat16) and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert len(cu_seqlens_q) == len(cu_seqlens_k) and int(cu_seqlens_k[-1]) == k.shape[0]
    rows = []
    for i in range(len(cu_seqlens_q) - 1):
        qs, ks = q[cu_seqlens_q[i]: cu_seqlens_q[i + 1]].double(), k[cu_seqlens_k[i]: cu_seqlens_k[i + 1]].double()
        vs = v[cu_seqlens_k[i]: cu_seqlens_k[i + 1]].double()
        lq, lk = qs.shape[0], ks.shape[0]
        assert lq <= max_seqlen_q and lk <= max_seqlen_k
        if lq == 0:
            continue
        ks, vs = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (ks, vs))
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * (softmax_scale or 1 / math.sqrt(q.shape[-1]))
        if causal:
            logits = logits.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + lk - lq, -math.inf)
        rows.append(torch.einsum("hqk,khd->qhd", logits.softmax(-1), vs))
    return torch.cat(rows).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len, earlier", [(1, 0), (1, 31), (6, 2)])
def test_flash_varlen_layout_matches_float64(monkeypatch, dtype, q_len, earlier):
    """flash_ragged's call (its layout, sequences of free slots without queries, the causal flag) against
    float64, with a float64 implementation of flash_attn_varlen_func in place of the CUDA kernel."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_varlen_reference))
    error, dense, _ = _errors(fused.flash_ragged, q_len, earlier, False, dtype, seed=3)
    assert error <= 2 * dense


def test_flash_refuses_a_bias_or_float32(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_varlen_reference))
    context, query, _ = _case(1, 0, True, torch.bfloat16)
    with pytest.raises(ValueError, match="without a bias"):
        fused.flash_ragged(query.bfloat16(), context)
    context, query, _ = _case(1, 0, False, torch.float32)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fused.flash_ragged(query, context)


@pytest.fixture
def routes_restored():
    previous = attention_dispatch.set_route()
    yield
    attention_dispatch.set_route(**previous)


def test_choose_a_route(routes_restored):
    query = torch.zeros(1, 6, 1, 16)
    attention_dispatch.set_route(ragged="auto")
    assert attention.choose(query) is attention.ragged_sdpa  # auto on a CPU: the portable route
    for name, func in (("portable", attention.ragged_sdpa), ("flex", fused.flex_ragged), ("nested", fused.nested_ragged)):
        attention_dispatch.set_route(ragged=name)
        assert attention_dispatch.route("ragged") == name and attention.choose(query) is func
    attention_dispatch.set_route(ragged="flash")
    with pytest.raises(RuntimeError, match="CUDA device and the flash_attn package"):
        attention.choose(query)
    with pytest.raises(ValueError, match="ragged must be one of"):
        attention_dispatch.set_route(ragged="fast")
    with pytest.raises(ValueError, match="corrected must be one of"):
        attention_dispatch.set_route(corrected="flash", ragged="portable")
    assert attention_dispatch.route("ragged") == "flash"  # a refused call changes neither route


def test_the_set_route_decodes_a_model(routes_restored):
    """The wrapper runs the route set: one decoding step per route over the same kept entries, spied."""
    from evaluation.bench.speed.route import route

    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, spied in (("portable", "ragged sdpa"), ("flex", "ragged flex"), ("nested", "ragged nested")):
        cache = DynamicCache()
        with torch.no_grad():
            model(ids, past_key_values=cache)
            for i, layer in enumerate(list(cache.layers)):
                keep = torch.rand(layer.keys.shape[:3], generator=torch.Generator().manual_seed(i)) < 0.6
                evict_ragged(cache, i, keep)
            attention_dispatch.set_route(ragged=name)
            out = {}
            ran = route(model, lambda: out.update(logits=model(ids[:, :1], past_key_values=cache,
                                                                position_ids=torch.tensor([[24]])).logits))
        assert ran == spied
        logits[name] = out["logits"].double()
    scale = logits["portable"].abs().max()
    assert (logits["flex"] - logits["portable"]).abs().max() <= 1e-4 * scale
    assert (logits["nested"] - logits["portable"]).abs().max() <= 1e-4 * scale
