"""Every shipped press under ``with press(model): model.generate(...)``: it decodes on its compressed cache (fewer
entries per head than the prompt, masked entries not counted); the KVzip presses score and compress at the first
decoding forward, before it runs."""

import pytest

from kvpress_prob.cache import RaggedLayer

from kvpress_prob.names.registry import PRESSES
from kvpress_prob.presses.h2o import EagerObservedAttentionPress
from kvpress_prob.presses.kvzip_scoring import BoundedKVzipPress
from kvpress_prob.presses.sampling import language_model
from tests.conftest import random_ids, tiny_model

N = 96  # prompt tokens (above snapkv's 64-token window)


@pytest.fixture(scope="module")
def models():
    out = {}
    for implementation in ("sdpa", "eager"):
        model = tiny_model("llama", layers=2)
        model.config._attn_implementation = implementation
        out[implementation] = model
    return out


def kept_per_head(cache, layers) -> float:
    """The largest, over layers, of the mean entries per head a decoding forward attends to: the stored length,
    less the entries a masking press (kvpress's AdaKV, KVzip) masks."""
    out = 0.0
    for layer, cache_layer in zip(layers, cache.layers):
        stored = max(cache_layer.lengths) if isinstance(cache_layer, RaggedLayer) else cache_layer.keys.shape[2]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        heads = cache_layer.keys.shape[1]
        out = max(out, stored - (0 if masked is None else len(masked[0]) / heads))
    return out


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_generate_decodes_on_the_compressed_cache_or_refuses(name, models):
    press = PRESSES[name](0.5)
    model = models["eager" if isinstance(press, EagerObservedAttentionPress) else "sdpa"]
    layers = language_model(model).layers
    seen = []

    def spy(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() > 0:  # a decoding forward
            seen.append(kept_per_head(cache, layers))

    handle = language_model(model).register_forward_pre_hook(spy, with_kwargs=True)
    try:
        with press(model):
            out = model.generate(random_ids(N, seed=1), max_new_tokens=3, do_sample=False)
        assert out.shape[1] == N + 3
        if isinstance(press, BoundedKVzipPress):  # scored at the first decoding forward, after the spy saw it
            assert seen[0] == N and seen[-1] < N, f"{name} decodes on {seen[-1]} entries per head of {N}"
        else:
            assert len(seen) == 2
            assert max(seen) < N, f"{name} decodes on {max(seen)} entries per head of a {N}-token prompt"
    finally:
        handle.remove()
        for layer in layers:
            if "masked_key_indices" in vars(layer.self_attn):
                del layer.self_attn.masked_key_indices
