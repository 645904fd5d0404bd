"""The one wrapper of transformers' attention functions (kvpress_prob/attention_dispatch.py): one of ours above
kvpress's in either order of installation, handlers asked by priority, everything forwarded on the pass-through
path, arguments a replacing route cannot honour refused, and a sliding-window layer refused by the ragged eviction."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from kvpress_prob import attention_dispatch
from kvpress_prob.cache import evict_ragged
from kvpress_prob.cache.folded import fold

ROOT = Path(__file__).resolve().parent.parent
MODULE = torch.nn.Module()  # an attention module without a cache layer of ours

ORDER_CHECK = r"""
import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob import attention_dispatch, get_press
from kvpress_prob.cache import evict_ragged

before = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS}
assert all(f.__module__ == "kvpress.attention_patch" for f in before.values()), "kvpress's wrapper is not on every entry"
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")).eval()
ids = torch.arange(3, 19)[None]
with torch.no_grad():
    plain = model(ids).logits


def correction():
    with get_press("prob_knorm", 0.5)(model):
        pass


def ragged():
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
        keep = torch.rand(1, 1, 16, generator=torch.Generator().manual_seed(0)) < 0.5
        evict_ragged(cache, 0, keep)
        model(ids[:, :1], past_key_values=cache, position_ids=torch.tensor([[16]]))  # the ragged handler answers


for step in ([correction, ragged] if sys.argv[1] == "correction-first" else [ragged, correction]):
    step()
    attention_dispatch.install()
for name, kvpress_wrapper in before.items():
    chain = [ALL_ATTENTION_FUNCTIONS[name]]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    ours = [f for f in chain if getattr(f, attention_dispatch.MARK, False)]
    assert len(ours) == 1 and chain[0] is ours[0] and chain[1] is kvpress_wrapper, (name, chain)
with torch.no_grad():
    again = model(ids).logits
