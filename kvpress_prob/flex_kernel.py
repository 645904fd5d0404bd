"""FlexAttention as this package calls it: compiled once on CUDA, eager and in float32 on a CPU.

Two attentions run through it, each with its own ``score_mod`` and mask: the corrected attention over a padded
cache (``kvpress_prob.correction.corrected_flex.flex_corrected``) and the ragged route over a layer's flat buffer
(``kvpress_prob.cache.ragged_fused.flex_ragged``). ``run`` is the one place that loads, compiles and calls the kernel.
"""

from __future__ import annotations

import functools
import warnings

import torch


@functools.cache
def available() -> bool:
    """Whether this torch has ``torch.nn.attention.flex_attention``."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def compiled():
    """``flex_attention`` compiled once (``dynamic=True``: the key length grows every decoding step)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """``flex_attention(query, key, value, **kwargs)`` (b, H_q, q, d) in the query's dtype: compiled on CUDA; on a CPU
    eager, on float32 copies (float64 stays float64) with the not-compiled warning silenced (torch's eager kernel
    would round the weights to a half dtype before P V): the tests' route, not one to decode with."""
    if query.is_cuda:
        return compiled()(query, key, value, **kwargs)
    from torch.nn.attention.flex_attention import flex_attention

    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = flex_attention(query.to(work), key.to(work), value.to(work), **kwargs)
    return out.to(query.dtype)


__all__ = ["available", "compiled", "run"]
