"""The corrected attention through FlexAttention: the bias added in a ``score_mod``.

``corrected_sdpa`` (``kvpress_prob.correction.corrected_attention``) hands scaled_dot_product_attention a dense float
mask: on CUDA that rules out the flash kernel, and the memory-efficient kernel it falls back to does
not split over keys. Here the same attention,

  softmax(q k / sqrt(d) + bias) over [S stored prefix entries | new tokens],

the bias 0 on new tokens and causal among them, runs in FlexAttention: the scores are computed in
float32 (float64 for a float64 query) inside the kernel, and the ``score_mod`` adds the bias there in
float32, whatever the dtype of q, k and v. So a ``bias_dtype="float32"`` bias keeps its precision
beside bfloat16 keys, and no backend is handed a mask at all. GQA is native (``enable_gqa``).

Where it runs (``use_fused``, ``set_mode``): ``"auto"`` (default) on CUDA, and wherever the model was
loaded with a flash-attention implementation (FA2 then runs the prefill and plain decoding, this
kernel the decoding of a biased cache, and one log line says so); ``"fused"`` everywhere;
``"sdpa"`` never. On CUDA the function is compiled once (``torch.compile(..., dynamic=True)``: the
key length grows each step); on a CPU it runs eagerly (an unfused computation of the same formula,
used by the tests against the float64 reference).
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

LOG = logging.getLogger("kvpress_prob")
MODES = ("auto", "fused", "sdpa")
_MODE = ["auto"]
_SAID: set = set()  # the implementations whose routing was logged


def set_mode(mode: str) -> None:
    """Where the corrected attention runs: "auto" (CUDA and flash-attention models), "fused", "sdpa"."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _MODE[0] = mode


def mode() -> str:
    return _MODE[0]


@functools.cache
def available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused(query: torch.Tensor, implementation: str | None) -> bool:
    """Whether the corrected attention of this query runs fused (see the module's docstring)."""
    if _MODE[0] == "sdpa" or not available():
        return False
    flash = str(implementation or "").startswith("flash_attention")
    if flash and implementation not in _SAID:
        _SAID.add(implementation)
        LOG.warning("kvpress_prob: attn_implementation=%r runs the prefill and plain decoding; the decoding of a "
                    "cache with a correction bias runs FlexAttention (fused, the bias added in float32)", implementation)
    return _MODE[0] == "fused" or flash or query.is_cuda


@functools.cache
def compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


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
    """``attention.corrected_sdpa``'s attention through FlexAttention. query (b, H_q, q, d); key,
    value (b, H_kv, k, d) = [S stored | k - S new]; bias (b, H_kv, S). Returns (b, q, H_q, d)."""
    from torch.nn.attention.flex_attention import flex_attention

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

    if query.is_cuda:
        out = compiled()(query, key, value, score_mod=score_mod, scale=scaling, enable_gqa=g > 1)
    else:
        with warnings.catch_warnings():  # eager on a CPU is meant: the tests' reference route
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(query, key, value, score_mod=score_mod, scale=scaling, enable_gqa=g > 1)
    return out.transpose(1, 2).contiguous()  # (b, q, H_q, d)
