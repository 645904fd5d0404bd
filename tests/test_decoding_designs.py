"""Issue 28's decoding designs: variance control of the compounded weights (temperature, cap,
renormalisation), the harmonic prior over the buffered queries, the bias's dtype and equal bytes."""

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import DynamicCache

from evaluation.tasks.streaming.drive import Schedule
from evaluation.tasks.streaming.presses import equal_memory_target, stream_presses
from kvpress_prob.correction import bias as correction
from kvpress_prob.decoding import rounds
from kvpress_prob.decoding.press import SamplingDecodingPress
from kvpress_prob.names.decoding import get_decoding_press
from kvpress_prob.samplers.priority import PrioritySampler
from kvpress_prob.samplers.threshold import ThresholdSampler


def one_round(seed: int = 0):
    """A round on 3 heads of 40 entries with a random earlier bias: (log_weight, bias, drawn, candidates, fixed)."""
    g = torch.Generator().manual_seed(seed)
    bias = (torch.randn(1, 3, 40, generator=g) * 0.7).float()
    real = rounds.is_real(bias)
    fixed = rounds.fixed_entries(real, 2, 4)
    candidates = real & ~fixed
    pi = rounds.proposal_over(torch.rand(1, 3, 40, generator=g, dtype=torch.float64) ** 3, candidates, 0.01)
    drawn, lw = rounds.draw(pi, candidates, torch.full((1, 3), 12), PrioritySampler(), g)
    return lw, bias, drawn, candidates, fixed


def test_controls_of_the_weights():
    lw, bias, drawn, candidates, fixed = one_round()
    plain = rounds.controlled(lw, bias, drawn, candidates)
    torch.testing.assert_close(plain[drawn], lw[drawn])
    assert (plain[~drawn] == 0).all()  # sinks, window and the entries not drawn get nothing
    torch.testing.assert_close(rounds.controlled(lw, bias, drawn, candidates, temperature=2.0)[drawn], lw[drawn] / 2)
    # renormalised: per head, the drawn entries' compounded weights sum to the candidates' before the round
    inc = rounds.controlled(lw, bias, drawn, candidates, renormalise=True)
    old = bias.double()
    after = torch.where(drawn, (old + inc).exp(), 0.0).sum(-1)
    before = torch.where(candidates, old.exp(), 0.0).sum(-1)
    torch.testing.assert_close(after, before, rtol=1e-12, atol=0)
    unscaled = torch.where(drawn, (old + plain).exp(), 0.0).sum(-1)
    assert ((unscaled - before).abs() / before > 1e-3).all()  # so the renormalisation changed something
    # capped: no drawn entry's compounded weight above the cap, the others as without it
    cap = math.log(3.0)
    capped = rounds.controlled(lw, bias, drawn, candidates, max_log_weight=cap)
    new = old + capped
    assert (new[drawn] <= cap + 1e-12).all()
    below = drawn & (old + plain < cap)
    torch.testing.assert_close(capped[below], plain[below])
    assert (drawn & (old + plain > cap)).any()


def test_harmonic_rows_weigh_the_recent_queries_most():
    rows = rounds.harmonic_rows(8)
    assert rows.sum().item() == pytest.approx(8.0)
    assert (rows[1:] > rows[:-1]).all()
    torch.testing.assert_close(rows[-1] / rows[0], torch.tensor(8.0))  # 1/1 over 1/8


def test_harmonic_rows_weigh_the_buffered_attention():
    """buffered_attention with rows = the row-weighted sum of the per-query attention rows (float64 reference)."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 1, 12, 8, generator=g)
    bias = torch.zeros(1, 1, 12)
    rows = rounds.harmonic_rows(5)
    got = rounds.buffered_attention(q, k, bias, 0.35, rows)
    logits = (q.double() @ k.double().transpose(2, 3)) * 0.35  # (1, 2, 5, 12)
    mask = torch.arange(12)[None, :] > 12 - 5 + torch.arange(5)[:, None]
    att = logits.masked_fill(mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(got.double(), (att * rows.double()[:, None]).sum(2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias_dtype, stored", [("keys", torch.bfloat16), ("float32", torch.float32)])
def test_the_bias_is_stored_in_the_dtype_asked(bias_dtype, stored):
    """bias_dtype='keys' stores the compounded bias in the keys' dtype (bfloat16 here), its padding that
    dtype's lowest value (a threshold design pads); 'float32' keeps float32."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = random_ids(64, seed=13)
    press = SamplingDecodingPress(target_size=16, compression_interval=8, hidden_states_buffer_size=8, n_sink=2,
                                  window=4, sampler=ThresholdSampler(), bias_dtype=bias_dtype, seed=1)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(ids[:, :24], past_key_values=cache)
        for t in range(24, 64):
            model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]]))
        biases = [correction.bias_of(layer.self_attn, cache) for layer in model.model.layers]
    assert all(b.dtype == stored for b in biases)
    assert any(correction.is_padding(b).any() for b in biases)  # padding kept as padding
    real = torch.cat([b[~correction.is_padding(b)].float() for b in biases])
    assert real.abs().max() < 50 and (real > 0.05).any()


