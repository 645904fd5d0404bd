"""SamplingPress and the registry through the kvpress pipeline and model.generate."""

import pytest
import torch
from conftest import random_ids, tiny_model
from kvpress import AdaKVPress, KVPressTextGenerationPipeline, KVzipPress
from transformers import DynamicCache

from evaluation.engine import Prefill, plan
from kvpress_prob import PRESSES, SamplingPress, get_press
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.samplers import PoissonSampler, TopKSampler


def prefill(model, press, n=128, seed=0):
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=random_ids(n, seed), past_key_values=cache)
    return cache


def greedy(model, cache, start, n_tokens=6):
    """The pipeline's greedy loop, explicit position ids from the original context length."""
    token, out = random_ids(1, seed=9), []
    with torch.no_grad():
        for i in range(n_tokens):
            logits = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[start + i]])).logits
            token = logits[:, -1:].argmax(-1)
            out.append(int(token))
    return out


def test_same_seed_same_kept_set_and_answer(model):
    runs = []
    for seed in (3, 3, 4):
        press = get_press("prob_min_h", 0.5, seed=seed)
        cache = prefill(model, press)
        runs.append((press.last_draw.keep.clone(), greedy(model, cache, 128), cache.layers[1].keys.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][2], runs[1][2])
    assert not torch.equal(runs[0][0], runs[2][0])


def test_cache_holds_only_kept_entries_plus_padding(model):
    press = get_press("prob_min_h", 0.5)
    cache = prefill(model, press, n=200)
    stats = press.stats
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    assert held == stats["bytes_stored"]
    assert stats["bytes_full"] == 200 * 2 * 16 * 4 * 2 * len(cache.layers)
    # kept bytes are the realised kept fraction of the full cache; stored = kept x padding
    assert stats["bytes_kept"] == pytest.approx((1 - stats["realised_ratio"]) * stats["bytes_full"])
    assert held <= (1 - stats["realised_ratio"]) * stats["bytes_full"] * stats["padding"] + 1
    assert 1.0 <= stats["padding"] < 1.3 and held < 0.65 * stats["bytes_full"]
    # each layer stores exactly its largest head
    for layer, kept, stored in zip(cache.layers, stats["kept"], stats["stored"]):
        assert layer.keys.shape[2] == stored == max(kept)


@pytest.mark.parametrize("budget", ["global", "layer", "head"])
def test_realised_ratio_through_the_press(budget):
    model = tiny_model("llama", layers=4)
    realised = []
    for seed in range(8):
        press = get_press("prob_snapkv", 0.6, budget=budget, seed=seed)
        prefill(model, press, n=256)
        realised.append(press.stats["realised_ratio"])
    # sd of one run <= 0.5 / sqrt(4 * 2 * 256) = 0.011; of the mean of 8, 0.004
    assert abs(sum(realised) / 8 - 0.6) < 0.01


def test_zero_ratio_leaves_the_cache_untouched(model):
    press = get_press("prob_min", 0.0)
    cache = prefill(model, press, n=64)
    assert all(layer.keys.shape[2] == 64 for layer in cache.layers)
    assert all(correction.bias_of(layer.self_attn) is None for layer in language_model(model).layers)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(compression_ratio=1.0), "compression_ratio"),
        (dict(compression_ratio=-0.1), "compression_ratio"),
        (dict(compression_ratio=0.5, temperature=0.0), "temperature"),
        (dict(compression_ratio=0.5, temperature=-1.0), "temperature"),
        (dict(compression_ratio=0.5, temperature=float("nan")), "temperature"),
        (dict(compression_ratio=0.5, budget="model"), "budget"),
    ],
)
def test_bad_parameters_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingPress(**kwargs)


@pytest.mark.parametrize("fields,match", [(dict(alpha=1.0), "alpha"), (dict(alpha=-0.1), "alpha"), (dict(n_sink=-1), "n_sink")])
def test_bad_sampler_parameters_name_themselves(fields, match):
    with pytest.raises(ValueError, match=match):
        PoissonSampler(**fields)


