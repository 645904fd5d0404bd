"""The decoding press with per-head budgets (kvpress_prob/decoding/heads.py) on the ragged cache
(kvpress_prob/cache/folded.py): its allocation against a brute-force loop, a round's kept set against explicit
scores read from an unpressed run, its logits against a float64 dense attention with per-head masks over exactly
the kept entries, the bytes it holds, generate, the pipeline's crop, same seed same answer, its refusals, and
nothing left behind."""

import copy
from contextlib import nullcontext

import pytest
import torch
from kvpress import KnormPress, KVPressTextGenerationPipeline
from transformers import DynamicCache

from kvpress_prob.cache.folded import FoldedLayer
from kvpress_prob.decoding.heads import HeadBudgetDecodingPress, head_counts
from kvpress_prob.names.decoding import get_decoding_press
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.samplers import TopKSampler
from kvpress_prob.testing.reference import dense_reference, float64_copy
from tests.conftest import TIE, random_ids, tiny_model

N0, STEPS = 40, 8  # prompt length; decoding steps per round
SMALL = dict(target_size=24, compression_interval=STEPS, hidden_states_buffer_size=STEPS, n_sink=2, window=4)


def _brute_counts(weights, candidates, fixed, target_size, alpha):
    """Head by head, then the pooled rest, in Python lists: (counts per head, the relative gap at the layer's
    boundary between the last pooled entry taken and the first left)."""
    H, n = weights.shape
    share = [max(0, target_size - int(fixed[h].sum())) for h in range(H)]
    counts, rest = [], []
    for h in range(H):
        mine = sorted(((float(weights[h, j]), j) for j in range(n) if candidates[h, j]), reverse=True)
        safe = min(int(alpha * share[h]), len(mine))
        counts.append(safe)
        rest += [(w, h) for w, _ in mine[safe:]]
    rest.sort(reverse=True)
    taken = sum(share) - sum(counts)
    for _, h in rest[:taken]:
        counts[h] += 1
    scale = max(abs(w) for w, _ in rest) or 1.0
    gap = (rest[taken - 1][0] - rest[taken][0]) / scale if 0 < taken < len(rest) else 1.0
    return counts, gap


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_head_counts_match_a_brute_force_allocation(alpha):
    g = torch.Generator().manual_seed(int(alpha * 10))
    for case in range(5):
        H, n, target = 4, 60, 20
        real = torch.rand(1, H, n, generator=g) < torch.tensor([0.95, 0.6, 0.3, 0.2])[:, None]  # unequal heads
        fixed = real & (real.long().cumsum(-1) <= 2)  # each head's first 2 real entries
        candidates = real & ~fixed
        weights = torch.rand(1, H, n, generator=g, dtype=torch.float64) ** 3 * candidates
        counts = head_counts(weights, candidates, fixed, target, alpha)
        expected, _ = _brute_counts(weights[0], candidates[0], fixed[0], target, alpha)
        assert counts[0].tolist() == expected
        assert int(counts.sum() + fixed.sum()) == H * target and (counts <= candidates.sum(-1)).all()
    with pytest.raises(ValueError, match="nothing to choose"):
        head_counts(weights, candidates, fixed, 100, alpha)


def _decode(model, press, ids, steps: int, cache=None):
    """Prefill ids[:, :N0] with the press on (a no-op), then feed ids[:, N0:N0 + steps] one token at a time."""
    cache = DynamicCache() if cache is None else cache
    with torch.no_grad(), (press(model) if press is not None else nullcontext()):
        model(input_ids=ids[:, :N0], past_key_values=cache)
        for i in range(N0, N0 + steps):
            model(input_ids=ids[:, i:i + 1], past_key_values=cache, position_ids=torch.tensor([[i]]))
    return cache


def _kept_positions(layer, full_keys) -> list[list[int]]:
    """Per head, the positions of the layer's kept keys in an unpressed run's keys (1, H, n, d), exact matches."""
    positions = []
    for h in range(len(layer.lengths)):
        keys = layer.head(h)[0]
        found = [[j for j in range(full_keys.shape[2]) if torch.equal(k, full_keys[0, h, j])] for k in keys]
        assert all(len(f) == 1 for f in found)
        positions.append([f[0] for f in found])
    return positions


