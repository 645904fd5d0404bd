"""The corrected attention through FlexAttention: the bias added in a ``score_mod``.

``corrected_sdpa`` (``kvpress_prob.correction.corrected_attention``) hands scaled_dot_product_attention a dense float
mask: on CUDA that rules out the flash kernel, and the memory-efficient kernel it falls back to does
not split over keys. Here the same attention,

  softmax(q k / sqrt(d) + bias) over [S stored prefix entries | new tokens],

the bias 0 on new tokens and causal among them, runs in FlexAttention: the scores are computed in
float32 (float64 for a float64 query) inside the kernel, and the ``score_mod`` adds the bias there in
float32, whatever the dtype of q, k and v. So a ``bias_dtype="float32"`` bias keeps its precision
beside bfloat16 keys, and no backend is handed a mask at all. GQA is native (``enable_gqa``).

Where it runs (``use_fused``; the "corrected" route of ``kvpress_prob.attention_dispatch.set_route``): ``"auto"``
(default) on CUDA, and wherever the model was loaded with a flash-attention implementation (FA2 then runs the
prefill and plain decoding, this kernel the decoding of a biased cache, and one log line says so); ``"fused"``
everywhere; ``"sdpa"`` never. The kernel is called through ``kvpress_prob.flex_kernel.run``: compiled once on CUDA,
eager in float32 on a CPU (an unfused computation of the same formula, used by the tests against the float64
reference).
"""

from __future__ import annotations

import logging

import torch

from kvpress_prob import attention_dispatch, flex_kernel

LOG = logging.getLogger("kvpress_prob")
_SAID: set = set()  # the implementations whose routing was logged


def use_fused(query: torch.Tensor, implementation: str | None) -> bool:
    """Whether the corrected attention of this query runs fused (see the module's docstring)."""
    mode = attention_dispatch.route("corrected")
    if mode == "sdpa" or not flex_kernel.available():
        return False
    flash = str(implementation or "").startswith("flash_attention")
    if flash and implementation not in _SAID:
        _SAID.add(implementation)
        LOG.warning("kvpress_prob: attn_implementation=%r runs the prefill and plain decoding; the decoding of a "
                    "cache with a correction bias runs FlexAttention (fused, the bias added in float32)", implementation)
    return mode == "fused" or flash or query.is_cuda


def full_bias(bias: torch.Tensor, k_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, H_kv, S) bias -> (b, H_kv, k_len) in ``dtype``, 0 on the new tokens; padding (the bias
    dtype's lowest value) becomes ``dtype``'s lowest (a plain cast would make it -inf in half dtypes)."""
    b, h, s = bias.shape
    out = torch.zeros(b, h, k_len, dtype=dtype, device=bias.device)
    lowest = torch.finfo(bias.dtype).min
    out[..., :s] = torch.where(bias == lowest, torch.finfo(dtype).min, bias.to(dtype))
    return out


def flex_corrected(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                   scaling: float | None) -> torch.Tensor:
    """``corrected_attention.corrected_sdpa``'s attention through FlexAttention. query (b, H_q, q, d); key,
    value (b, H_kv, k, d) = [S stored | k - S new]; bias (b, H_kv, S). Returns (b, q, H_q, d)."""
    b, hq, q_len, _ = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    g = hq // hkv
    n_stored = bias.shape[-1]
    if k_len - n_stored < q_len:
        raise RuntimeError(f"corrected attention expects the {q_len} new tokens after the {n_stored} stored ones, "
                           f"got {k_len} keys: was the cache changed outside the press?")
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    added = full_bias(bias, k_len, work)  # (b, H_kv, k): 0 on the new tokens, ~1.5 % of the K+V's traffic
    if q_len == 1:  # decoding: one query sees every entry; no length enters the kernel, so no recompilation

        def score_mod(score, bi, h, qi, ki):
            return score + added[bi, h // g, ki]
    else:  # several new tokens, causal among them; the lengths as tensors (a compiled kernel is not specialised)
        stored = torch.tensor(n_stored, device=query.device)
        offset = torch.tensor(k_len - n_stored - q_len, device=query.device)  # new-token index of query 0

        def score_mod(score, bi, h, qi, ki):
            allowed = (ki < stored) | (ki - stored <= qi + offset)
            return torch.where(allowed, score + added[bi, h // g, ki], -float("inf"))

    out = flex_kernel.run(query, key, value, score_mod=score_mod, scale=scaling, enable_gqa=g > 1)
    return out.transpose(1, 2).contiguous()  # (b, q, H_q, d)


__all__ = ["flex_corrected", "full_bias", "use_fused"]