def test_get_press_routes_overrides_to_press_sampler_and_proposal():
    press = get_press("prob_min_h", 0.5, seed=3, alpha=0.25, chunk_size=64)
    assert press.seed == 3 and press.sampler.alpha == 0.25 and press.proposal.chunk_size == 64
    press = get_press("prob_tova", 0.5, sampler="topk", budget="head")
    assert isinstance(press.sampler, TopKSampler) and press.budget == "head"
    with pytest.raises(ValueError, match="unknown sampler"):
        get_press("prob_tova", 0.5, sampler="magic")
    with pytest.raises(ValueError, match="no field 'chunk_size'"):
        get_press("prob_tova", 0.5, chunk_size=3)  # a scorer proposal has no chunks


def test_unknown_press_lists_valid_names():
    with pytest.raises(ValueError, match="Valid parts: .*min_h"):
        get_press("prob_magic", 0.5)
    with pytest.raises(ValueError, match="compression_ratio"):
        get_press("snapkv", 1.2)
    with pytest.raises(ValueError, match="no field"):
        get_press("prob_min", 0.5, tau=2)


def test_eager_attention_is_refused():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        prefill(model, get_press("prob_min", 0.5))


def test_batch_larger_than_one_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="batch size 2"):
        with torch.no_grad(), get_press("prob_min", 0.5)(model):
            model.model(input_ids=random_ids(64).repeat(2, 1), past_key_values=DynamicCache())


def test_sinks_and_window_exceeding_the_budget_are_refused():
    with pytest.raises(ValueError, match="n_sink \\+ window"):
        prefill(tiny_model("llama"), get_press("prob_min", 0.9, n_sink=4, window=16), n=64)


def distinct_presses() -> list[str]:
    """One registry name per distinct kind of press: the press class, its proposal (and scorer)
    class, its sampler class and whether it sharpens; AdaKV and kvpress's KVzip, which masks as AdaKV
    does, left out (see below; KVzip runs on the embedded model in test_kvzip.py). The uncorrected
    ablations are the same presses with the bias at 0 (tests/test_correction.py)."""
    seen, names = set(), []
    for name in PRESSES:
        press = get_press(name, 0.5)
        if isinstance(press, (AdaKVPress, KVzipPress)):
            continue
        kind = (type(press),)
        if isinstance(press, SamplingPress):
            scorer = getattr(press.proposal, "scorer", None)
            kind += (type(press.proposal), type(scorer), type(press.sampler), press.proposal.sharpness != 1)
        if kind not in seen:
            seen.add(kind)
            names.append(name)
    return names


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_kind_of_registry_press_runs_in_the_pipeline_and_generate(arch, tokenizer):
    model = tiny_model(arch)
    model.generation_config.eos_token_id = 2
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context = " ".join(f"word{i}" for i in range(60))
    ids = tokenizer(context, return_tensors="pt").input_ids
    # kvpress's AdaKV needs queries in a half-space (its fake-key search), which random tiny models
    # do not have: it runs on the embedded model in test_embedded.py
    inputs = pipe.preprocess(context, ["What is word7?"], "", 10**9)
    for name in distinct_presses():
        press = get_press(name, 0.5)
        answer = pipe(context, question="What is word7?", press=press, max_new_tokens=4)["answer"]
        # the pipeline's answer is the greedy decoding written out, on the same compressed cache
        assert answer == explicit_answer(model, tokenizer, press, inputs, 4), name
        # generate (batch 1) must agree with the explicit greedy loop on the same compressed cache
        with torch.no_grad(), press(model):
            generated = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)[0, ids.shape[1]:]
        expected = prefill_and_decode(model, press, ids, 4)
        assert generated.tolist() == expected, name
        check_kept(model, press, inputs["context_ids"], name)


