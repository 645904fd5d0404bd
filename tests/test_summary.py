"""Evicted-set summaries (kvpress_prob/presses/summary.py) against a dense reference with explicit virtual
entries, in the pipeline, the shared-prefill runner's batch, generate and bf16."""

import math
from dataclasses import fields

import pytest
import torch
from conftest import tiny_model
from kvpress import KeyDiffPress, KVPressTextGenerationPipeline
from test_runner import examples, one_and_batched

from evaluation.engine import Prefill
from evaluation.engine.runner import configurations
from kvpress_prob import get_press
from kvpress_prob.correction import bias as correction
from kvpress_prob.correction.corrected_attention import corrected_sdpa
from kvpress_prob.presses.sampling import SamplingPress
from kvpress_prob.proposals.base import ScoreProposal
from kvpress_prob.samplers.threshold import ThresholdSampler
from kvpress_prob.presses.spans import SpanPress
from kvpress_prob.samplers.spans import SpanSampler
from kvpress_prob.presses.summary import Summary, SummaryPress, SummarySamplingPress, summarised


def slow_reference(query, entries, scaling):
    """Attention of one query (H_q, d) over explicit (weight, key, value) entries per KV head, in a
    Python loop: sum_j a_j e^{q.k_j s} v_j / sum_j a_j e^{q.k_j s}."""
    hq, hkv = query.shape[0], len(entries)
    out = torch.zeros(hq, len(entries[0][0][2]), dtype=torch.float64)
    for h in range(hq):
        head = entries[h // (hq // hkv)]
        scores = [a * math.exp(float(query[h].double() @ k.double()) * scaling) for a, k, _ in head]
        out[h] = sum(s * v.double() for s, (_, _, v) in zip(scores, head)) / sum(scores)
    return out


def segments(evicted_positions, V):
    """Split a list of positions into V runs of equal count, the first runs shorter by rounding."""
    m = len(evicted_positions)
    return [[p for r, p in enumerate(evicted_positions) if r * V // m == j] for j in range(V)]


def test_summary_bias_against_hand_written_entries():
    """One head, six entries, written out by hand: entries 0 and 3 kept with importance weights 1
    and 4, a padding slot, entries {1, 2} and {4, 5} evicted into two segments, tau = 0.5. The
    weights are 1, 1 + 0.5 * 3 = 2.5, 0 (padding), 0.5 * 2 = 1 and 1 (the two virtual entries, at
    the means of their keys and values), 1 for the new token (key and value 0)."""
    k = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-1.0, 0.5], [2.0, -1.0], [0.0, -2.0]])
    v = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 1.0], [-2.0, 0.0], [1.0, 1.0], [4.0, 2.0]])
    evicted = torch.tensor([[[False, True, True, False, True, True]]])
    summary = Summary(n_virtual=2, grouping="segments", weight=0.5)
    count, key_mean, value_mean = summary.summarise(k[None, None], v[None, None], evicted)
    stored_log_w = torch.tensor([[[0.0, math.log(4.0), 0.0]]])  # kept 0, kept 3, padding
    real = torch.tensor([[[True, True, False]]])
    kept_bias, virtual_bias = summary.log_weights(count, stored_log_w, real)
    stored_k = torch.cat([k[[0, 3]], torch.full((1, 2), 7.0), key_mean[0, 0], torch.zeros(1, 2)])[None, None]
    stored_v = torch.cat([v[[0, 3]], torch.full((1, 2), 9.0), value_mean[0, 0], torch.zeros(1, 2)])[None, None]
    query = torch.tensor([[[[0.7, -0.4]]]])
    ours = corrected_sdpa(query, stored_k, stored_v, torch.cat([kept_bias, virtual_bias], -1), 1.0)[0, 0, 0]
    entries = [[(1.0, k[0], v[0]), (2.5, k[3], v[3]),
                (1.0, torch.tensor([0.5, 1.5]), torch.tensor([1.5, 0.0])),  # mean of entries 1 and 2
                (1.0, torch.tensor([1.0, -1.5]), torch.tensor([2.5, 1.5])),  # mean of entries 4 and 5
                (1.0, torch.zeros(2), torch.zeros(2))]]
    reference = slow_reference(query[0, :, 0], entries, 1.0)[0]
    torch.testing.assert_close(ours.double(), reference, atol=1e-6, rtol=1e-6)
    assert count.tolist() == [[[2.0, 2.0]]]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summary_attention_equals_explicit_virtual_entries(sampled, dtype):
    """The whole path (prefill, draw or top-k, cut, summary, bias) against dense attention over the
    explicit entries: each kept position with its weight (1 for top-k; for the priority draw,
    whose w_i the draw reports, tau for the entry itself plus (1 - tau) for its w_i sampled
    copies), each segment of evicted positions as one entry at its mean key and value of weight
    tau * |segment|, computed from the full keys in a Python loop."""
    model = tiny_model("llama", dtype=dtype)
    n, V, tau = 48, 3, 0.5
    ids = torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(1))
    summary = Summary(n_virtual=V, grouping="segments", weight=tau)
    if sampled:
        press = get_press("prob_tova_priority", 0.5)
        press = SummarySamplingPress(proposal=press.proposal, sampler=press.sampler, compression_ratio=0.5,
                                     budget="head", seed=3, summary=summary)
    else:
        press = SummaryPress(press=KeyDiffPress(compression_ratio=0.5), summary=summary)
    shared = Prefill(model, ids)
    cache = shared.compress(press)
    layer_idx = 1
    full_keys, full_values = shared.keys[layer_idx][0], shared.values[layer_idx][0]  # (H_kv, n, d)
    keys, values = cache.layers[layer_idx].keys, cache.layers[layer_idx].values
    module = shared.layers[layer_idx].self_attn
    bias = correction.bias_of(module, cache)
    hkv = full_keys.shape[0]
    assert keys.shape[2] == n // 2  # equal memory: kvpress's count, V of them virtual
    entries = []
    for g in range(hkv):
        if sampled:
            keep = press.last_draw.keep[layer_idx, 0, g]
            w = press.last_draw.log_weight[layer_idx, 0, g].double().exp()
        else:
            real = keys[0, g, : keys.shape[2] - V]
            keep = (full_keys[g][:, None, :] == real[None]).all(-1).any(-1)
            w = torch.ones(n, dtype=torch.float64)
        assert int(keep.sum()) == n // 2 - V  # V fewer real entries than the budget
        head = [(tau + (1 - tau) * float(w[i]), full_keys[g, i], full_values[g, i]) for i in keep.nonzero()[:, 0]]
        for group in segments((~keep).nonzero()[:, 0].tolist(), V):
            head.append((tau * len(group), full_keys[g, group].double().mean(0), full_values[g, group].double().mean(0)))
        head.append((1.0, torch.zeros(16), torch.zeros(16)))  # the new token: key 0, value 0
        entries.append(head)
    if sampled:
        assert any(a > 1.5 for head in entries for a, _, _ in head[: n // 2 - V])  # weights other than 1 are tested
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    scaling = 16 ** -0.5
    # the fast path: corrected attention over the stored entries (real, virtual) and a new token (key, value 0)
    new_k, new_v = torch.zeros(1, hkv, 1, 16, dtype=dtype), torch.zeros(1, hkv, 1, 16, dtype=dtype)
    ours = corrected_sdpa(query, torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2), bias, scaling)
    reference = slow_reference(query[0, :, 0], entries, scaling)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: keys, values and means rounded to 8 bits
    torch.testing.assert_close(ours[0, 0].double(), reference, atol=tol, rtol=tol)
    # without the summary the attention differs: the test can fail
    plain = slow_reference(query[0, :, 0], [head[: n // 2 - V] + head[-1:] for head in entries], scaling)
    assert (plain - reference).norm() > 5 * (ours[0, 0].double() - reference).norm()


def test_kmeans_finds_separated_clusters_and_counts():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[5.0, 0.0], [-5.0, 0.0], [0.0, 5.0]])
    labels = torch.tensor([0] * 7 + [1] * 4 + [2] * 9)[torch.randperm(20, generator=g)]
    keys = (centres[labels] + 0.1 * torch.randn(20, 2, generator=g))[None, None]  # (1, 1, 20, 2)
    evicted = torch.ones(1, 1, 20, dtype=torch.bool)
    evicted[..., :2] = False  # two kept entries are not summarised
    count, key_mean, value_mean = Summary(n_virtual=3, iterations=10).summarise(keys, keys, evicted)
    expected = sorted(int(((labels == j) & evicted[0, 0]).sum()) for j in range(3))
    assert sorted(count[0, 0].tolist()) == expected
    for j in range(3):  # each mean is one centre's
        assert (key_mean[0, 0, j][None] - centres).norm(dim=-1).min() < 0.2
    assert Summary(n_virtual=3, grouping="segments").summarise(keys, keys, evicted)[0].tolist() == [[[6.0, 6.0, 6.0]]]


def test_equal_memory_and_tempered_weights():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 100, (1, 64), generator=torch.Generator().manual_seed(0))
    shared = Prefill(model, ids)
    plain = shared.compress(get_press("keydiff", 0.75))
    for name in ["keydiff_sum4", "keydiff_sum4_tau0.1", "keydiff_sum1_seg"]:
        cache = shared.compress(get_press(name, 0.75))
        assert [lay.keys.shape for lay in cache.layers] == [lay.keys.shape for lay in plain.layers], name
        bias = correction.bias_of(shared.layers[0].self_attn, cache)
        V = int(name.split("_sum")[1].split("_")[0])
        tau = float(name.split("_tau")[1]) if "_tau" in name else 1.0
        assert (bias[..., :-V] == 0).all()
        counts = bias[..., -V:].float().exp() / tau  # tau * count
        assert torch.allclose(counts.sum(-1), torch.full_like(counts.sum(-1), 64 - (16 - V)), rtol=1e-2)  # all evicted
    # a prompt too short for V = 64: V is capped at the budget minus one (16 - 1), one real entry kept
    capped = shared.compress(get_press("keydiff_sum64", 0.75))
    assert capped.layers[0].keys.shape == plain.layers[0].keys.shape
    counts = correction.bias_of(shared.layers[0].self_attn, capped)[..., 1:].float().exp().sum(-1)  # 15 virtual
    assert torch.allclose(counts, torch.full_like(counts, 64 - 1), rtol=1e-2)  # they stand for all 63 evicted
    with pytest.raises(ValueError, match="at least 2"):
        Summary().virtual_count(1)
    with pytest.raises(ValueError, match="weight"):
        Summary(weight=0.0)
    with pytest.raises(ValueError, match="grouping"):
        Summary(grouping="pca")


@pytest.mark.parametrize("arch", ["llama"])
def test_summary_presses_in_pipeline_runner_and_batch(arch, tmp_path, tokenizer):
    """The shared-prefill runner (one at a time and batched, whose stacked caches carry each row's
    summary bias) gives the kvpress pipeline's answers."""
    model = tiny_model(arch)
    model.generation_config.eos_token_id = 2
    # the ExpectedAttention proposal first: no top-k replay has set the modules' rotary_emb before it
    names = ["hybrid_expected_attention_block8_a75", "keydiff_sum4", "topk_keydiff_block8_sum4", "hybrid_keydiff_block8_a75_sum4"]
    configs = configurations(names + ["keydiff"], [0.5], [0])
    a, b, _, _ = one_and_batched(model, tokenizer, configs, tmp_path, decode_batch=4)
    assert a.prediction.equals(b.prediction)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    row = examples(1).iloc[0]
    for cfg in configs[1:]:  # configs[0]: the full cache
        answer = pipe(row.context, question=row.question, answer_prefix=row.answer_prefix, press=cfg.build(),
                      max_new_tokens=5)["answer"]
        assert answer == a.loc[(row.example_id, cfg.label, 0.5, cfg.seed), "prediction"], cfg


@pytest.mark.parametrize("tau", [0.1, 0.5, 1.0])
def test_expected_stored_count_is_n_at_every_tau(tau):
    """E[sum_kept (1 + (1 - tau)(w_i - 1)) + tau sum_g N_g] = n for a random-size threshold draw:
    the stored bias of 100 seeds (each the 3 layers x 2 heads of a tiny model, n = 48, V = 2),
    exp-summed over the stored entries (padding adds 0), against n; tolerance 4.5 Monte Carlo
    standard errors of the mean over the 100 seeds."""
    model = tiny_model("llama")
    n = 48
    shared = Prefill(model, torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(4)))
    totals = []
    for seed in range(100):
        press = SummarySamplingPress(proposal=ScoreProposal(scorer=KeyDiffPress()), sampler=ThresholdSampler(),
                                     compression_ratio=0.5, budget="head", seed=seed, bias_dtype="float32",
                                     summary=Summary(n_virtual=2, grouping="segments", weight=tau))
        cache = shared.compress(press)
        per_head = [correction.bias_of(layer.self_attn, cache).double().exp().sum(-1).mean() for layer in shared.layers]
        totals.append(float(torch.stack(per_head).mean()))
    totals = torch.tensor(totals, dtype=torch.float64)
    se = float(totals.std()) / len(totals) ** 0.5
    assert abs(float(totals.mean()) - n) < 4.5 * se + 1e-6, (float(totals.mean()), se)
    if tau < 1:
        assert se > 0.01  # the kept weights vary: the check is not of a constant


