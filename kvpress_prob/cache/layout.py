"""What a ragged layer hands its attention route: the layer's layout (``RaggedContext``) riding on placeholder
keys and values (``RaggedKeys``) of its logical shape (``kvpress_prob.cache.ragged`` builds them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RaggedContext:
    """One layer as the attention route reads it: head h attends to ``keys[starts[h] : starts[h] + lengths[h]
    + tail]`` (its kept entries, then the appended tokens), with ``bias`` over the same slots."""

    keys: torch.Tensor  # (M, d) flat buffer
    values: torch.Tensor  # (M, d)
    bias: torch.Tensor | None  # (M,) log-weight per slot (0 on appended tokens), or None
    starts: tuple[int, ...]  # (H,) start of each head's region
    lengths: tuple[int, ...]  # (H,) kept count per head
    tail: int  # tokens appended since compression (the forward's new tokens last)


_ALLOWED = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
            torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__repr__}


class RaggedKeys(torch.Tensor):
    """What ``RaggedLayer.update`` returns for keys and values: a placeholder of the layer's logical shape
    (1, H, n + t, d) (one element, expanded: no memory) carrying ``context`` (``RaggedContext``). Its shape can
    be read; any computation on it raises (it holds no entries): the ragged route reads ``context``."""

    context: RaggedContext

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _ALLOWED:
            return super().__torch_function__(func, types, args, kwargs)
        raise RuntimeError(
            f"{getattr(func, '__name__', func)} on the keys or values of a RaggedLayer: each KV head holds its own "
            "entries, read by the ragged attention route (kvpress_prob.cache.ragged_attention) inside the wrapped "
            "functions of transformers' ALL_ATTENTION_FUNCTIONS: load the model with attn_implementation='sdpa' (not "
            "'eager'), or call kvpress_prob.attention_dispatch.install() after registering a new attention function")


__all__ = ["RaggedContext", "RaggedKeys"]
