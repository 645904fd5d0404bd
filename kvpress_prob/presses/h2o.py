"""kvpress's H2O (``ObservedAttentionPress``) run so that it works with any attention implementation:
eager attention for the compressed prefill when its weights fit, the same scores computed in query
chunks when they do not."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from kvpress import ObservedAttentionPress

from kvpress_prob.presses.prefill_plan import PrefillPlan, scores_plan
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.proposals.attention import attention_mass, chunk_rows, rope_queries


@dataclass
class EagerObservedAttentionPress(ObservedAttentionPress):
    """kvpress ObservedAttentionPress (H2O, Zhang et al. 2023): each entry's attention received,
    summed over the prefill's queries, from eager attention weights. The press switches the model to
    eager attention for the compressed prefill and restores the previous implementation afterwards.

    Eager attention materialises one layer's (H_q, n, n) weights, about H_q * n^2 * 4 bytes (137 GB
    for 32 heads at n = 32768). Above ``max_eager_bytes`` the press keeps the model's attention
    implementation (sdpa for a model loaded on eager, as kvpress's ``evaluate.py`` loads it for H2O:
    no path builds the n x n weights) and computes the same scores from the prefill's queries,
    ``chunk_size`` rows at a time (equal up to float rounding; ``prob_h2o`` samples from the same
    cumulative attention). The decoding after the prefill runs on the model's own implementation.

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of key-value pairs removed.
    max_eager_bytes : int, default 2**32
        Largest estimated eager attention (``eager_bytes``) run on eager attention: 4 GiB keeps the
        paper's 4096-token runs on eager attention (Qwen3-4B: 2 GiB, Llama-3.2-3B: 1.5 GiB).
    chunk_size : int, optional
        Query rows per chunk above that size (one (H_q, chunk_size, n) float32 buffer at a time); None:
        as many as keep it within 1/32 of the model's K+V (``kvpress_prob.proposals.attention.chunk_rows``).
    """

    max_eager_bytes: int = 2**32
    chunk_size: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.max_eager_bytes < 0:
            raise ValueError(f"max_eager_bytes must be >= 0, got {self.max_eager_bytes}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be None or >= 1, got {self.chunk_size}")

    @staticmethod
    def eager_bytes(model, n: int, batch: int = 1) -> int:
        """One layer's eager attention weights in float32: batch * H_q * n^2 * 4 bytes."""
        return batch * model.config.num_attention_heads * n * n * 4

    def eager_fits(self, model, n: int) -> bool:
        return self.eager_bytes(model, n) <= self.max_eager_bytes

    def prefill_plan(self, model, n: int) -> PrefillPlan:
        """After a shared full-cache prefill: the scores and keys of one eager prefill when its weights fit
        (``eager_fits``), else kvpress's top-k of these scores computed in chunks in the shared prefill's hooks."""
        return PrefillPlan("eager", ("eager",)) if self.eager_fits(model, n) else scores_plan(self)

    @contextmanager
    def __call__(self, model):
        previous = model.config._attn_implementation

        def choose(module, args, kwargs):  # before the decoder runs: the context length is known
            ids = kwargs.get("input_ids", args[0] if args else None)  # the decoder's first parameter
            ids = kwargs.get("inputs_embeds") if ids is None else ids
            if ids is None:
                raise ValueError("EagerObservedAttentionPress: the decoder was called without input_ids or "
                                 "inputs_embeds, so the context length (eager or chunked scores) is unknown")
            if self.eager_fits(model, ids.shape[1]):
                model.set_attn_implementation("eager")
            else:  # chunked scores; a model loaded on eager (kvpress's evaluate.py does so for H2O) prefills on sdpa
                model.set_attn_implementation(previous if previous != "eager" else "sdpa")

        handle = language_model(model).register_forward_pre_hook(choose, with_kwargs=True)
        try:
            with super().__call__(model):
                yield
        finally:
            handle.remove()
            model.set_attn_implementation(previous)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if attentions is not None:
            return super().score(module, hidden_states, keys, values, attentions, kwargs)
        b, hkv, n, d = keys.shape
        queries = rope_queries(module, hidden_states, kwargs["position_embeddings"])  # (b, H_q, n, d)
        scaling = getattr(module, "scaling", 1.0 / math.sqrt(d))
        ones = torch.ones(n, device=keys.device)
        per_chunk = self.chunk_size or chunk_rows(keys, queries.shape[1], module.config.num_hidden_layers)
        rows = torch.arange(n, device=keys.device)
        mass = attention_mass(queries, rows, keys, ones, scaling, per_chunk)  # (b, H_q, n): sum_j p_j(i)
        mass = mass / torch.arange(n, 0, -1, device=keys.device)  # rows j >= i that see entry i
        return mass.view(b, hkv, -1, n).mean(2).to(keys.dtype)
