"""Evicted-set summaries (kvpress_prob/summary.py) against a dense reference with explicit virtual
entries, in the pipeline, the shared-prefill runner's batch, generate and bf16."""

import math

import pytest
import torch
from conftest import tiny_model
from kvpress import KeyDiffPress, KVPressTextGenerationPipeline
from test_runner import examples, one_and_batched

from evaluation.engine import Prefill
from evaluation.runner import configurations
from kvpress_prob import correction, get_press
from kvpress_prob.attention import corrected_sdpa
from kvpress_prob.summary import Summary, SummaryPress, SummarySamplingPress


def slow_reference(query, keys, values, kept, log_w, evicted_groups, tau, scaling):
    """Attention of one query (H_q, d) over explicit entries, head by head, in a Python loop: a new
    token with key and value 0, each kept entry i with weight w_i' = 1 + (1 - tau)(w_i - 1), and for each group of evicted
    positions one virtual entry (mean key, mean value) with weight tau * |group|."""
    hq, hkv = query.shape[0], keys.shape[0]
    out = torch.zeros(hq, values.shape[-1], dtype=torch.float64)
    for h in range(hq):
        g = h // (hq // hkv)
        entries = [(1.0, torch.zeros_like(keys[g, 0]), torch.zeros_like(values[g, 0]))]  # the new token: key 0, value 0
        for i in kept[g]:
            entries.append((1 + (1 - tau) * (math.exp(log_w[g][i]) - 1), keys[g, i], values[g, i]))
        for group in evicted_groups[g]:
            if group:
                k = sum(keys[g, i].double() for i in group) / len(group)
                v = sum(values[g, i].double() for i in group) / len(group)
                entries.append((tau * len(group), k, v))
        scores = [w * math.exp(float(query[h].double() @ k.double()) * scaling) for w, k, _ in entries]
        total = sum(scores)
        out[h] = sum(s * v.double() for s, (_, _, v) in zip(scores, entries)) / total
    return out


def segments(evicted_positions, c):
    """Split a list of positions into c runs of equal count, the first runs shorter by rounding."""
    m = len(evicted_positions)
    return [[p for r, p in enumerate(evicted_positions) if r * c // m == j] for j in range(c)]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summary_attention_equals_explicit_virtual_entries(sampled, dtype):
    model = tiny_model("llama", dtype=dtype)
    n, c, tau = 48, 3, 0.5
    ids = torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(1))
    summary = Summary(n_virtual=c, grouping="segments", weight=tau)
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
    assert keys.shape[2] == int(n * 0.5) if not sampled else True  # equal memory: kvpress's count
    # which full positions each stored real entry is: match rows of the full keys
    kept, log_w, groups = [], [], []
    for g in range(hkv):
        if sampled:
            keep = press.last_draw.keep[layer_idx, 0, g]
            lw = press.last_draw.log_weight[layer_idx, 0, g]
        else:
            real = keys[0, g, : keys.shape[2] - c]
            keep = (full_keys[g][:, None, :] == real[None]).all(-1).any(-1)
            lw = torch.zeros(n)
        assert int(keep.sum()) == (n // 2 - c)  # c fewer real entries than the budget
        positions = keep.nonzero()[:, 0].tolist()
        kept.append(positions)
        log_w.append({i: float(lw[i]) for i in positions})
        groups.append(segments((~keep).nonzero()[:, 0].tolist(), c))
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    scaling = 16 ** -0.5
    # the fast path: corrected attention over the stored entries (real, virtual) and a new token (key, value 0)
    new_k, new_v = torch.zeros(1, hkv, 1, 16, dtype=dtype), torch.zeros(1, hkv, 1, 16, dtype=dtype)
    ours = corrected_sdpa(query, torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2), bias, scaling)
    reference = slow_reference(query[0, :, 0], full_keys, full_values, kept, log_w, groups, tau, scaling)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: keys, values and means rounded to 8 bits
    torch.testing.assert_close(ours[0, 0].double(), reference, atol=tol, rtol=tol)
    # without the summary the attention differs: the test can fail
    plain = slow_reference(query[0, :, 0], full_keys, full_values, kept, log_w, [[] for _ in range(hkv)], tau, scaling)
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
        c = int(name.split("_sum")[1].split("_")[0])
        tau = float(name.split("_tau")[1]) if "_tau" in name else 1.0
        assert (bias[..., :-c] == 0).all()
        counts = bias[..., -c:].float().exp() / tau  # tau * count
        assert torch.allclose(counts.sum(-1), torch.full_like(counts.sum(-1), 64 - (16 - c)), rtol=1e-2)  # all evicted
    # a prompt too short for c = 64: c is capped at the budget minus one (16 - 1), one real entry kept
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