assert torch.equal(plain, again), "a plain forward changed after the presses"
print("one wrapper above kvpress's", sorted(attention_dispatch.handlers()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["correction-first", "ragged-first"])
def test_one_wrapper_above_kvpress_in_either_order(order):
    """A fresh interpreter: entering a SamplingPress (the correction) and evicting a ragged layer, in either order,
    leave exactly one kvpress_prob wrapper on every entry of ALL_ATTENTION_FUNCTIONS, directly above kvpress's; a
    plain forward afterwards gives the logits it gave before either."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", ORDER_CHECK, order], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "one wrapper above kvpress's ['corrected', 'kvzip_fused', 'ragged']" in result.stdout


@pytest.fixture
def handlers_restored():
    before = set(attention_dispatch.handlers())  # the package's own (corrected, ragged, kvzip_fused) stay
    yield
    for name in set(attention_dispatch.handlers()) - before:
        attention_dispatch.unregister(name)


def _inputs(k_len: int = 6):
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, n, 4, generator=g) for n in (1, k_len, k_len))
    return query, key, value


def test_handlers_are_asked_by_priority_and_the_original_gets_every_argument(handlers_restored):
    seen, asked = {}, []

    def original(module, query, key, value, attention_mask, **kwargs):
        seen.update(kwargs)
        return "original", None

    def handler(name, answer):
        def run(module, query, key, value, attention_mask, **kwargs):
            asked.append(name)
            return answer
        return run

    wrapped = attention_dispatch.wrap(original, "test")
    assert getattr(wrapped, attention_dispatch.MARK) and wrapped.__wrapped__ is original
    assert attention_dispatch.wrap(wrapped, "test") is wrapped  # never wrapped twice
    attention_dispatch.register("test-low", handler("low", None), priority=-5)
    attention_dispatch.register("test-high", handler("high", None), priority=50)
    query, key, value = _inputs()
    out = wrapped(MODULE, query, key, value, None, 0.25, scaling=0.5, softcap=30.0, sliding_window=2)
    assert out == ("original", None) and asked[0] == "high" and asked[-1] == "low"
    assert seen == {"dropout": 0.25, "scaling": 0.5, "softcap": 30.0, "sliding_window": 2}  # the pass-through forwards
    order = attention_dispatch.handlers()
    assert order.index("test-high") < order.index("ragged") < order.index("corrected") < order.index("test-low")
    asked.clear()
    attention_dispatch.register("test-low", handler("low", ("low's", None)), priority=-5)  # replaces, keeps its place
    assert wrapped(MODULE, query, key, value, None, dropout=0.0, scaling=0.5) == ("low's", None)
    assert asked == ["high", "low"] and attention_dispatch.handlers() == order


@pytest.mark.parametrize("kwargs,match", [({"softcap": 30.0}, "softcap=30.0"), ({"dropout": 0.1}, "dropout=0.1"),
                                          ({"sliding_window": 5}, "sliding_window=5, shorter than the 6 positions")])
def test_a_replacing_handler_refuses_what_it_cannot_honour(handlers_restored, kwargs, match):
    attention_dispatch.register("test-answers", lambda *args, **kw: ("mine", None), priority=100)
    wrapped = attention_dispatch.wrap(lambda *args, **kw: ("original", None), "test")
    query, key, value = _inputs(6)
    with pytest.raises(ValueError, match=f"'test-answers' attention route .* cannot honour {match}"):
        wrapped(MODULE, query, key, value, None, **kwargs)
    # what it honours: no cap, no dropout, a window that covers every key
    assert wrapped(MODULE, query, key, value, None, dropout=0.0, softcap=None, sliding_window=6) == ("mine", None)


def test_the_ragged_route_refuses_a_softcap_on_a_real_layer():
    cache = DynamicCache()
    g = torch.Generator().manual_seed(1)
    cache.update(torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 2, 10, 4, generator=g), 0)
    layer = evict_ragged(cache, 0, torch.rand(1, 2, 10, generator=g) < 0.5)
    keys, values = layer.update(torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    query = torch.randn(1, 4, 1, 4, generator=g)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    out, _ = sdpa(MODULE, query, keys, values, None, dropout=0.0, scaling=0.5, sliding_window=11)
    assert out.shape == (1, 1, 4, 4)
    with pytest.raises(ValueError, match="'ragged' attention route .* softcap=50.0"):
        sdpa(MODULE, query, keys, values, None, dropout=0.0, scaling=0.5, softcap=50.0)
    with pytest.raises(ValueError, match="sliding_window=10, shorter than the 11 positions"):
        sdpa(MODULE, query, keys, values, None, dropout=0.0, scaling=0.5, sliding_window=10)


def test_eviction_refuses_a_sliding_window_layer():
    """A tiny Qwen2 whose second layer slides (config.layer_types): transformers gives that layer a
    DynamicSlidingWindowLayer (is_sliding); the ragged eviction and the fold refuse it, and the full layer, evicted,
    decodes beside the sliding one."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1, attn_implementation="sdpa")
    assert config.layer_types == ["full_attention", "sliding_attention"]
    model = Qwen2ForCausalLM(config).eval()
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert [layer.is_sliding for layer in cache.layers] == [False, True]
    keep = torch.rand(1, 2, 12, generator=torch.Generator().manual_seed(0)) < 0.6
    with pytest.raises(ValueError, match="layer 1 is a sliding-window layer .*DynamicSlidingWindowLayer"):
        evict_ragged(cache, 1, keep)
    layer = cache.layers[1]
    with pytest.raises(ValueError, match="layer 1 is a sliding-window layer"):
        fold(cache, 1, layer.keys, layer.values, keep, None, 12, 12, torch.ones_like(keep))
    evict_ragged(cache, 0, keep)
    with torch.no_grad():
        logits = model(ids[:, :1], past_key_values=cache, position_ids=torch.tensor([[12]])).logits
    assert torch.isfinite(logits).all()
