"""Fast checks of the benchmarks in evaluation/bench (tiny random models, tiny synthetic instances)."""

import itertools
import math

import numpy as np
import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import DynamicCache

from evaluation.bench.__main__ import build_parser
from evaluation.bench.allocation import measure as budget
from evaluation.bench.oracle import measure as oracle
from evaluation.bench.speed import measure as speed
from evaluation.engine import Prefill

# --------------------------------------------------------------------------- oracle


def _subset_error(instance, subset, row=0):
    logits, values = oracle.scores(instance), instance["values"]
    return oracle.errors(logits, values, oracle.mask_of(subset, values.shape[0]))[0, row]


def test_outputs_match_softmax_attention():
    inst = oracle.make_instance(7, 4, 3, 2.0, 0.5, seed=1)
    logits = oracle.scores(inst)
    ref = torch.softmax(torch.tensor(logits), dim=-1) @ torch.tensor(inst["values"])
    np.testing.assert_allclose(oracle.full_output(logits, inst["values"]), ref.numpy(), rtol=1e-10, atol=1e-12)
    # weights on a subset = softmax over that subset (renormalised)
    w = np.array([[1, 0, 1, 1, 0, 0, 1.0]])
    keep = w[0].astype(bool)
    ref_s = torch.softmax(torch.tensor(logits[:, keep]), dim=-1) @ torch.tensor(inst["values"][keep])
    np.testing.assert_allclose(oracle.outputs(logits, inst["values"], w)[0], ref_s.numpy(), rtol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_brute_force_is_optimal_and_beats_topk(seed):
    n, k = 8, 4
    inst = oracle.make_instance(n, 4, 8, 2.0, 0.5, seed=seed)
    logits, values = oracle.scores(inst), inst["values"]
    best = oracle.brute_force(logits, values, k, chunk=7)  # small chunks: the search crosses blocks
    assert len(best["now"]) == k and len(best["later"]) == k
    p_t = np.exp(logits[0]) / np.exp(logits[0]).sum()
    topk = np.argsort(-p_t)[:k]
    assert _subset_error(inst, best["now"]) <= _subset_error(inst, topk) + 1e-12
    # exhaustive check, independent of the chunked search
    all_now = [_subset_error(inst, s) for s in itertools.combinations(range(n), k)]
    assert math.isclose(_subset_error(inst, best["now"]), min(all_now), rel_tol=1e-12)
    all_later = [
        np.mean([_subset_error(inst, s, row) for row in range(1, 9)]) for s in itertools.combinations(range(n), k)
    ]
    got = np.mean([_subset_error(inst, best["later"], row) for row in range(1, 9)])
    assert math.isclose(got, min(all_later), rel_tol=1e-12)


def test_sampling_meets_budget_and_weights_are_unbiased():
    p_t = np.random.default_rng(0).dirichlet(np.ones(10))
    kept, w = oracle.sample_weights(p_t, 5, draws=4000, seed=0)
    assert abs(kept.sum(1).mean() - 5) < 0.1  # expected kept count k
    assert np.all((w > 0) == (kept > 0))
    np.testing.assert_allclose(w.mean(0), 1.0, atol=0.15)  # E[c / (m pi)] = 1


def test_jaccard():
    assert oracle.jaccard((0, 1, 2), (1, 2, 3)) == 0.5
    assert oracle.jaccard((0, 1), (0, 1)) == 1.0


# --------------------------------------------------------------------------- speed: byte accounting


def test_byte_accounting_by_hand():
    model = tiny_model("llama")
    n, layers, kv_heads, head_dim, fp32 = 80, 3, 2, 16, 4
    ids = random_ids(n, seed=1)
    full_cache = speed.prefill(model, ids, "full", 0.5).cache
    full = layers * 2 * (1 * kv_heads * n * head_dim) * fp32
    assert speed.cache_bytes(full_cache) == full

    topk_cache = speed.prefill(model, ids, "snapkv", 0.5).cache
    assert speed.cache_bytes(topk_cache) == layers * 2 * kv_heads * (n // 2) * head_dim * fp32

    cache, press, _, _ = speed.prefill(model, ids, "prob_snapkv", 0.5, seed=3)
    keep = press.last_draw.keep  # (L, b, H, n)
    stored = [max(1, int(keep[l, 0].sum(-1).max())) for l in range(layers)]
    kept = int(keep.sum())
    assert speed.cache_bytes(cache) == sum(2 * kv_heads * s * head_dim * fp32 for s in stored)
    assert speed.bias_bytes(model) == sum(kv_heads * s * fp32 for s in stored)
    row = speed.memory_row(model, cache, press, "prob_snapkv", 0.5, n, full)
    assert row["bytes_stored"] == press.stats["bytes_stored"] == speed.cache_bytes(cache)
    assert row["bytes_bias"] == press.stats["bytes_bias"]
    assert row["bytes_kept"] == kept * 2 * head_dim * fp32
    assert row["bytes_full"] == press.stats["bytes_full"] == full
    assert math.isclose(row["stored_over_budget"], speed.cache_bytes(cache) / (0.5 * full))
    speed.clear_biases(model)
    assert speed.bias_bytes(model) == 0


def test_adaptive_top_k_frees_what_adakv_only_masks():
    """The same head-adaptive budget two ways: kvpress's AdaKV keeps the full cache and masks r of each
    layer's entries; <scorer>_adaptive stores only the kept ones, each layer padded to its largest head."""
    model = tiny_model("llama")
    n, layers, kv_heads, head_dim, fp32 = 96, 3, 2, 16, 4
    ids = random_ids(n, seed=2)
    full = layers * 2 * kv_heads * n * head_dim * fp32
    adakv_cache = speed.prefill(model, ids, "adakv_snapkv", 0.5).cache
    assert speed.cache_bytes(adakv_cache) == full
    masks = speed.masks_of(model)
    assert [len(mask[0]) for mask in masks] == [kv_heads * n // 2] * layers  # masked, not freed
    speed.set_masks(model, [None] * layers)
    cache, press, _, _ = speed.prefill(model, ids, "snapkv_adaptive", 0.5)
    kept = press.last_draw.keep[:, 0].sum(-1)  # (L, H); on this tiny model the heads' allocations are within
    # one entry of each other, so the whole counts (largest remainder) spend each layer's budget exactly
    assert all(int(kept[l].sum()) == kv_heads * n // 2 for l in range(layers))
    assert speed.cache_bytes(cache) == sum(2 * kv_heads * int(kept[l].max()) * head_dim * fp32 for l in range(layers))
    assert speed.cache_bytes(cache) < full
    speed.clear_biases(model)


def dense_error(keys, values, queries, subset) -> torch.Tensor:
    """||softmax over ``subset`` - softmax over all|| of the attention output, per query, float64."""
    logits = queries @ keys.T / math.sqrt(keys.shape[1])  # (Q, n)
    full = torch.softmax(logits, -1) @ values
    kept = torch.softmax(logits[:, list(subset)], -1) @ values[list(subset)]
    return (kept - full).norm(dim=-1)  # (Q,)


def check_oracle_rows(rows: list[dict], settings: dict) -> None:
    """The oracle bench's records against a recomputation, instance by instance: the optimum at q_t
    is the smallest dense error over every size-k subset (itertools, torch float64), top-k's error
    is the dense error of the k largest logits at q_t, and the sampled mean kept count is within 5
    standard deviations of k (a Poisson design's count has variance <= n / 4, ``draws`` draws)."""
    by = {(r["n"], r["instance"], r["method"]): r for r in rows}
    for n, i in sorted({(r["n"], r["instance"]) for r in rows}):
        inst = oracle.make_instance(n, settings["d"], settings["later"], settings["query_scale"], settings["noise"],
                                    settings["seed"] * 1_000_003 + 1000 * n + i)
        keys, values, queries = (torch.tensor(inst[x]) for x in ("keys", "values", "queries"))
        k = n // 2
        best = min(dense_error(keys, values, queries[:1], s)[0].item() for s in itertools.combinations(range(n), k))
        assert by[(n, i, "opt_now")]["err_now"] == pytest.approx(best, rel=1e-9)
        topk = torch.argsort(-(keys @ queries[0]), stable=True)[:k].tolist()
        assert by[(n, i, "topk")]["err_now"] == pytest.approx(dense_error(keys, values, queries[:1], topk)[0].item(), rel=1e-9)
        sampled = by[(n, i, "sample")]
        assert abs(sampled["kept_mean"] - k) < 5 * math.sqrt(n / 4 / settings["draws"])


def test_oracle_records_match_a_dense_recomputation():
    """The CPU analogue of tests/test_cuda.py::test_oracle_quick_on_cuda."""
    settings = {"d": 4, "later": 8, "query_scale": 2.0, "noise": 0.5, "seed": 0, "draws": 200}
    rows = oracle.run([8, 10], settings["d"], 3, settings["later"], settings["draws"], settings["query_scale"],
                      settings["noise"], settings["seed"], log=lambda *a: None)
    check_oracle_rows(rows.to_dict("records"), settings)


# --------------------------------------------------------------------------- budget


def test_budget_figures_by_hand():
    fig = budget.figures_from_kept(torch.tensor([[2, 4], [3, 3]]), n=8)
    np.testing.assert_allclose(fig["padding_layer"], [8 / 6, 1.0])
    assert math.isclose(fig["realised_ratio"], 1 - 12 / 32)
    assert math.isclose(fig["stored_fraction"], 2 * 7 / 32)
    assert math.isclose(fig["padding_overall"], 14 / 12)
    np.testing.assert_allclose(fig["kept_fraction"], [[0.25, 0.5], [0.375, 0.375]])


def knorm_proposal(keys: torch.Tensor, floor: float = 0.01) -> torch.Tensor:
    """prob_knorm's pi by its formula, in float64: s = -||k||, w = s - min s, pi = (1 - floor) w / sum w + floor / n."""
    s = -keys.double().norm(dim=-1)  # (b, H, n)
    w = s - s.amin(-1, keepdim=True)
    return (1 - floor) * w / w.sum(-1, keepdim=True) + floor / keys.shape[2]


def test_captured_proposal_is_knorms_and_the_press_kept_what_its_draw_says():
    """The bench's captured pi against K-norm's formula on a plain prefill's keys; the press's cache
    against those keys at the drawn positions; its realised ratio against the draw's count and the
    target (a Poisson design's kept count has variance <= N / 4 over N entries)."""
    model, ids = tiny_model("llama"), random_ids(70, seed=2)
    press, pi = budget.capture_prefill(model, ids, "prob_knorm", 0.5, seed=5)
    assert pi.shape == (3, 1, 2, 70)
    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=full)
    for layer, p in zip(full.layers, pi):
        torch.testing.assert_close(p, knorm_proposal(layer.keys), rtol=1e-5, atol=1e-8)
    keep = press.last_draw.keep  # (L, 1, H, n)
    cache = Prefill(model, ids, [press]).compress(press)
    for layer, kept, full_layer in zip(cache.layers, keep, full.layers):
        for h in range(2):
            count = int(kept[0, h].sum())
            torch.testing.assert_close(layer.keys[0, h, :count], full_layer.keys[0, h, kept[0, h]], rtol=0, atol=0)
    N = keep.numel()
    assert press.stats["realised_ratio"] == pytest.approx(1 - keep.sum().item() / N, abs=1e-12)
    assert abs(press.stats["realised_ratio"] - 0.5) < 5 * math.sqrt(N / 4) / N
    fig = budget.draw_figures(pi, 0.5, "global", 5, press)  # the bench's redraw: the press's draw
    assert torch.equal(fig["keep"], keep)


def check_budget_draws(data: dict, layers: int, heads: int) -> None:
    """Every draw of the allocation bench (Poisson designs): the realised ratio within 5 standard
    deviations of its target (a kept count of N Bernoulli entries has variance <= N / 4), its
    stored fraction at least its kept fraction (padding >= 1), and each captured press's stats the
    same bound around the bench's ratio."""
    for row in data["draws"]:
        N = layers * heads * row["n"]
        assert abs(row["realised_ratio"] - row["target"]) < 5 * math.sqrt(N / 4) / N, row
        assert row["stored_fraction"] >= row["kept_total_fraction"] - 1e-12
        assert row["padding_overall"] == pytest.approx(row["stored_fraction"] / row["kept_total_fraction"])
    for row in data["press_stats"]:
        N = layers * heads * row["n"]
        assert abs(row["realised_ratio"] - data["settings"]["ratio"]) < 5 * math.sqrt(N / 4) / N, row
        assert row["redraw_matches_press"]


def test_budget_bench_draws_meet_their_targets(tokenizer):
    """The CPU analogue of tests/test_cuda.py::test_budget_quick_on_cuda, on a tiny model."""
    model = tiny_model("llama")
    rows, _, press_rows = budget.run(model, tokenizer, ["prob_knorm", "prob_min_h"], [0.25, 0.75], 1, 256, 2,
                                     "prob_min_h", 0.5, 0, log=lambda *a: None)
    data = {"draws": rows.to_dict("records"), "press_stats": press_rows.to_dict("records"), "settings": {"ratio": 0.5}}
    assert len(data["draws"]) == 2 * (1 + 3) * 2  # 2 ratios x (1 + 3 scopes) x 2 seeds
    check_budget_draws(data, layers=3, heads=2)


# --------------------------------------------------------------------------- CLI


def test_cli_has_every_option():
    parser = build_parser()
    args = parser.parse_args(["speed", "--quick", "--model", "x", "--out", "o", "--lengths", "64", "--repeats", "1"])
    assert args.quick and args.model == "x" and args.lengths == [64] and args.repeats == 1
    args = parser.parse_args(["budget", "--examples", "2", "--ratios", "0.5"])
    assert args.examples == 2 and args.out == "results/bench"
    args = parser.parse_args(["oracle", "--ns", "8", "--draws", "10"])
    assert args.ns == [8] and args.instances == 20
    args = parser.parse_args(["fidelity", "--quick", "--scopes", "head", "--no-layerwise"])
    assert args.quick and args.scopes == ["head"] and not args.layerwise and args.out == "results/bench"
    args = parser.parse_args(["shared-prefill", "--presses", "snapkv", "--ratio", "0.25"])
    assert args.presses == ["snapkv"] and args.ratio == 0.25
    with pytest.raises(SystemExit):
        parser.parse_args(["nope"])


def test_fidelity_quick_writes_under_its_own_folder():
    from evaluation.bench.fidelity.cli import resolve

    args = build_parser().parse_args(["fidelity", "--quick", "--out", "root"])
    args = resolve(args)
    assert str(args.out) == "root/fidelity/quick" and args.n_examples == 3 and args.context_length == 1024
    args = resolve(build_parser().parse_args(["fidelity"]))
    assert str(args.out) == "results/bench/fidelity" and args.n_examples == 6 and args.context_length == 2048


# --------------------------------------------------------------------------- device, timing and memory helpers


def test_context_ids_are_made_on_the_requested_device(tokenizer):
    from evaluation.bench import common

    ids = common.context_ids(tokenizer, 50, device="meta")
    assert ids.device.type == "meta" and ids.shape == (1, 50)
    assert common.context_ids(tokenizer, 50).device.type == "cpu"


def test_peak_memory_sees_a_known_allocation():
    from evaluation.bench import common

    with common.PeakMemory("cpu") as idle:
        pass
    with common.PeakMemory("cpu") as busy:
        x = torch.ones(16 * 2**20)  # 64 MiB, written so that its pages are resident
        del x
    assert 60 * 2**20 <= busy.extra_bytes <= 90 * 2**20, (busy.method, busy.extra_bytes)
    assert idle.extra_bytes < 16 * 2**20
    with common.Stopwatch("cpu") as watch:
        torch.ones(10).sum()
    assert watch.wall >= 0 and watch.cuda_peak_bytes is None


def test_bias_snapshot_lets_caches_decode_in_lockstep():
    """The lockstep decode swaps each variant's SNIS bias onto the modules: the corrected cache must
    then decode exactly as it does alone."""
    model = tiny_model("llama")
    ids, n = random_ids(70, seed=4), 70
    step = lambda cache, i: model(input_ids=torch.tensor([[7 + i]]), past_key_values=cache,
                                  position_ids=torch.tensor([[n + i]])).logits
    with torch.no_grad():
        alone = speed.prefill(model, ids, "prob_snapkv", 0.5, seed=2).cache
        reference = [step(alone, i) for i in range(2)]
        corrected = speed.prefill(model, ids, "prob_snapkv", 0.5, seed=2).cache
        biases = speed.biases_of(model)
        assert any(b is not None for b in biases)
        other = speed.prefill(model, ids, "snapkv", 0.5).cache  # a new prefill clears the module state
        for i in range(2):
            speed.set_biases(model, [None] * len(biases))
            step(other, i)
            speed.set_biases(model, biases)
            torch.testing.assert_close(step(corrected, i), reference[i])
        timing = speed.decode_interleaved(model, {"a": (corrected, biases), "b": (other, [None] * 3)}, n + 2,
                                          torch.tensor([1, 2, 3]), warmup=1)
    assert set(timing) == {"a", "b"} and timing["a"]["steps"] == 2
    assert speed.bias_bytes(model) == 0  # the modules are left clean


@pytest.mark.slow  # the whole speed bench: `make test-all`
def test_speed_run_end_to_end_on_a_tiny_model(tmp_path, tokenizer):
    """The whole speed bench on a tiny model: every table is filled, the byte figures agree with the
    press's stats, and the prefill peak memory is recorded for each press on both paths."""
    from evaluation.bench.speed import report

    model = tiny_model("llama")
    raw = speed.run(model, tokenizer, [96], 1, 0.5, [0.25, 0.5], 3, 1,
                    ["full", "snapkv", "prob_snapkv", "prob_min_h", "adakv_snapkv", "snapkv_adaptive"], log=lambda *a: None)
    peak = raw["peak"]
    assert set(zip(peak.press, peak.path)) == {(p, path) for p in ("full", "snapkv", "prob_snapkv", "prob_min_h")
                                               for path in ("press", "engine")}
    assert (peak.peak_bytes >= peak.start_bytes).all() and peak.method.str.startswith("RSS").all()
    # presses beyond the defaults are decoded as their own variant and measured at every memory ratio
    assert set(raw["decode"].variant) == {*speed.DECODE_VARIANTS, "adakv_snapkv", "snapkv_adaptive"}
    assert (raw["decode"].steps == 3).all()
    mem = raw["memory"].set_index(["press", "ratio"])
    for r in (0.25, 0.5):
        assert mem.loc[("adakv_snapkv", r), "bytes_stored"] == mem.loc[("full", 0.5), "bytes_full"]  # masks, frees nothing
        assert mem.loc[("snapkv_adaptive", r), "bytes_stored"] == mem.loc[("snapkv_adaptive", r), "stats_bytes_stored"]
        assert mem.loc[("snapkv_adaptive", r), "bytes_stored"] < mem.loc[("adakv_snapkv", r), "bytes_stored"]
    assert mem.loc[("snapkv", 0.5), "stored_over_budget"] == 1.0
    assert mem.loc[("prob_snapkv", 0.25), "bytes_stored"] == mem.loc[("prob_snapkv", 0.25), "stats_bytes_stored"]
    assert raw["draws"].same_kept_as_corrected.dropna().all()  # nocorr keeps the corrected press's set
    summary = report.write_outputs(raw, {"elapsed_s": 1.0, "torch_threads": 1}, dict(
        model=None, ratio=0.5, lengths=[96], repeats=1, decode_steps=3, warmup_steps=1, threads=None, quick=True,
        memory_ratios=[0.25, 0.5]), tmp_path, "complete")
    text = (tmp_path / "speed.md").read_text()
    assert "Peak memory of the prefill" in text and "prob_min_h (engine)" in text
    assert set(summary["checks"].n) == {96, "all"}