def test_a_round_keeps_adakvs_set_of_explicit_scores_and_decodes_as_float64_dense_attention():
    """K-norm scores (-|k|) read from an unpressed run, shifted per head by their minimum, AdaKV's allocation by
    the brute-force loop, each head's top: exactly the kept entries, in positional order, the window's decoded
    tokens among them; the next forwards (a question, then a step) within 1e-4 of the float64 dense attention
    restricted to them."""
    model = tiny_model("llama")
    model64 = float64_copy(model)
    ids, fed = random_ids(N0 + STEPS, seed=1), random_ids(5, seed=2)
    press = HeadBudgetDecodingPress(proposal="scorer", base_press=KnormPress(), sampler=TopKSampler(),
                                    alpha_safeguard=0.2, **SMALL)
    cache, full = _decode(model, press, ids, STEPS), _decode(model, None, ids, STEPS)
    n = N0 + STEPS
    keep = torch.zeros(len(cache.layers), 1, 2, n, dtype=torch.bool)
    for l, layer in enumerate(cache.layers):
        assert isinstance(layer, FoldedLayer) and layer.get_seq_length() == n and layer.appended == 0
        full_keys = full.layers[l].keys
        weights = -full_keys[0].double().norm(dim=-1)  # (H, n): KnormPress's scores
        weights = weights - weights.amin(-1, keepdim=True)
        fixed = torch.zeros(2, n, dtype=torch.bool)
        fixed[:, :2] = fixed[:, -4:] = True
        counts, gap = _brute_counts(weights, ~fixed, fixed, 24, 0.2)
        assert gap > TIE
        positions = _kept_positions(layer, full_keys)
        for h in range(2):
            top = weights[h].masked_fill(fixed[h], float("-inf")).topk(counts[h]).indices.tolist()
            assert positions[h] == sorted(set(top) | set(range(2)) | set(range(n - 4, n)))
            keep[l, 0, h, positions[h]] = True
        assert sum(layer.lengths) == 2 * 24 and layer.prompt_kept == tuple(sum(p < N0 for p in pos) for pos in positions)
    assert len({c for layer in cache.layers for c in layer.lengths}) > 1  # the heads keep different counts
    reference = dense_reference(model64, ids, fed, keep)
    scale = reference.abs().max()
    assert (dense_reference(model64, ids, fed, None) - reference).abs().max() > 1e-2 * scale  # eviction matters
    with torch.no_grad():
        question = model(input_ids=fed, past_key_values=copy.deepcopy(cache),
                         position_ids=torch.arange(n, n + 5)[None]).logits[0]
        model(input_ids=fed[:, :-1], past_key_values=cache, position_ids=torch.arange(n, n + 4)[None])
        step = model(input_ids=fed[:, -1:], past_key_values=cache, position_ids=torch.tensor([[n + 4]])).logits[0, -1]
    assert (question.double() - reference).abs().max() <= 1e-4 * scale
    assert (step.double() - reference[-1]).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, bias_dtype", [("decode_attn_topk_heads", "float32"),
                                              ("prob_decode_min_variance_priority_floor20_heads", "float32"),
                                              ("prob_decode_min_variance_priority_floor20_heads", "keys")])
def test_bytes_held_are_the_kept_entries_and_less_than_the_padded_layout(dtype, name, bias_dtype):
    """Right after a round each layer holds the storage of exactly its kept entries' K and V (and the sampled
    press's compounded log-weight per kept entry, in its bias dtype), below the padded layout's H max c_h."""
    model = tiny_model("llama", dtype)
    press = get_decoding_press(name, 24, STEPS, bias_dtype=bias_dtype, n_sink=2, window=4)
    cache = _decode(model, press, random_ids(N0 + 2 * STEPS, seed=3), 2 * STEPS)
    d, size = model.config.head_dim, torch.finfo(dtype).bits // 8
    padded = []
    for l, layer in enumerate(cache.layers):
        assert isinstance(layer, FoldedLayer) and sum(layer.capacity) == sum(layer.lengths) == 2 * 24
        kept = sum(layer.lengths)
        weight = 0 if layer.bias is None else kept * layer.bias.element_size()
        assert (layer.bias is None) == (name == "decode_attn_topk_heads")
        if layer.bias is not None:
            assert layer.bias.dtype == (dtype if bias_dtype == "keys" else torch.float32)
        assert layer.nbytes() == 2 * kept * d * size + weight and press.stats["bytes_bias"][l] == weight
        padded.append(2 * len(layer.lengths) * max(layer.lengths) * d * size)
    assert sum(layer.nbytes() - (0 if layer.bias is None else layer.bias.nbytes) for layer in cache.layers) < sum(padded)


