"""The two-step generate pattern of docs/snippets/generate_recommended.py, run as written, and the KVzip presses'
public ``compress``: the same kept set as the press's own ``with`` block, the context's real positions. The tiny
random models have no trained gate or profile: RECOMMENDED runs on untrained stand-ins (``learned.stand_in``)."""

import re
import runpy
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvpress_prob import RECOMMENDED, RECOMMENDED_RETRIEVAL, get_press
from kvpress_prob.cache import head_entries, held_counts
from kvpress_prob.learned.stand_in import stand_in_artefacts
from kvpress_prob.presses.kvzip_scoring import clear_scores
from kvpress_prob.presses.sampling import language_model
from tests.conftest import random_ids, tiny_model

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = ROOT / "docs" / "snippets" / "generate_recommended.py"
N, Q, NEW = 96, 5, 4


def held(cache) -> int:
    """Entries the cache holds over all layers and KV heads."""
    return sum(sum(held_counts(layer)) for layer in cache.layers)


def evicted(cache) -> bool:
    """Fewer entries than the full cache of N context tokens would hold."""
    return 0 < held(cache) < N * sum(len(held_counts(layer)) for layer in cache.layers)


def prefilled(model, press, ids):
    """The cache after prefilling ``ids`` under ``press`` (its scores computed afresh)."""
    clear_scores()
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=cache)
    return cache


def greedy(model, cache, question, n, steps):
    """The reference decode (kvpress's pipeline's): explicit positions from the context's length, argmax."""
    ids, out, position = question, [], n
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, past_key_values=cache,
                           position_ids=torch.arange(position, position + ids.shape[1])[None]).logits[:, -1]
            position += ids.shape[1]
            ids = logits.argmax(-1, keepdim=True)
            out.append(int(ids))
    return out


def test_the_snippet_generates_at_the_contexts_positions_as_the_pipeline_decodes():
    generate_compressed = runpy.run_path(str(SNIPPET))["generate_compressed"]
    model = tiny_model("llama")
    with stand_in_artefacts(model):
        snippet_generates_at_the_contexts_positions(model, generate_compressed)


def snippet_generates_at_the_contexts_positions(model, generate_compressed):
    context, question = random_ids(N, seed=1), random_ids(Q, seed=2)
    seen = []
    hook = language_model(model).register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs.get("position_ids"), kwargs.get("cache_position"))),
        with_kwargs=True)
    try:
        clear_scores()
        out = generate_compressed(model, context, question, get_press(RECOMMENDED, 0.5), max_new_tokens=NEW,
                                  do_sample=False)
    finally:
        hook.remove()
    own = prefilled(model, get_press(RECOMMENDED, 0.5), context)
    kept = own.get_seq_length()  # a dense cache's kept length, a ragged cache's logical (context) length
    assert evicted(own)
    decoding = [(p.tolist()[0], c.tolist()) for p, c in seen if p is not None]  # the generate forwards
    assert decoding[0] == (list(range(N, N + Q)), list(range(kept, kept + Q)))
    assert [d[0] for d in decoding[1:]] == [[N + Q + i] for i in range(NEW - 1)]
    reference = greedy(model, prefilled(model, get_press(RECOMMENDED, 0.5), context), question, N, NEW)
    assert out[0, :Q].tolist() == question[0].tolist() and out[0, Q:].tolist() == reference


def test_generate_under_recommended_compresses_before_decoding_at_the_contexts_positions():
    model = tiny_model("llama")
    with stand_in_artefacts(model):
        generate_compresses_before_decoding(model)


def generate_compresses_before_decoding(model):
    prompt = random_ids(N, seed=5)
    seen, cache = [], DynamicCache()

    def spy(module, args, kwargs):  # registered after the press's hook: sees what the decoding forward runs with
        if kwargs.get("position_ids") is not None:
            seen.append((kwargs["position_ids"].tolist()[0], kwargs["past_key_values"].get_seq_length()))

    clear_scores()
    with get_press(RECOMMENDED, 0.5)(model):
        hook = language_model(model).register_forward_pre_hook(spy, with_kwargs=True)
        try:
            out = model.generate(prompt, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
        finally:
            hook.remove()
    own = prefilled(model, get_press(RECOMMENDED, 0.5), prompt)  # the pipeline's prefill under the press
    kept = own.get_seq_length()
    assert evicted(own)
    assert [s for s in seen if s[1] > 0] == [([N + i], kept + i) for i in range(NEW - 1)]
    for layer, reference in zip(cache.layers, own.layers):  # the same kept set, then the decoded tokens
        for (k, v), (rk, rv) in zip(head_entries(layer), head_entries(reference), strict=True):
            assert torch.equal(k[: len(rk)], rk) and torch.equal(v[: len(rv)], rv) and len(k) == len(rk) + NEW - 1
    with torch.no_grad():
        first = model(input_ids=prompt).logits[:, -1].argmax(-1, keepdim=True)  # from the full cache's prefill
    assert out[0, N:].tolist() == [int(first)] + greedy(model, own, first, N, NEW - 1)


@pytest.mark.parametrize("name", [RECOMMENDED_RETRIEVAL, "topk_kvzip_head"])
def test_compress_keeps_what_the_presses_own_block_keeps(name):
    model = tiny_model("qwen3")
    ids = random_ids(N, seed=3)
    own = prefilled(model, get_press(name, 0.5), ids)
    clear_scores()
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)  # a plain prefill, then the public method
    assert get_press(name, 0.5).compress(model, cache, ids) is cache
    assert [held_counts(layer) for layer in cache.layers] == [held_counts(layer) for layer in own.layers]
    assert evicted(cache)
    for a, b in zip(cache.layers, own.layers):
        for (k, v), (rk, rv) in zip(head_entries(a), head_entries(b), strict=True):
            assert torch.equal(k, rk) and torch.equal(v, rv)


def test_compress_refuses_bad_input_before_any_pass():
    model, ids = tiny_model("llama"), random_ids(N, seed=4)
    with pytest.raises(ValueError, match="batch size 1"):
        get_press(RECOMMENDED_RETRIEVAL, 0.5).compress(model, DynamicCache(), ids.repeat(2, 1))
    with pytest.raises(ValueError, match="tails"):
        get_press(RECOMMENDED_RETRIEVAL, 0.5).compress(model, DynamicCache(), ids, tails={0: torch.ones(1)})


def test_the_readme_shows_the_snippet_as_it_is_or_names_it():
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "def generate_compressed" in b]
    if not blocks:  # the README points to the snippet instead of showing it
        assert "docs/snippets/generate_recommended.py" in readme
        return
    assert blocks[0].strip() == SNIPPET.read_text().strip()


def test_a_forward_on_another_cache_inside_the_block_is_refused():
    from kvpress_prob.presses.kvzip_scoring import GENERATE_ERROR

    model, ids = tiny_model("llama"), random_ids(N, seed=6)
    with pytest.raises(RuntimeError, match=re.escape(GENERATE_ERROR[:40])):
        with torch.no_grad(), get_press(RECOMMENDED_RETRIEVAL, 0.5)(model):
            model(input_ids=ids, past_key_values=DynamicCache())
            model(input_ids=ids[:, :1], past_key_values=DynamicCache())
