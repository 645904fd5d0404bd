"""The GPU check's measurements, each one callable on any device (the dry run calls them on a CPU).

- ``accuracy``: the corrected attention (fused and SDPA routes) against float64, at a model's head
  shapes, bf16 q/k/v with a float32 compounding bias and padding; the O(n^2) proposal's mass (TF32 on
  CUDA) against float64 within ``precision.TF32_TOLERANCE``;
- ``ragged_accuracy``: every route over a ragged layer (``kvpress_prob.cache``) against float64 with explicit
  per-head entries, at a model's head shapes in bf16, within twice dense SDPA's error on the same entries;
- ``kernels``: which kernels (CUDA) or operators (CPU) a callable runs, from the profiler;
- ``prefill``: one timed prefill under a press, its peak memory above the start;
- ``decode``: decode steps of several variants in lockstep, median step time of each, and the attention
  function that decoded it (``evaluation.bench.speed.route``'s spy, on its first warm-up step);
- ``compilations``: how many times the fused route is compiled over one greedy generation on a biased
  cache (dynamo's counters, from a reset): one compiled kernel serves every step on CUDA, none on a CPU.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from evaluation.bench import common
from evaluation.bench.speed.route import route
from kvpress_prob import attention_dispatch
from kvpress_prob.cache import ragged_attention
from kvpress_prob.correction import bias as correction
from kvpress_prob.correction import corrected_attention, corrected_flex
from kvpress_prob.proposals import precision
from kvpress_prob.proposals.attention import attention_mass

BF16_TOL = 2**-7  # bfloat16 output rounding (2^-9 of |out| <= ~2) plus its inputs'


def _dense(query, key, value, bias):
    """softmax(q k / sqrt d + [bias | 0]) v in float64 for one decoding query: (b, 1, H_q, d)."""
    b, hq, _, d = query.shape
    hkv, k_len, s = key.shape[1], key.shape[2], bias.shape[-1]
    g = hq // hkv
    q = query.double().view(b, hkv, g, d)
    logits = torch.einsum("bhgd,bhkd->bhgk", q, key.double()) / math.sqrt(d)
    added = torch.zeros(b, hkv, k_len, dtype=torch.float64, device=key.device)
    added[..., :s] = torch.where(correction.is_padding(bias), -math.inf, bias.double())
    p = torch.softmax(logits + added[:, :, None], -1)
    return torch.einsum("bhgk,bhkd->bhgd", p, value.double()).reshape(b, 1, hq, d)


def accuracy(hq: int, hkv: int, d: int, n: int, device, seed: int = 0) -> dict:
    """Max |error| against float64 of the fused and SDPA routes (bf16 q/k/v, float32 bias) and the
    TF32 proposal's total variation; each with its tolerance and whether it holds."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    query = torch.randn(1, hq, 1, d, generator=g).to(device, torch.bfloat16)
    key = torch.randn(1, hkv, n + 1, d, generator=g).to(device, torch.bfloat16)
    value = torch.randn(1, hkv, n + 1, d, generator=g).to(device, torch.bfloat16)
    q1, q2 = (torch.rand(1, hkv, n, generator=g) * 0.9 + 0.05 for _ in range(2))
    bias = (-torch.log(q1) - torch.log(q2)).to(device)  # a bias compounded over two rounds, float32
    bias[..., n - n // 8:] = correction.padding(torch.float32)  # padding at the end of every head
    want = _dense(query, key, value, bias)
    out = {}
    for route, fn in (("fused", corrected_flex.flex_corrected), ("sdpa", corrected_attention.corrected_sdpa)):
        got = fn(query, key, value, bias, None)
        error = float((got.double() - want).abs().max())
        out[f"corrected_{route}_bf16_max_error"] = {"value": error, "tolerance": BF16_TOL, "ok": error <= BF16_TOL}
    m = min(n, 1024)  # the proposal: every row of a 1024-token prefix, float64 reference dense
    qs = (2.0 * torch.randn(1, hq, m, d, generator=g)).to(device)
    ks = torch.randn(1, hkv, m, d, generator=g).to(device)
    h = (1.0 / torch.arange(m, 0, -1).double()).to(device)
    mass = attention_mass(qs, torch.arange(m, device=device), ks, h, 1 / math.sqrt(d), chunk_size=256)
    logits = torch.einsum("bhrd,bhkd->bhrk", qs.double(), ks.double().repeat_interleave(hq // hkv, 1)) / math.sqrt(d)
    logits = logits.masked_fill(torch.ones(m, m, dtype=torch.bool, device=device).triu(1), -math.inf)
    ref = (h[None, None, :, None] * torch.softmax(logits, -1)).sum(2)
    tv = precision.total_variation(mass, ref)
    out["proposal_mass_total_variation"] = {"value": tv, "tolerance": precision.TF32_TOLERANCE,
                                            "ok": tv <= precision.TF32_TOLERANCE,
                                            "matmul": "tf32" if torch.device(device).type == "cuda" else "float32"}
    return out


def _ragged_reference(query, keys, values, keep, bias, new_k, new_v, dtype):
    """float64 attention of ``query`` (1, H_q, q, d) over each KV head's kept context entries (``keep`` (1, H, n))
    then the t new tokens (the last q causal), with ``bias`` (1, H, n) or None on the kept entries; and dense SDPA in
    ``dtype`` on the same entries (every head's whole context, a float mask hiding the evicted ones and the future).
    Returns (reference, dense), each (1, q, H_q, d) in float64."""
    _, hq, q_len, d = query.shape
    H, n, t = keys.shape[1], keys.shape[2], new_k.shape[2]
    g = hq // H
    k, v = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)  # (1, H, n + t, d)
    visible = torch.cat([keep[:, :, None, :].expand(1, H, q_len, n), (torch.arange(t, device=keys.device)[None, :] <=
                         torch.arange(q_len, device=keys.device)[:, None] + t - q_len).expand(1, H, q_len, t)], -1)
    added = torch.zeros(1, H, 1, n + t, dtype=torch.float64, device=keys.device)
    if bias is not None:
        added[..., :n] = bias[:, :, None].double()
    rep = lambda x: x.repeat_interleave(g, 1)  # noqa: E731
    logits = query.double() @ rep(k).double().transpose(-1, -2) / math.sqrt(d) + rep(added)
    reference = torch.softmax(logits.masked_fill(~rep(visible), -math.inf), -1) @ rep(v).double()
    mask = rep(added).to(dtype).expand(1, hq, q_len, n + t).masked_fill(~rep(visible), torch.finfo(dtype).min)
    dense = F.scaled_dot_product_attention(query.to(dtype), rep(k).to(dtype), rep(v).to(dtype), attn_mask=mask)
    return reference.transpose(1, 2), dense.double().transpose(1, 2)


def _ragged_refusal(route: str, query: torch.Tensor, with_bias: bool) -> str | None:
    """Why ``route`` does not serve a forward of ``query`` (with a bias or not), as its docstring says; None if
    it does."""
    from kvpress_prob.cache import ragged_fused

    if route == "nested" and (query.shape[2] > 1 or with_bias):
        return "the nested route serves decoding steps without a bias"
    if route == "flash" and not (query.is_cuda and ragged_fused.flash_available()):
        return "the flash route needs CUDA and the flash_attn package"
    if route == "flash" and with_bias:
        return "the flash route serves layers without a bias"
    return None


def ragged_accuracy(hq: int, hkv: int, d: int, n: int, device, seed: int = 0) -> dict:
    """Max |error| against float64 of every route over a ragged layer (``attention_dispatch.ROUTES["ragged"]``),
    bf16: a decoding step, and 8 new tokens without and with a float32 bias; each within twice dense SDPA's error
    on the same entries, or the reason the route does not serve that forward."""
    from kvpress_prob.cache import evict_ragged

    dtype, out = torch.bfloat16, {}
    g = torch.Generator(device="cpu").manual_seed(seed)
    for q_len, with_bias in ((1, False), (8, False), (8, True)):  # the nested route serves the first only
        keys, values = (torch.randn(1, hkv, n, d, generator=g).to(device) for _ in range(2))
        share = torch.linspace(0.2, 0.9, hkv)[None, :, None]  # each head its own kept share
        keep = (torch.rand(1, hkv, n, generator=g) < share).to(device)
        bias = torch.randn(1, hkv, n, generator=g).to(device) if with_bias else None
        new_k, new_v = (torch.randn(1, hkv, q_len + 3, d, generator=g).to(device) for _ in range(2))
        query = (2 * torch.randn(1, hq, q_len, d, generator=g)).to(device, dtype)
        cache = DynamicCache()
        cache.update(keys.to(dtype), values.to(dtype), 0)
        layer = evict_ragged(cache, 0, keep, bias)
        layer.update(new_k[:, :, :3].to(dtype), new_v[:, :, :3].to(dtype))
        context = layer.update(new_k[:, :, 3:].to(dtype), new_v[:, :, 3:].to(dtype))[0].context
        as_stored = lambda x: x.to(dtype).double()  # noqa: E731  the entries the cache holds
        want, dense = _ragged_reference(query, as_stored(keys), as_stored(values), keep, bias, as_stored(new_k),
                                        as_stored(new_v), dtype)
        tolerance = 2 * float((dense - want).abs().max())
        for name in attention_dispatch.ROUTES["ragged"][1:]:
            key = f"ragged_{name}_q{q_len}{'_bias' if with_bias else ''}_bf16_max_error"
            if reason := _ragged_refusal(name, query, with_bias):
                out[key] = {"skipped": reason}
                continue
            previous = attention_dispatch.set_route(ragged=name)
            try:
                got = ragged_attention.choose(query)(query, context, None)
            finally:
                attention_dispatch.set_route(**previous)
            error = float((got.double() - want).abs().max())
            out[key] = {"value": error, "tolerance": tolerance, "ok": error <= tolerance}
    return out


def kernels(fn, device, top: int = 6) -> list[str]:
    """Names of the ``top`` kernels (CUDA) or operators (CPU) by self time while ``fn()`` runs, then every
    attention kernel or operator that ran outside that top."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        common.synchronize(torch.device(device))
    events = prof.key_averages()
    if cuda:
        rows = [(e.self_device_time_total, e.key) for e in events if e.self_device_time_total > 0]
    else:
        rows = [(e.self_cpu_time_total, e.key) for e in events if e.key.startswith("aten::")]
    names = [name for _, name in sorted(rows, reverse=True)]
    # the top by time, then every attention kernel: which one a path runs must not hang on timing noise
    attention = ("attention", "flex", "flash", "scaled_dot_product", "fmha", "sdpa")
    return names[:top] + [n for n in names[top:] if any(a in n.lower() for a in attention)]


@torch.no_grad()
def prefill(model, ids: torch.Tensor, label: str, ratio: float) -> tuple[DynamicCache, dict]:
    """One prefill under ``label`` (a registry name, ``name[field=value]``, or "full"): its cache and
    {seconds, peak_extra_bytes}."""
    from evaluation.bench.memory.child import press_config
    from evaluation.engine import press_prefill

    press = None if label == "full" else press_config(label, ratio).build()
    with common.PeakMemory(model.device) as memory, common.Stopwatch(model.device) as watch:
        cache = press_prefill(model, ids, press)
    return cache, {"seconds": watch.wall, "peak_extra_bytes": memory.extra_bytes, "peak_method": memory.method}


def plain_copy(cache) -> DynamicCache:
    """The same keys and values in a new cache without any correction bias (plain attention)."""
    plain = DynamicCache()
    for i, layer in enumerate(cache.layers):
        plain.update(layer.keys.clone(), layer.values.clone(), i)
    return plain


@torch.no_grad()
def decode(model, variants: dict, n: int, steps: int, warmup: int = 2) -> dict:
    """Decode ``variants`` (name -> (cache, attn_implementation, corrected route, ragged route): the two routes of
    ``kvpress_prob.attention_dispatch.set_route``) in lockstep, one token
    per step at position n + i; returns name -> {median_step_ms, steps, route}: ``route``, the attention
    function that ran the first (untimed) step, seen by the spy (``warmup`` >= 1)."""
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the route spy runs on the first step), got {warmup}")
    times = {name: [] for name in variants}
    routes = {}
    token = torch.tensor([[5]], device=model.device)
    previous, previous_routes = model.config._attn_implementation, attention_dispatch.set_route()
    try:
        for i in range(warmup + steps):
            for name, (cache, implementation, mode, ragged_route) in variants.items():
                model.set_attn_implementation(implementation)
                attention_dispatch.set_route(corrected=mode, ragged=ragged_route)
                position = torch.tensor([[n + i]], device=model.device)
                step = lambda: model(input_ids=token, past_key_values=cache, position_ids=position)  # noqa: E731
                if i == 0:
                    routes[name] = route(model, step)
                    continue
                with common.Stopwatch(model.device) as watch:
                    step()
                if i >= warmup:
                    times[name].append(watch.wall)
    finally:
        attention_dispatch.set_route(**previous_routes)
        model.set_attn_implementation(previous)
    return {name: {"median_step_ms": 1e3 * statistics.median(t), "steps": len(t), "route": routes[name]}
            for name, t in times.items()}


@torch.no_grad()
def compilations(model, cache, n: int, steps: int) -> dict:
    """Compilations over one greedy generation of ``steps`` tokens from ``cache`` (a cache with a correction
    bias) on the fused route: ``torch._dynamo.reset()`` first (the compiled kernel is built afresh, not found
    in a cache), then dynamo's counters: ``graphs`` compiled, ``frames`` converted, and the route each step
    ran (the spy). One compiled kernel serves every step where ``graphs`` == 1 (CUDA: the key length grows
    every step, ``dynamic=True``). On a CPU the route is not compiled (``compiled`` False), yet eager
    FlexAttention traces its own graph at each call, which the counters see (one per step, measured)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    token = torch.tensor([[5]], device=model.device)
    routes = []
    previous = attention_dispatch.set_route(corrected="fused")
    try:
        for i in range(steps):
            position = torch.tensor([[n + i]], device=model.device)
            out = {}
            routes.append(route(model, lambda: out.update(logits=model(
                input_ids=token, past_key_values=cache, position_ids=position).logits)))
            token = out["logits"][:, -1:].argmax(-1)
    finally:
        attention_dispatch.set_route(**previous)
    return {"steps": steps, "graphs": int(counters["stats"]["unique_graphs"]), "frames": int(counters["frames"]["ok"]),
            "routes": sorted(set(routes)), "compiled": torch.device(model.device).type == "cuda"}
