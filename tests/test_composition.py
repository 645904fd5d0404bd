"""SamplingPress inside kvpress's wrappers: each one either equals its reference or is refused
with an error naming the wrapper and what to use instead (docs/presses.md, "Lifetime, and kvpress's
wrappers"). None may run and silently skip the eviction."""

from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
from conftest import random_ids, tiny_model
from kvpress import (
    AdaKVPress,
    BasePress,
    BlockPress,
    ChunkPress,
    ComposedPress,
    DecodingPress,
    KeyRerotationPress,
    KnormPress,
    KVPressTextGenerationPipeline,
    PerLayerCompressionPress,
    PrefillDecodingPress,
    SnapKVPress,
)
from transformers import DynamicCache

from kvpress_prob import get_press
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.sampling import language_model

N = 96


def run(model, press, ids, n_tokens=3):
    """Prefill under ``press``, then greedy decoding after its ``with`` block (the pipeline's path).
    Returns (cache, logits of the prefill's last token and of each decoded step but the last, or None)."""
    cache, logits = DynamicCache(), []
    with torch.no_grad():
        with press(model):
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
        for i in range(n_tokens):
            logits.append(out[0, -1])
            if i == n_tokens - 1:
                break
            out = model(input_ids=out.argmax(-1), past_key_values=cache,
                        position_ids=torch.tensor([[ids.shape[1] + i]])).logits
    return cache, torch.stack(logits) if logits else None


def same_cache(a, b):
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))


# ---- works: ComposedPress (SamplingPress last), PrefillDecodingPress (prefilling_press only) ----


@pytest.mark.parametrize("name", ["prob_min_h", "prob_snapkv"])
def test_composed_press_of_a_prob_press_alone_equals_the_press(name):
    model, ids = tiny_model("llama"), random_ids(N, seed=1)
    alone = get_press(name, 0.5, seed=3)
    cache_alone, logits_alone = run(model, alone, ids)
    inner = get_press(name, 0.5, seed=3)
    composed = ComposedPress([inner])
    cache_composed, logits_composed = run(model, composed, ids)
    assert inner.stats and inner.stats == alone.stats  # it evicted, with the same draw
    assert torch.equal(inner.last_draw.keep, alone.last_draw.keep)
    assert same_cache(cache_alone, cache_composed)
    assert torch.equal(logits_alone, logits_composed)
    assert composed.compression_ratio == 0.5


def test_composed_press_samples_from_what_the_presses_before_it_kept():
    """ComposedPress([KnormPress(0.25), prob_knorm]): the sampling press draws from the entries
    K-norm kept, as ``evict`` on K-norm's cache with the proposal of those entries."""
    model, ids = tiny_model("llama"), random_ids(N, seed=2)
    inner = get_press("prob_knorm", 0.5, seed=3)
    cache, logits = run(model, ComposedPress([KnormPress(compression_ratio=0.25), inner]), ids, n_tokens=0)
    # reference: K-norm alone, then the prob press's public propose / evict on its cache
    reference = get_press("prob_knorm", 0.5, seed=3)
    knorm_cache = DynamicCache()
    with torch.no_grad(), KnormPress(compression_ratio=0.25)(model):
        model.model(input_ids=ids, past_key_values=knorm_cache)
    assert all(layer.keys.shape[2] == 72 for layer in knorm_cache.layers)
    reference.post_init_from_model(model)
    modules = [layer.self_attn for layer in language_model(model).layers]
    hidden = torch.zeros(1, 72, model.config.hidden_size)  # K-norm's score reads the keys only
    proposals = {m: reference.propose(m, {"hidden_states": hidden, "past_key_values": knorm_cache}) for m in modules}
    reference.evict(knorm_cache, proposals)
    assert inner.stats["n"] == 72 and torch.equal(inner.last_draw.keep, reference.last_draw.keep)
    assert same_cache(cache, knorm_cache)  # before either decodes
    token = torch.tensor([[7]])
    with torch.no_grad():  # both caches decode with their own correction, interleaved
        steps = [model(input_ids=token, past_key_values=c, position_ids=torch.tensor([[N]])).logits for c in (cache, knorm_cache)]
    assert torch.equal(steps[0], steps[1])