def test_equal_bytes_in_the_dtypes_stored():
    """A float32 bias beside bfloat16 keys costs 2 key values: 256 -> 252 entries at head_dim 64; a bias in
    the keys' dtype (or float32 beside float32 keys) costs one: 254."""
    assert equal_memory_target(256, 64, 2, 4) == 252
    assert equal_memory_target(256, 64, 2, 2) == equal_memory_target(256, 64, 4, 4) == 254
    assert equal_memory_target(512, 64) == 508
    build = stream_presses()["prob_decode_min_variance_priority"]
    schedule = Schedule(n=1024, budget=256, chunk=32, interval=32)
    assert build(schedule, 0, 64, torch.bfloat16).target_size == 252
    assert build(schedule, 0, 64, torch.float32).target_size == 254
    assert stream_presses()["prob_decode_min_variance_priority_nocorr"](schedule, 0, 64, torch.bfloat16).target_size == 256
    for b in (128, 256, 512):  # what is held fits: keys + values + bias <= the budget's keys + values
        for kv, bias in ((2, 4), (2, 2), (4, 4)):
            held = equal_memory_target(b, 64, kv, bias)
            assert held * (128 * kv + bias) <= b * 128 * kv < (held + 1) * (128 * kv + bias)


@pytest.mark.parametrize("name", ["prob_decode_min_variance_h_priority", "prob_decode_min_variance_priority_t2",
                                  "prob_decode_min_variance_priority_cap16", "prob_decode_min_variance_priority_renorm",
                                  "prob_decode_min_variance_priority_floor20"])
def test_design_names_build_and_decode(name):
    model = tiny_model("llama")
    ids = random_ids(72, seed=17)
    press = get_decoding_press(name, 20, 8, window=4, seed=2)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(ids[:, :24], past_key_values=cache)
        for t in range(24, 72):
            logits = model(ids[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[t]])).logits
    assert torch.isfinite(logits).all()
    assert cache.layers[0].keys.shape[2] <= 20 + 8 and press.stats["rounds"] >= 3 * 5


def test_weights_watch_follows_positions_and_weights():
    """experiments.stream_weights on a tiny model: the full cache has equal weights counting every token
    seen; a corrected press's weights, after rounds, are unequal (ESS < 1), and the positions it follows are
    the ones its layer-0 keys hold (layer 0's keys depend only on token and position)."""
    from experiments.stream_weights import Watch, summarise, watch_stream

    model = tiny_model("llama")
    ids = random_ids(32 + 8 * 6 + 9, seed=19)
    schedule = Schedule(n=ids.shape[1], budget=32, chunk=4, interval=8)
    full = summarise(watch_stream(model, ids, None, schedule, [2, 4]))
    assert set(full) == {2, 4}
    for r in full.values():
        assert r["ess"] == pytest.approx(1.0) and r["sum_w_over_seen"] == pytest.approx(1.0) and r["max_w"] == 1.0
        assert 0 < r["old_share"] < 1
    press = get_decoding_press("prob_decode_min_variance_priority", 24, 2, window=4, seed=0)
    state = {}
    ours = summarise(watch_stream(model, ids, press, schedule, [2, 4], state))
    assert set(ours) == {2, 4} and ours[4]["ess"] < 1 and ours[4]["max_w"] > 1
    reference = DynamicCache()
    with torch.no_grad():
        model(ids[:, :schedule.end], past_key_values=reference)
    held, positions = state["cache"].layers[0].keys[0], state["positions"][0]  # (H_kv, n, d), (H_kv, n)
    assert positions.shape == held.shape[:2] and (positions >= 0).all()
    for h in range(held.shape[0]):
        torch.testing.assert_close(held[h], reference.layers[0].keys[0, h, positions[h]], atol=1e-5, rtol=1e-5)
    assert isinstance(Watch, type)