def check_kept(model, press, ids, name):
    """What ``press`` keeps in a prefill, against a plain prefill of ``ids``: a SamplingPress's cache
    holds, head by head, the plain keys at its drawn positions, and its kept count is within 5
    standard deviations of (1 - r) N (N entries drawn independently: variance <= N / 4; a
    fixed-count design is closer); a kvpress top-k press holds the plain keys at the top
    int((1 - r) n) of its scores (kvpress's ``ScorerPress.compress``, done here with torch.topk)."""
    n = ids.shape[1]
    full, cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=full)
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
    if isinstance(press, SamplingPress):
        keep = press.last_draw.keep  # (L, 1, H_kv, n)
        for layer, plain, kept in zip(cache.layers, full.layers, keep):
            for h in range(kept.shape[1]):
                count = int(kept[0, h].sum())
                assert torch.equal(layer.keys[0, h, :count], plain.keys[0, h, kept[0, h]]), name
        N = keep.numel()
        held = keep.sum().item() + press.stats.get("virtual", 0) * keep.shape[0] * keep.shape[2]  # summaries' c per head
        assert press.stats["realised_ratio"] == pytest.approx(1 - held / N, abs=1e-12), name
        assert abs(press.stats["realised_ratio"] - 0.5) < 5 * (N / 4) ** 0.5 / N, name
        return
    step = plan(model, press, n)
    if step.kind == "scores":
        scores = Prefill(model, ids, [press]).stored[step.key]  # the press's own score, per layer
        for i, (layer, plain) in enumerate(zip(cache.layers, full.layers)):
            top = scores[i].topk(int(n * 0.5), dim=-1).indices  # (1, H_kv, k)
            expected = plain.keys.gather(2, top[..., None].expand(-1, -1, -1, plain.keys.shape[-1]))
            assert torch.equal(layer.keys, expected), name


def prefill_and_decode(model, press, ids, n_tokens, question_ids=None):
    """The same greedy decoding written out: compressed prefill of ``ids``, then (``question_ids`` fed
    first, if given) one token at a time."""
    cache = DynamicCache()
    n = ids.shape[1]
    with torch.no_grad():
        with press(model):
            token = model(input_ids=ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        if question_ids is not None:
            positions = torch.arange(n, n + question_ids.shape[1])[None]
            token = model(input_ids=question_ids, past_key_values=cache, position_ids=positions).logits[:, -1:].argmax(-1)
            n += question_ids.shape[1]
        out = [int(token)]
        for i in range(n_tokens - 1):
            logits = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[n + i]])).logits
            token = logits[:, -1:].argmax(-1)
            out.append(int(token))
    return out


def explicit_answer(model, tokenizer, press, inputs, n_tokens):
    """The kvpress pipeline's answer computed by hand: the press prefills the context, the question is fed
    on the compressed cache, greedy tokens up to the first stop token after the first (kept, then
    dropped as special), decoded."""
    tokens = prefill_and_decode(model, press, inputs["context_ids"], n_tokens, inputs["questions_ids"][0])
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    end = next((i + 1 for i in range(1, len(tokens)) if tokens[i] in stop), len(tokens))
    return tokenizer.decode(tokens[:end], skip_special_tokens=True)


def test_recommended_presses_are_registered_and_deterministic():
    from kvpress_prob.presses.gate_profile import ProfileGatePress
    from kvpress_prob.presses.kvzip_alloc import KVzipAllocatedPress
    from kvpress_prob.presses.ragged_presses import KVzipRaggedPress
    from kvpress_prob.proposals.attention import SampledMinVarianceProposal
    from kvpress_prob.samplers.cross import CrossTopSampler
    from kvpress_prob.names.registry import (RECOMMENDED, RECOMMENDED_FAST, RECOMMENDED_PROSE, RECOMMENDED_RETRIEVAL,
                                             RECOMMENDED_SLOW, is_sampling)

    picks = (RECOMMENDED, RECOMMENDED_FAST, RECOMMENDED_PROSE, RECOMMENDED_RETRIEVAL, RECOMMENDED_SLOW)
    assert all(name in PRESSES for name in picks)  # learned presses build by name, outside the catalogue sweeps
    for name in (RECOMMENDED, RECOMMENDED_FAST, RECOMMENDED_PROSE):  # the profile's counts: gate's top, pi_min-h's
        press = get_press(name, 0.5)
        assert isinstance(press, ProfileGatePress) and isinstance(press.fill, SampledMinVarianceProposal)
        assert (press.fill_share, press.fill.query_rows, press.scope) == (0.75, 256, "head")
        with pytest.raises(ValueError, match="no field 'correct'"):  # deterministic: nothing to correct
            get_press(name, 0.5, correct=False)
    press = get_press(RECOMMENDED_SLOW, 0.5)  # KVzip's top and pi_min-h's top in each head's count, no weights
    assert isinstance(press, KVzipRaggedPress) and isinstance(press.sampler, CrossTopSampler)
    assert press.sampler.alpha == 0.5 and not press.sampler.random
    assert isinstance(get_press(RECOMMENDED_RETRIEVAL, 0.5), KVzipAllocatedPress)
    assert not any(map(is_sampling, picks))