def test_composed_press_refuses_a_shortened_prefix_for_attention_proposals():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="ComposedPress.*ScoreProposal"):
        run(model, ComposedPress([KnormPress(compression_ratio=0.25), get_press("prob_min_h", 0.5)]), random_ids(N))


def test_prefill_decoding_press_with_a_prob_prefilling_press_equals_the_press(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context = " ".join(f"word{i}" for i in range(120))
    answers, presses = [], []
    for wrap in (lambda p: p, lambda p: PrefillDecodingPress(prefilling_press=p)):
        press = get_press("prob_min_h", 0.5, seed=4)
        answers.append(pipe(context, question="What is word7?", press=wrap(press), max_new_tokens=4)["answer"])
        presses.append(press)
    assert answers[0] == answers[1]
    assert presses[1].stats and presses[1].stats == presses[0].stats
    assert torch.equal(presses[0].last_draw.keep, presses[1].last_draw.keep)


# ---- refused before the prefill evicts or skips anything ----
# kvpress's own constructors refuse a press that is not a ScorerPress (their assertions, which we leave
# alone); under ``python -O``, with fields edited later, or for a wrapper kvpress accepts, the
# SamplingPress refuses at the first forward of the prefill, naming the wrapper and what to use instead.

def prob():
    return get_press("prob_min_h", 0.5)


def bypass(kind, **fields):
    """The wrapper as ``python -O`` (no asserts) or a later edit of its fields would leave it."""
    wrapper = object.__new__(kind)
    wrapper.__dict__.update(fields)
    return wrapper


#: wrappers kvpress's constructor refuses (a SamplingPress is no ScorerPress), and its message
KVPRESS_ASSERTS = {
    "PerLayerCompressionPress": (lambda: PerLayerCompressionPress(press=prob(), compression_ratios=[0.3, 0.5, 0.7]),
                                 "requires a ScorerPress"),
    "KeyRerotationPress": (lambda: KeyRerotationPress(press=prob()), None),  # a bare assert
    "ChunkPress": (lambda: ChunkPress(press=prob(), chunk_length=32), "ChunkPress requires a ScorerPress"),
    "BlockPress": (lambda: BlockPress(press=prob(), block_size=32), "BlockPress requires a ScorerPress"),
    "DecodingPress": (lambda: DecodingPress(base_press=prob()), "DecodingPress requires a ScorerPress"),
    "AdaKVPress": (lambda: AdaKVPress(press=prob()), "AdaKVPress requires a ScorerPress"),
}


@pytest.mark.parametrize("wrapper", sorted(KVPRESS_ASSERTS))
def test_kvpress_constructors_keep_their_own_refusal(wrapper):
    make, message = KVPRESS_ASSERTS[wrapper]
    with pytest.raises(AssertionError, match=message):
        make()


#: every refused wrapper, as it runs when kvpress's assertions are off or its fields were edited
REFUSED = {
    "PerLayerCompressionPress": lambda: bypass(PerLayerCompressionPress, press=prob(), compression_ratios=[0.3, 0.5, 0.7]),
    "KeyRerotationPress": lambda: bypass(KeyRerotationPress, press=prob()),
    "ChunkPress": lambda: bypass(ChunkPress, press=prob(), chunk_length=32),
    "BlockPress": lambda: bypass(BlockPress, press=prob(), block_size=32),
    "AdaKVPress": lambda: bypass(AdaKVPress, press=prob(), alpha_safeguard=0.2),
    # calls nothing of the press during the prefill: refused before the prefill, not at its decoding
    "DecodingPress": lambda: bypass(DecodingPress, base_press=prob(), compression_interval=2, target_size=40,
                                    hidden_states_buffer_size=0, hidden_states_buffer=defaultdict(list),
                                    layer_step_counts=defaultdict(int)),
    # kvpress accepts these two
    "ComposedPress": lambda: ComposedPress([prob(), KnormPress(compression_ratio=0.5)]),
    "PrefillDecodingPress": lambda: PrefillDecodingPress(
        prefilling_press=prob(), decoding_press=DecodingPress(base_press=KnormPress())),
}


def first_layer_inputs(model):
    """Record which attention layers ran their forward (to show a refused prefill stopped at once)."""
    seen = []
    handles = [layer.self_attn.register_forward_hook(lambda m, a, o: seen.append(m.layer_idx))
               for layer in language_model(model).layers]
    return seen, handles


@pytest.mark.parametrize("wrapper", sorted(REFUSED))
def test_unsupported_wrappers_are_refused_before_the_prefill_runs(wrapper):
    model = tiny_model("llama")
    press = REFUSED[wrapper]()
    seen, handles = first_layer_inputs(model)
    with pytest.raises(TypeError, match=f"{wrapper}.*Use instead: .+"):
        run(model, press, random_ids(N))
    for handle in handles:
        handle.remove()
    # refused before the first attention layer ran, so nothing was evicted or skipped; PerLayerCompressionPress
    # never enters the press, so the attention functions may not be wrapped yet: then at that layer's hook
    assert seen in (([], [0]) if wrapper == "PerLayerCompressionPress" else ([],))
    for layer in language_model(model).layers:  # the check registered nothing
        assert not layer.self_attn._forward_pre_hooks and not layer.self_attn._forward_hooks


def test_wrappers_without_a_sampling_press_are_untouched():
    press = AdaKVPress(press=SnapKVPress(compression_ratio=0.5))
    assert press.compression_ratio == 0.5
    with pytest.raises(AssertionError, match="ChunkPress requires a ScorerPress"):
        ChunkPress(press=BasePress())  # kvpress's own check still runs


def test_composed_press_edited_after_construction_is_refused_at_call():
    model = tiny_model("llama")
    composed = ComposedPress([prob()])
    composed.presses.append(KnormPress(compression_ratio=0.5))
    with pytest.raises(TypeError, match="ComposedPress must have the SamplingPress last"):
        run(model, composed, random_ids(N))


def test_decoding_press_is_refused_when_the_pipeline_enters_it():
    model = tiny_model("llama")
    press = bypass(PrefillDecodingPress, prefilling_press=prob(),
                   decoding_press=DecodingPress(base_press=KnormPress(), compression_interval=2, target_size=40))
    with pytest.raises(TypeError, match="PrefillDecodingPress may hold a SamplingPress only as its prefilling_press"):
        run(model, press, random_ids(N))


@pytest.mark.parametrize("method", ["score", "compress"])
def test_a_wrapper_calling_a_method_the_press_lacks_is_refused_by_name(method):
    """A wrapper that skips ``post_init_from_model`` and calls ``score`` / ``compress``: refused there,
    naming the wrapper found on the module's hooks."""
    model = tiny_model("llama")
    press, module = prob(), language_model(model).layers[0].self_attn
    wrapper = bypass(BlockPress, press=press, block_size=32)
    handle = module.register_forward_hook(wrapper.forward_hook, with_kwargs=True)
    with pytest.raises(TypeError, match="BlockPress cannot wrap a SamplingPress.*Use instead"):
        getattr(press, method)(module, None, None, None, None, {})
    handle.remove()
    with pytest.raises(TypeError, match=f"no per-layer {method}.*Use it alone"):
        getattr(press, method)(module, None, None, None, None, {})


@dataclass
class EveryOtherLayer(BasePress):
    """A wrapper this package has never seen, which skips layers: it must not run silently.

    Parameters
    ----------
    press : BasePress
        The wrapped press.
    """

    press: BasePress = None

    def forward_hook(self, module, input, kwargs, output):
        if module.layer_idx % 2 == 0:
            return self.press.forward_hook(module, input, kwargs, output)
        return output


def test_an_unknown_wrapper_is_refused():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="EveryOtherLayer cannot wrap a SamplingPress.*Use instead"):
        run(model, EveryOtherLayer(press=prob()), random_ids(N))


def test_no_wrapper_leaves_a_correction_without_an_eviction():
    """After every refusal above the model holds no correction and no hook: nothing half-done stays behind."""
    model = tiny_model("llama")
    for make in REFUSED.values():
        with pytest.raises(TypeError):
            run(model, make(), random_ids(N))
    for layer in language_model(model).layers:
        assert correction.bias_of(layer.self_attn) is None
        assert not layer.self_attn._forward_pre_hooks and not layer.self_attn._forward_hooks
