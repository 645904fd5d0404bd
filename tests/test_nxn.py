"""No n x n, and the O(n^2) proposals' precision (issue 27 item 4): TF32 inputs against float64 within
the stated tolerance; kvpress's own ObservedAttentionPress goes through the chunked scores above the
size eager attention may take; an eager prefill above it is refused, naming the parameter; H2O on a
model loaded on eager prefills on sdpa above its ``max_eager_bytes``."""

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from kvpress import ObservedAttentionPress

from evaluation.engine import Prefill, hooked_prefill, plan
from kvpress_prob.proposals import precision
from kvpress_prob.presses.h2o import EagerObservedAttentionPress
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.proposals.attention import attention_mass, chunk_rows


def reference_mass(queries, keys, h, scaling):
    """sum_r h_r softmax_causal(q_r k) in float64, row by row (rows = every position)."""
    b, hq, n, d = queries.shape
    g = hq // keys.shape[1]
    out = torch.zeros(b, hq, n, dtype=torch.float64)
    for head in range(hq):
        k = keys[0, head // g].double()
        for r in range(n):
            p = torch.softmax(k[: r + 1] @ queries[0, head, r].double() * scaling, -1)
            out[0, head, : r + 1] += h[r] * p
    return out


def test_tf32_inputs_stay_within_the_stated_tolerance_of_float64():
    """Logits of standard deviation ~4 (peaked rows, as trained models have): the normalised mass from
    TF32-rounded queries and keys is within ``TF32_TOLERANCE`` (total variation) of float64's."""
    g = torch.Generator().manual_seed(0)
    n, d = 192, 64
    queries = 2.0 * torch.randn(1, 4, n, d, generator=g)
    keys = torch.randn(1, 2, n, d, generator=g)
    h = 1.0 / torch.arange(n, 0, -1).double()
    scaling = 1 / math.sqrt(d)
    ref = reference_mass(queries, keys, h, scaling)
    rows = torch.arange(n)
    exact = attention_mass(queries, rows, keys, h, scaling, chunk_size=48)
    tf32 = attention_mass(precision.round_tf32(queries), rows, precision.round_tf32(keys), h, scaling, chunk_size=48)
    assert precision.total_variation(exact, ref) < 1e-5  # float32 itself
    error = precision.total_variation(tf32, ref)
    assert 1e-6 < error <= precision.TF32_TOLERANCE  # the rounding shows, within the tolerance


def test_round_tf32_keeps_ten_mantissa_bits():
    x = torch.tensor([1.0 + 2**-10, 1.0 + 2**-11 + 2**-13, 1.0 + 2**-12, -3.0])
    assert precision.round_tf32(x).tolist() == [1.0 + 2**-10, 1.0 + 2**-10, 1.0, -3.0]


def test_larger_chunks_on_cuda_only():
    """1/32 of the K+V per float32 buffer on a CPU: 32 layers x 2 x 2 heads x 64 x 4 bytes / (4 heads x 4
    bytes) / 32 = 64 rows; 1/8 (CUDA's default) gives 4x as many."""
    keys = torch.zeros(1, 2, 64, 64)
    assert chunk_rows(keys, 4, 32) == 64
    assert chunk_rows(keys, 4, 32, fraction=1 / 8) == 256


def test_kvpress_observed_attention_goes_through_the_chunked_scores_above_the_limit(monkeypatch):
    model = tiny_model("llama")
    n = 48
    assert plan(model, ObservedAttentionPress(compression_ratio=0.5), n).kind == "eager"  # it fits: kvpress's own
    monkeypatch.setattr(EagerObservedAttentionPress, "eager_bytes", staticmethod(lambda model, n, batch=1: 2**40))
    p = plan(model, ObservedAttentionPress(compression_ratio=0.5), n)
    assert p.kind == "scores"
    implementations = []
    for layer in language_model(model).layers:
        layer.self_attn.register_forward_pre_hook(lambda m, a: implementations.append(m.config._attn_implementation))
    cache = Prefill(model, random_ids(n), [ObservedAttentionPress(compression_ratio=0.5)]).compress(
        ObservedAttentionPress(compression_ratio=0.5))
    assert set(implementations) == {"sdpa"} and all(layer.keys.shape[2] == n // 2 for layer in cache.layers)


def test_an_eager_prefill_above_the_limit_is_refused_naming_the_parameter():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    layers = language_model(model).layers
    with pytest.raises(ValueError, match=r"above max_eager_bytes=1000: load the model with attn_implementation='sdpa'"):
        hooked_prefill(model, layers, random_ids(32), lambda *a: None, max_eager_bytes=1000)
    hooked_prefill(model, layers, random_ids(32), lambda *a: None)  # 4 heads x 32^2 x 4 bytes: fits


def test_h2o_on_a_model_loaded_eager_prefills_on_sdpa_above_its_limit():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    seen = []
    for layer in language_model(model).layers:
        layer.self_attn.register_forward_pre_hook(lambda m, a: seen.append(m.config._attn_implementation))
    from transformers import DynamicCache

    with torch.no_grad(), EagerObservedAttentionPress(compression_ratio=0.5, max_eager_bytes=0)(model):
        cache = DynamicCache()
        model.model(input_ids=random_ids(40), past_key_values=cache)
    assert set(seen) == {"sdpa"} and model.config._attn_implementation == "eager"  # restored for decoding
    assert all(layer.keys.shape[2] == 20 for layer in cache.layers)
