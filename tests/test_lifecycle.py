"""What the package leaves behind: nothing in kvpress or in transformers' attention functions at
import, nothing on the model once a press has exited and the caches it compressed are freed
(kvpress's own hook check, ``tests/test_press_call.py`` of the kvpress repository, for every
registry press), and an attention function registered after import is corrected like sdpa."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model
from test_composition import run
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from kvpress import KVzipPress
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob import PRESSES, get_press
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.sampling import language_model

ROOT = Path(__file__).resolve().parents[1]

IMPORT_CHECK = """
import inspect, kvpress, torch
from kvpress.presses.base_press import BasePress
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

def classes(root):
    found, todo = set(), [root]
    while todo:
        kind = todo.pop()
        if kind not in found:
            found.add(kind)
            todo += kind.__subclasses__()
    return found

def snapshot():
    inits = {kind: kind.__dict__.get("__init__") for kind in classes(BasePress)}
    inits.update({obj: obj.__dict__.get("__init__") for obj in vars(kvpress).values() if inspect.isclass(obj)})
    return inits, dict(ALL_ATTENTION_FUNCTIONS.items())

inits, functions = snapshot()
import kvpress_prob, kvpress_prob.names.registry, kvpress_prob.integrations.kvpress_eval
after_inits, after_functions = snapshot()
changed = [kind.__name__ for kind, init in inits.items() if after_inits[kind] is not init]
assert not changed, f"import changed the __init__ of {changed}"
assert all(after_functions[name] is func for name, func in functions.items()), "import wrapped attention functions"
assert set(after_functions) == set(functions)

model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")).eval()
with kvpress_prob.get_press("prob_knorm", 0.5)(model):
    pass
assert all(getattr(ALL_ATTENTION_FUNCTIONS[name], "_kvprob_wrapped", False) for name in functions), "entry wrapped nothing"
assert all(kind.__dict__.get("__init__") is init for kind, init in inits.items())
print("unchanged until entered")
"""


@pytest.mark.slow  # a fresh interpreter: `make test-all`
def test_import_leaves_kvpress_and_the_attention_functions_as_they_were():
    """A fresh interpreter: every kvpress class's ``__init__`` and every entry of
    ``ALL_ATTENTION_FUNCTIONS`` are the same objects before and after importing the package; entering
    a press wraps the attention functions and still changes no kvpress class."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unchanged until entered" in result.stdout


def decode(model, press, ids):
    """The logits of a prefill under ``press`` and of greedy decoding after its ``with`` block."""
    return run(model, press, ids)[1]


def test_an_attention_function_registered_after_import_is_corrected_like_sdpa():
    name, calls = "kvprob_test_registered_late", []

    def late(module, query, key, value, attention_mask, **kwargs):
        calls.append(key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, late)
    try:
        assert ALL_ATTENTION_FUNCTIONS[name] is late  # not wrapped before a press is entered
        ids = random_ids(96, seed=3)
        on_sdpa = decode(tiny_model("llama"), get_press("prob_snapkv", 0.5, seed=1), ids)
        model = tiny_model("llama")
        model.config._attn_implementation = name
        on_late = decode(model, get_press("prob_snapkv", 0.5, seed=1), ids)
        assert calls  # the model did run the late function (for the prefill: the correction needs none)
        torch.testing.assert_close(on_late, on_sdpa, rtol=0, atol=1e-5)
        # and it would differ unwrapped: the padded cache read without the correction
        uncorrected = decode(tiny_model("llama"), get_press("prob_snapkv", 0.5, seed=1, correct=False), ids)
        assert not torch.allclose(on_sdpa[1:], uncorrected[1:], atol=1e-3)
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        ALL_ATTENTION_FUNCTIONS._local_mapping.pop(name, None)


def ours(module) -> list[str]:
    """What of ours an attention module carries: hooks, attributes, correction state."""
    found = [f"forward hook {h}" for h in module._forward_hooks.values()]
    found += [f"pre-hook {h}" for h in module._forward_pre_hooks.values()]
    found += [a for a in vars(module) if a.startswith("_kvprob")]
    return found + (["correction state"] if module in correction._STATES else [])


def test_no_hook_remains_once_the_press_exited_and_its_caches_are_freed():
    """kvpress's check (one hook per attention layer inside ``with press(model)``, none after), for
    every registry press, after a prefill and a decoding step on its compressed cache, once that
    cache is freed (decoding one token at a time: AdaKV's fake-key search needs its queries in a
    half-space, which one query always is)."""
    model = tiny_model("llama")
    modules = [layer.self_attn for layer in language_model(model).layers]
    ids = random_ids(96, seed=4)
    for name in PRESSES:
        press = get_press(name, 0.5)
        cache = DynamicCache()
        with torch.no_grad():
            with press(model):
                # kvpress's KVzip wraps model.model.forward inside the block and hooks the layers only
                # on exit, to score by reconstruction (ours on its scores add at most the pi_min-h tail's
                # hook); every other press hooks each layer once
                hooks = (0, 1) if isinstance(press, KVzipPress) else (1,)
                for module in modules:
                    assert len(module._forward_hooks) in hooks and not module._forward_pre_hooks, name
                out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
            model(input_ids=out.logits.argmax(-1), past_key_values=cache, position_ids=torch.tensor([[96]]))
        del cache, out  # freed by reference counting, as a user's cache is (no gc.collect needed)
        for layer, module in zip(language_model(model).layers, modules):
            assert not layer._forward_hooks and not ours(module), (name, ours(module))
        decoder = language_model(model)  # KVzip's wrapper is gone: the decoder runs its class's forward
        assert decoder.forward.__func__ is type(decoder).forward, name
