"""The engine's batched cache keeps the bias's precision, its shared prefill shares across ratios, and
nothing it or a press sets outlives them on the model."""

import copy
import math

import pytest
import torch
from conftest import random_ids, tiny_model
from kvpress import ComposedPress, KnormPress, SnapKVPress, StreamingLLMPress
from transformers import DynamicCache

from evaluation.engine import Compressed, Prefill, generate_batch, plan, press_prefill, stack
from kvpress_prob import SamplingPress, get_press
from kvpress_prob.correction import corrected_attention as attention
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.prefill_plan import PrefillPlan
from kvpress_prob.presses.sampling import language_model
from kvpress_prob.proposals.base import ScoreProposal


def dense_attention(q, keys, values, log_weights):
    """softmax(q k / sqrt(d) + log w) v in float64, every weight explicit: q (d,), keys, values (S, d)."""
    q, keys, values, log_weights = (x.double() for x in (q, keys, values, log_weights))
    logits = keys @ q / math.sqrt(q.shape[-1]) + log_weights
    return torch.softmax(logits, -1) @ values


def test_stack_keeps_a_float32_bias_beside_bfloat16_keys():
    """A press with ``bias_dtype="float32"`` next to a top-k configuration: the stacked bias stays
    float32, so a log-weight 8.013 is not rounded to bfloat16's 8.0, and the batched attention is
    the dense one with the exact weights (in bfloat16 both entries would weigh e^8 and cancel)."""
    d, s = 16, 3
    keys = torch.zeros(1, 1, s, d, dtype=torch.bfloat16)  # equal logits: only the weights differ
    values = torch.zeros(1, 1, s, d, dtype=torch.bfloat16)
    values[0, 0, 0], values[0, 0, 1] = 1.0, -1.0
    bias = torch.tensor([[[8.013, 8.0, correction.padding(torch.float32)]]])  # (1, 1, S): padding last
    sampled = Compressed([keys.clone()], [values.clone()], [bias])
    topk = Compressed([keys[:, :, :2].clone()], [values[:, :, :2].clone()], [None])
    _, biases = stack([sampled, topk], room=1)
    assert biases[0].dtype == torch.float32
    assert biases[0][0, 0, 0].item() == torch.tensor(8.013).item()  # float32's 8.013, not bfloat16's 8.0
    assert correction.is_padding(biases[0]).tolist() == [[[False, False, True]], [[False, False, True]]]
    # one decoding query on [the 3 stored entries | 1 new token], the new token's logit far below
    q = torch.zeros(1, 1, 1, d, dtype=torch.bfloat16)
    new_key = torch.full((1, 1, 1, d), -4.0, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    k = torch.cat([keys, new_key], 2)
    v = torch.cat([values, torch.zeros(1, 1, 1, d, dtype=torch.bfloat16)], 2)
    out = attention.corrected_sdpa(q, k, v, biases[0][:1], scaling=None)[0, 0, 0]  # (d,)
    # the dense reference over the two real entries and the new token (its bias 0), padding left out
    reference = dense_attention(q[0, 0, 0], k[0, 0, [0, 1, 3]], v[0, 0, [0, 1, 3]], torch.tensor([8.013, 8.0, 0.0]))
    assert abs(reference[0].item() - math.tanh(0.013 / 2)) < 1e-5  # the new token weighs nothing here
    # bfloat16 attention rounds each of the two weights (about 1/2) by at most half its ulp, 2^-9: the
    # output is within 2^-8 of the dense 0.0065, while a bfloat16 bias (both weights e^8) gives 0
    torch.testing.assert_close(out.double(), reference, atol=2**-8, rtol=0)


# ---- the shared prefill shares across ratios (a count of stored score tensors) ----


def test_one_prefill_stores_one_score_table_per_scorer_for_every_ratio():
    """prob_snapkv and snapkv at three ratios each: SnapKV's scores do not read the ratio, so the
    prefill stores one proposal table and one score table (a (1, H_kv, n) tensor per layer each),
    and every ratio compresses as its own prefill under the press would (kvpress's path)."""
    model, ids = tiny_model("llama"), random_ids(80, seed=3)
    ratios = (0.25, 0.5, 0.75)
    presses = [make(name, r) for name in ("prob_snapkv", "snapkv") for r in ratios]
    shared = Prefill(model, ids, presses)
    tensors = [t for table in shared.stored.values() for t in table.values()]
    assert len(shared.stored) == 2 and len(tensors) == 2 * model.config.num_hidden_layers
    assert shared.prefills == 1
    for press in presses:
        ours = shared.compress(press)
        reference = press_prefill(model, ids, make(press_name(press), press.compression_ratio))
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(ours.layers, reference.layers)), press
    assert len(shared.stored) == 2 and shared.prefills == 1  # nothing computed again


def press_name(press):
    return "prob_snapkv" if isinstance(press, SamplingPress) else "snapkv"


def make(name, ratio):
    return get_press(name, ratio, seed=1) if name.startswith("prob") else get_press(name, ratio)


class OwnPrefillSnapKV(SnapKVPress):
    """A kvpress scorer that declares it needs a prefill of its own."""

    def prefill_plan(self, model, n):
        return PrefillPlan("prefill")