def test_summary_sampling_press_refuses_a_temperature():
    """At T = 2 the stored count fell to 39.4 of n = 48 (z = -118 over 200 seeds of the test above):
    no power w^(1/T) keeps the expected count n, so a summary press has tau as its one tempering."""
    with pytest.raises(ValueError, match="temperature must be 1 with a summary"):
        SummarySamplingPress(proposal=ScoreProposal(scorer=KeyDiffPress()), temperature=2.0)
    with pytest.raises(ValueError, match="temperature must be 1 with a summary"):
        get_press("hybrid_keydiff_block8_a75_sum4", 0.5, temperature=float("inf"))


def test_summarised_keeps_every_field_and_refuses_a_span_press():
    base = SamplingPress(proposal=ScoreProposal(scorer=KeyDiffPress()), sampler=ThresholdSampler(min_keep=0.3),
                         compression_ratio=0.4, budget="layer", seed=7, correct=False, bias_dtype="float32")
    press = summarised(base, Summary(n_virtual=2))
    assert type(press) is SummarySamplingPress and press.summary == Summary(n_virtual=2)
    assert all(getattr(press, f.name) == getattr(base, f.name) for f in fields(base) if f.init)
    again = summarised(press, Summary(n_virtual=3, weight=0.5))
    assert again.summary.n_virtual == 3 and again.seed == 7 and again.budget == "layer"
    with pytest.raises(TypeError, match="SpanPress"):
        summarised(SpanPress(proposal=ScoreProposal(scorer=KeyDiffPress()), sampler=SpanSampler(), budget="head"),
                   Summary())