def test_generate_same_seed_same_kept_set_and_text_and_nothing_left_behind():
    """``model.generate`` under the sampled press, twice at seed 3: the same tokens and the same kept entries;
    seed 4 keeps another set. Afterwards no hook is left and a plain forward equals a never-pressed model's."""
    model, never = tiny_model("llama"), tiny_model("llama")
    ids = random_ids(N0, seed=5)
    runs = {}
    for seed in (3, 3, 4):
        press = get_decoding_press("prob_decode_min_variance_priority_floor20_heads", 24, STEPS, seed=seed,
                                   n_sink=2, window=4)
        cache = DynamicCache()
        with press(model):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=3 * STEPS,
                                 do_sample=False, eos_token_id=None)
        assert press.stats["rounds"] >= 2 * len(cache.layers)
        assert all(isinstance(layer, FoldedLayer) for layer in cache.layers)
        runs.setdefault(seed, []).append((out[0, N0:].tolist(), [(layer.lengths, layer.flat_keys.clone())
                                                                 for layer in cache.layers]))
    (tokens_a, layers_a), (tokens_b, layers_b) = runs[3]
    assert tokens_a == tokens_b
    assert all(la == lb and torch.equal(ka, kb) for (la, ka), (lb, kb) in zip(layers_a, layers_b))
    assert any(la != lc or not torch.equal(ka, kc) for (la, ka), (lc, kc) in zip(layers_a, runs[4][0][1]))
    for module in language_model(model).layers:
        attn = module.self_attn
        assert not attn._forward_hooks and not attn._forward_pre_hooks
    fresh = random_ids(12, seed=6)
    with torch.no_grad():
        assert torch.equal(model(fresh).logits, never(fresh).logits)


@pytest.mark.parametrize("proposal", ["attention", "h2o"])
def test_rounds_on_a_folded_layer_fold_the_decoded_tokens_again(proposal):
    """Three rounds: each later one reads the folded layer and its decoded tail (h2o's sums following the kept
    entries), keeps H target_size entries, and the prompt's entries stay each head's first."""
    model = tiny_model("qwen3")
    press = HeadBudgetDecodingPress(proposal=proposal, sampler=TopKSampler(), **SMALL)
    ids = random_ids(N0 + 3 * STEPS, seed=7)
    cache = _decode(model, press, ids, 3 * STEPS)
    full = _decode(model, None, ids, STEPS)  # the keys up to the first round are the unpressed run's
    assert press.stats["rounds"] == 3 * len(cache.layers)
    for l, layer in enumerate(cache.layers):
        assert isinstance(layer, FoldedLayer) and layer.get_seq_length() == N0 + 3 * STEPS
        assert sum(layer.lengths) == 2 * 24 and layer.prompt_length == N0
        assert all(p < c for p, c in zip(layer.prompt_kept, layer.lengths))  # decoded tokens kept (the window)
        for h in range(2):
            prompt_keys = layer.head(h)[0][: layer.prompt_kept[h]]
            found = [j for k in prompt_keys for j in range(N0) if torch.equal(k, full.layers[l].keys[0, h, j])]
            assert found == sorted(found) and len(found) == layer.prompt_kept[h]