def test_the_plan_is_the_one_a_press_declares_else_kvpress_s_interface():
    """A press's ``prefill_plan`` decides, before anything the engine reads from kvpress's classes: the same
    scorer replays its stored scores without it and runs a prefill of its own with it, and both compress as a
    prefill under the press would."""
    model, ids = tiny_model("llama"), random_ids(80, seed=3)
    declared, plain = OwnPrefillSnapKV(compression_ratio=0.5), SnapKVPress(compression_ratio=0.5)
    assert plan(model, plain, 80).kind == "scores" and plan(model, declared, 80).kind == "prefill"
    assert plan(model, get_press("prob_snapkv", 0.5), 80).kind == "sampling"
    assert plan(model, get_press("prob_snapkv", 0.0), 80).kind == "full"
    shared = Prefill(model, ids, [plain, declared])
    assert list(shared.stored) == [plan(model, plain, 80).key] and shared.prefills == 1
    reference = press_prefill(model, ids, SnapKVPress(compression_ratio=0.5))
    for press in (plain, declared):
        ours = shared.compress(press)
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(ours.layers, reference.layers)), press
    with pytest.raises(ValueError, match="kind must be one of"):
        PrefillPlan("replay")


def test_a_scorer_that_reads_the_ratio_keeps_one_table_per_ratio():
    """StreamingLLM's scores depend on its ratio: one proposal per ratio, each the pipeline's."""
    model, ids = tiny_model("llama"), random_ids(80, seed=3)
    presses = [get_press("prob_streaming_llm", r, seed=2) for r in (0.25, 0.75)]
    shared = Prefill(model, ids, presses)
    assert len(shared.proposals) == 2
    for press in presses:
        ours = shared.compress(press)
        reference = press_prefill(model, ids, get_press("prob_streaming_llm", press.compression_ratio, seed=2))
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(ours.layers, reference.layers))


def test_entering_a_sampling_press_leaves_the_users_scorer_unchanged():
    model, ids = tiny_model("llama"), random_ids(96)
    for scorer in (SnapKVPress(), StreamingLLMPress(n_sink=2)):
        before = repr(scorer), copy.deepcopy(vars(scorer))
        press = SamplingPress(proposal=ScoreProposal(scorer=scorer), compression_ratio=0.5)
        with torch.no_grad(), press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
        assert press.stats["realised_ratio"] > 0.2  # it did evict
        assert repr(scorer) == before[0] and vars(scorer).keys() == before[1].keys()
        assert all(vars(scorer)[k] == v for k, v in before[1].items())
        assert press.proposal.scorer is scorer  # the press's own field is the user's object


# ---- nothing of ours is left on the model ----


def ours(model) -> list[str]:
    """What an attention module carries that a press or the engine put there: hooks, a mask (kvpress's
    attention sets ``masked_key_indices = None`` at every prefill: only a mask counts)."""
    found = []
    for layer in language_model(model).layers:
        module = layer.self_attn
        found += [f"{module.layer_idx}: pre-hook" for _ in module._forward_pre_hooks]
        found += [f"{module.layer_idx}: forward hook" for _ in module._forward_hooks]
        found += [f"{module.layer_idx}: mask"] if getattr(module, "masked_key_indices", None) is not None else []
    return found


def test_entering_a_composed_press_without_a_forward_leaves_nothing():
    model = tiny_model("llama")
    press = ComposedPress([KnormPress(compression_ratio=0.25), get_press("prob_knorm", 0.5)])
    with press(model):
        inside = ours(model)
    assert inside == [f"{i}: forward hook" for i in range(3)]  # kvpress's own hooks, and nothing of ours
    assert ours(model) == []


def test_the_engine_leaves_no_mask_or_hook_after_an_example(tokenizer):
    """Planning, compressing (AdaKV masks the modules), detaching and batched decoding of one example:
    afterwards no attention module holds a hook or a ``masked_key_indices`` it did not have."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    ids = random_ids(80, seed=5)
    names = ["snapkv", "adakv_snapkv", "prob_min_h", "prob_knorm"]
    presses = [get_press(name, 0.5) for name in names]
    shared = Prefill(model, ids, presses)
    for press in presses:
        plan(model, press, 80)
    assert ours(model) == []
    items = []
    for press in presses:
        items.append(Compressed.take(shared.compress(press), language_model(model).layers))
        assert ours(model) == [], press
    answers = generate_batch(model, tokenizer, random_ids(4, seed=6), items, 80, 3)
    assert len(answers) == len(names)
    del items
    assert ours(model) == [] and not any(layer.self_attn in correction._STATES for layer in language_model(model).layers)


def test_padding_is_one_value_per_dtype_wherever_it_is_stored():
    """``correction.padding`` of the bias's own dtype marks exactly the padded slots of an evicted
    cache (head h keeps counts[h] entries; bfloat16 keys, a float32 and a bfloat16 bias), and a cast
    keeps it padding (a plain cast of float32's lowest to bfloat16 is -inf)."""
    model, ids = tiny_model("llama", dtype=torch.bfloat16), random_ids(96, seed=1)
    for bias_dtype, dtype in (("float32", torch.float32), ("keys", torch.bfloat16)):
        press = get_press("prob_min_h", 0.5, bias_dtype=bias_dtype)
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model.model(input_ids=ids, past_key_values=cache)
        for module, counts in zip((layer.self_attn for layer in language_model(model).layers), press.stats["kept"]):
            bias = correction.bias_of(module, cache)  # (1, H_kv, S)
            assert bias.dtype == dtype
            slots = torch.arange(bias.shape[-1])[None, :] >= torch.tensor(counts)[:, None]  # (H_kv, S)
            assert torch.equal(correction.is_padding(bias)[0], slots)
    lowest = torch.tensor([0.5, correction.padding(torch.float32)])
    assert torch.isinf(lowest.to(torch.bfloat16)[1])
    assert correction.is_padding(correction.cast(lowest, torch.bfloat16)).tolist() == [False, True]
    bf16_lowest = torch.tensor([0.5, correction.padding(torch.bfloat16)], dtype=torch.bfloat16)
    assert correction.is_padding(correction.cast(bf16_lowest, torch.float32)).tolist() == [False, True]