def test_the_pipeline_answers_and_crops_back_to_the_prompt(tokenizer):
    """kvpress's pipeline (one question) decodes through rounds, then crops its answer off: every layer goes back
    to the context's length and each head to its kept prompt entries; other crops below the round are refused."""
    model = tiny_model("llama")
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context = tokenizer.decode(random_ids(N0, seed=8)[0])
    n = pipe.preprocess(context, ["Why?"], answer_prefix="", max_context_length=10**6)["context_ids"].shape[1]
    press = get_decoding_press("decode_attn_topk_heads", 24, STEPS, n_sink=2, window=4)
    cache = DynamicCache()
    answer = pipe(context, question="Why?", press=press, cache=cache, max_new_tokens=2 * STEPS)["answer"]
    assert isinstance(answer, str) and press.stats["rounds"] >= len(cache.layers)
    for layer in cache.layers:
        assert isinstance(layer, FoldedLayer) and layer.get_seq_length() == n
        assert layer.lengths == layer.prompt_kept and layer.appended == 0
    layer = copy.deepcopy(cache.layers[0])
    with torch.no_grad():
        model(input_ids=random_ids(3, seed=9), past_key_values=cache, position_ids=torch.arange(n, n + 3)[None])
    kept = [cache.layers[0].head(h)[0].clone() for h in range(2)]
    assert all(torch.equal(k, layer.head(h)[0]) for h, k in enumerate(kept))  # the appended tokens sit after them
    folded = FoldedLayer(torch.zeros(6, 4), torch.zeros(6, 4), [4, 2], 50, None, 40, [2, 1])
    with pytest.raises(ValueError, match="folded the positions 40 to 50"):
        folded.crop(45)
    folded.crop(40)
    assert folded.lengths == (2, 1) and folded.get_seq_length() == 40


def test_bad_parameters_are_refused_before_any_forward():
    for bad in (-0.1, 1.5, "0.2", True, float("nan")):
        with pytest.raises(ValueError, match="alpha_safeguard"):
            HeadBudgetDecodingPress(alpha_safeguard=bad)
    with pytest.raises(ValueError, match="alpha_safeguard"):
        get_decoding_press("decode_attn_topk_heads", 24, STEPS, alpha_safeguard=2)
    with pytest.raises(ValueError, match="target_size"):
        get_decoding_press("decode_attn_topk_heads", 4, STEPS)
    model = tiny_model("llama")
    ids = torch.cat([random_ids(N0, seed=1)] * 2)
    press = get_decoding_press("decode_attn_topk_heads", 24, STEPS, n_sink=2, window=4)
    with pytest.raises(ValueError, match="batch size must be 1"), press(model):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)


def test_behind_a_ragged_prefill_press_a_round_reads_each_heads_own_entries():
    """Behind kvpress's PrefillDecodingPress with a ragged AdaKV prefill: the first round reads the ragged layer and
    its appended tail; each head's kept prompt entries are, in order, among what the prefill kept for that head."""
    from kvpress import PrefillDecodingPress

    from kvpress_prob.cache import RaggedLayer
    from kvpress_prob.names.registry import get_press

    model = tiny_model("llama")
    ids = random_ids(100, seed=11)
    prefilled = DynamicCache()
    with torch.no_grad(), get_press("adakv_snapkv_ragged", 0.5)(model):
        model.model(input_ids=ids, past_key_values=prefilled)
    press = PrefillDecodingPress(prefilling_press=get_press("adakv_snapkv_ragged", 0.5),
                                 decoding_press=get_decoding_press("decode_attn_topk_heads", 24, STEPS, n_sink=2, window=4))
    cache = DynamicCache()
    with press(model):
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=STEPS + 1,
                       do_sample=False, eos_token_id=None)
    for layer, before in zip(cache.layers, prefilled.layers):
        assert isinstance(before, RaggedLayer) and isinstance(layer, FoldedLayer) and layer.prompt_length == 100
        assert sum(layer.lengths) == 2 * 24 and layer.appended == 0
        for h in range(2):
            prompt, prefill = layer.head(h)[0][: layer.prompt_kept[h]], before.head(h)[0]
            found = [j for k in prompt for j in range(len(prefill)) if torch.equal(k, prefill[j])]
            assert len(found) == len(prompt) and found == sorted(found)
