"""Fidelity benchmark (evaluation/bench/fidelity.py): statistics, KL, replayed vs real prefill, report."""

import copy
import json
import math

import numpy as np
import pytest
import torch
from conftest import random_ids, tiny_model

from evaluation.bench import fidelity as F

N_CONTEXT = 160
N_CONT = 12


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("p, df, expected", [
    (0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 5, 2.570582), (0.975, 29, 2.045230),
    (0.95, 10, 1.812461), (0.995, 3, 5.840909), (0.5, 7, 0.0), (0.025, 5, -2.570582),
])
def test_t_quantile_matches_tables(p, df, expected):
    assert F.t_quantile(p, df) == pytest.approx(expected, abs=2e-6)


def test_t_cdf_inverts_quantile_and_is_symmetric():
    for df in (1, 3, 12.5, 200):
        for p in (0.6, 0.9, 0.999):
            x = F.t_quantile(p, df)
            assert F.t_cdf(x, df) == pytest.approx(p, abs=1e-9)
            assert F.t_cdf(-x, df) == pytest.approx(1 - p, abs=1e-9)


def test_mean_ci_hand_computed():
    ci = F.mean_ci([1, 2, 3, 4, 5])
    sd = math.sqrt(2.5)
    half = 2.776445 * sd / math.sqrt(5)  # t_{0.975, 4}
    assert ci["mean"] == 3.0 and ci["n"] == 5
    assert ci["sd"] == pytest.approx(sd)
    assert ci["lo"] == pytest.approx(3 - half, abs=1e-5)
    assert ci["hi"] == pytest.approx(3 + half, abs=1e-5)
    assert F.mean_ci([1, 2, 3, 4, 5], level=0.9)["half"] < ci["half"]


def test_mean_ci_degenerate_cases():
    one = F.mean_ci([0.7])
    assert one["mean"] == 0.7 and one["n"] == 1 and math.isnan(one["lo"]) and math.isnan(one["hi"])
    const = F.mean_ci([2.0, 2.0, 2.0])
    assert const["lo"] == const["hi"] == 2.0
    assert F.mean_ci([1.0, float("nan"), 3.0])["n"] == 2  # NaN dropped
    assert F.mean_ci([])["n"] == 0


def test_bootstrap_ci_brackets_the_mean():
    x = [0.1, 0.4, 0.2, 0.9, 0.3, 0.5]
    lo, hi = F.bootstrap_ci(x, n_boot=4000)
    assert min(x) <= lo < np.mean(x) < hi <= max(x)
    assert F.bootstrap_ci(x, n_boot=4000) == (lo, hi)  # seeded
    assert all(math.isnan(v) for v in F.bootstrap_ci([1.0]))


def test_paired_difference():
    d = F.paired_difference([1.0, 2.0, 3.0], [2.0, 2.5, 2.0])
    assert d["mean"] == pytest.approx((-1 - 0.5 + 1) / 3)
    assert d["a_better"] == 2 and d["n"] == 3
    with pytest.raises(ValueError):
        F.paired_difference([1.0], [1.0, 2.0])


def test_bias_variance_split():
    out = F.bias_variance(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0]))
    assert out == pytest.approx({"bias2": 1.0, "variance": 1.0, "mse": 2.0})
    g = torch.Generator().manual_seed(0)
    outs, ref = torch.randn(5, 3, 4, generator=g), torch.randn(3, 4, generator=g)
    s = F.bias_variance(outs, ref)
    assert s["mse"] == pytest.approx(s["bias2"] + s["variance"], rel=1e-12)
    assert F.bias_variance(ref[None].expand(3, -1, -1), ref) == pytest.approx({"bias2": 0, "variance": 0, "mse": 0})


def test_kl_per_position():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g)
    assert torch.equal(F.kl_per_position(a, a), torch.zeros(4, dtype=torch.float64))
    assert F.kl_per_position(a, a + 3.0).abs().max() < 1e-12  # shift-invariant
    kl = F.kl_per_position(a, b)
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    assert torch.allclose(kl, (p * (p / q).log()).sum(-1))
    assert (kl > 0).all()


# --------------------------------------------------------------------------- configurations


def test_configs_labels_and_sweep_dedupe():
    c = F.Config("prob_min_h", 0.5, 1.0)
    assert c.temperature is None and c.label == "prob_min_h" and c == F.Config("prob_min_h", 0.5)
    assert F.Config("prob_min_h", 0.5, float("inf")).label == "prob_min_h@tau=inf"
    main, extra = F.build_configs(["snapkv", "prob_min_h"], [0.5], sweep=True, sweep_presses=["prob_min_h"],
                                  sweep_ratios=[0.5, 0.9], temperatures=[1.0, float("inf")])
    assert [x.label for x in main] == ["snapkv", "prob_min_h"]
    assert [(x.label, x.ratio) for x in extra] == [
        ("prob_min_h@tau=inf", 0.5), ("prob_min_h", 0.9), ("prob_min_h@tau=inf", 0.9)]
    assert F.seeds_for(F.Config("snapkv", 0.5), [4, 5, 6]) == [4]
    assert F.seeds_for(F.Config("topk_min_h", 0.5), [4, 5, 6]) == [4]  # deterministic (alpha = 1)
    assert F.seeds_for(F.Config("prob_snapkv_ht", 0.5), [4, 5, 6]) == [4, 5, 6]
    with pytest.raises(ValueError):
        F.make_press(F.Config("snapkv", 0.5, 2.0), 0)
    assert F.make_press(F.Config("prob_tova", 0.3, 4.0), 7).temperature == 4.0
    with pytest.raises(SystemExit):
        F.build_configs(["no_such_press"], [0.5])


# --------------------------------------------------------------------------- model side (tiny random Llama)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    ctx, cont = random_ids(N_CONTEXT, seed=1), random_ids(N_CONT, seed=2)
    full, captured = F.full_prefill(model, ctx)
    ref_logits, ref_att = F.continuation(model, copy.deepcopy(full), cont, N_CONTEXT, capture_attention=True)
    return model, ctx, cont, full, captured, {"logits": ref_logits, "attention": ref_att}


def test_full_cache_against_itself_is_exact(setup):
    model, ctx, cont, full, captured, ref = setup
    assert ref["logits"].shape == (N_CONT, 49152) and ref["attention"].shape == (3, N_CONT, 64)
    logits, att = F.continuation(model, copy.deepcopy(full), cont, N_CONTEXT, capture_attention=True)
    assert F.kl_per_position(ref["logits"], logits).max().item() == 0.0
    assert F.relative_error(att, ref["attention"]) == [0.0, 0.0, 0.0]
    assert full.layers[0].keys.shape[2] == N_CONTEXT  # the reference continuation ran on a copy


@pytest.mark.parametrize("name", ["prob_min_h", "prob_snapkv", "snapkv"])
def test_ratio_zero_gives_zero_kl(setup, name):
    model, ctx, cont, full, captured, ref = setup
    res = F.evaluate_config(model, F.Config(name, 0.0), [0], ctx, cont, 5, ref, full, captured, {})
    assert res["kl"] == [0.0] and res["realised_ratio"] == [0.0]
    assert res["layer_err"] == [[0.0, 0.0, 0.0]] and res["bias2"] == [0.0, 0.0, 0.0]


def test_compressed_cache_has_positive_kl(setup):
    model, ctx, cont, full, captured, ref = setup
    for name in ("snapkv", "prob_min_h"):
        res = F.evaluate_config(model, F.Config(name, 0.6), [0, 1], ctx, cont, 5, ref, full, captured, {})
        assert all(k > 0 for k in res["kl"]), name
        assert all(abs(r - 0.6) < 0.05 for r in res["realised_ratio"]), res["realised_ratio"]
        assert len(res["layer_err"][0]) == 3 and all(e > 0 for e in res["layer_err"][0][1:])
        mse = np.mean(np.asarray(res["layer_err"]) ** 2, axis=0)
        assert np.allclose(np.asarray(res["bias2"]) + np.asarray(res["variance"]), mse, rtol=1e-6)
        if name == "prob_min_h":
            assert res["kl"][0] != res["kl"][1] and min(res["variance"]) > 0  # seeds differ
            # each head draws m times and keeps sum_i 1 - exp(-m pi_i) <= m entries, 0.4 n on average
            assert res["m"] >= 0.4 * N_CONTEXT
        else:
            assert res["kl"][0] == res["kl"][1] and max(res["variance"]) < 1e-20  # deterministic


@pytest.mark.parametrize("name, seed", [("snapkv", 0), ("knorm", 0), ("prob_min_h", 3), ("prob_snapkv_ht", 1),
                                        ("prob_tova_nocorr", 2), ("topk_min_h", 0)])
def test_replay_equals_real_compressed_prefill(setup, name, seed):
    """Replaying the press hooks on the full prefill (with a shared proposal cache) leaves the same
    cache and gives the same continuation logits as running the compressed prefill."""
    model, ctx, cont, full, captured, ref = setup
    proposals: dict = {}
    warm = F.make_press(F.Config(name, 0.5), seed + 100)  # fills the proposal cache with another seed
    F.replay_press(model, warm, full, captured, proposals)
    replayed_press = F.make_press(F.Config(name, 0.5), seed)
    replayed = F.replay_press(model, replayed_press, full, captured, proposals)
    logits_replayed, _ = F.continuation(model, replayed, cont, N_CONTEXT)
    real_press = F.make_press(F.Config(name, 0.5), seed)
    real = F.compressed_prefill(model, ctx, real_press)
    logits_real, _ = F.continuation(model, real, cont, N_CONTEXT)
    assert torch.allclose(logits_replayed, logits_real, atol=1e-5, rtol=0)
    assert F.realised_ratio(replayed_press, replayed, N_CONTEXT) == F.realised_ratio(real_press, real, N_CONTEXT)
    assert full.layers[0].keys.shape[2] == N_CONTEXT  # the full cache is never modified


# --------------------------------------------------------------------------- report from hand-made records


def _record(example, press, kl, ratio=0.5, tau="1", method=None, seeds=(0,), budget="global"):
    return {"budget": budget,
        "model": "m", "dataset": "ruler", "data_dir": "d", "task": "t", "example_id": example, "press": press,
        "compression_ratio": ratio, "seed": None, "method": method or press, "temperature": tau,
        "seeds": list(seeds), "kl": kl, "kl_answer": kl, "top1": [1.0] * len(kl), "nll_answer": [1.0] * len(kl),
        "realised_ratio": [ratio] * len(kl), "layer_err": [[0.1, 0.2]] * len(kl), "bias2": [0.01, 0.04],
        "variance": [0.0, 0.0], "seconds": [1.0] * len(kl), "n_context": 100, "n_question": 10, "n_answer": 3,
        "ref_nll_answer": 0.5,
    }


def test_report_tables_from_records(tmp_path):
    from evaluation.store import ResultStore

    records = []
    for i, (top, samp) in enumerate([(0.5, [0.1, 0.3]), (0.4, [0.2, 0.2]), (0.6, [0.3, 0.5])]):
        records.append(_record(f"e{i}", "snapkv", [top]))
        records.append(_record(f"e{i}", "prob_snapkv", samp, seeds=(0, 1)))
        records.append(_record(f"e{i}", "prob_snapkv@tau=inf", samp, tau="inf", method="prob_snapkv", seeds=(0, 1)))
    ResultStore(tmp_path / "records.jsonl").append(records)
    paths = F.write_report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    kl = {(r["press"], r["ratio"]): r for r in summary["kl"]}
    assert kl[("snapkv", 0.5)]["kl"] == pytest.approx(0.5)
    assert kl[("prob_snapkv", 0.5)]["kl"] == pytest.approx(0.8 / 3)  # seed means 0.2, 0.2, 0.4
    ci = F.mean_ci([0.2, 0.2, 0.4])
    assert kl[("prob_snapkv", 0.5)]["kl_lo"] == pytest.approx(ci["lo"])
    paired = [r for r in summary["paired"] if r["A"] == "prob_snapkv" and r["B"] == "snapkv"]
    assert len(paired) == 1 and paired[0]["diff"] == pytest.approx(0.8 / 3 - 0.5) and paired[0]["A_better"] == 3
    text = (tmp_path / "report.md").read_text()
    assert "Paired comparisons" in text and "Temperature" in text and "prob_snapkv" in text
    row = next(line for line in text.splitlines() if line.startswith("| prob_snapkv |"))
    assert "–" not in row and "0.5000" in row and "1.000" in row  # every cell of the KL table filled
    assert paths["kl_bars"].exists() and paths["layer_error"].exists()


def test_loglog_slope_and_backfilled_m(tmp_path):
    from evaluation.store import ResultStore

    x = np.array([10.0, 20.0, 40.0, 80.0])
    assert F.loglog_slope(x, 3.0 / x**2) == pytest.approx(-2.0)
    assert F.loglog_slope(x, np.array([1.0, -1.0, 0.5, np.nan])) != F.loglog_slope(x, np.array([1.0, -1.0, 0.5, np.nan])) \
        # fewer than 3 usable points: NaN
    records = [dict(_record("e0", "prob_snapkv", [0.2]), m=None), dict(_record("e1", "prob_snapkv", [0.3]), m=70.0)]
    ResultStore(tmp_path / "records.jsonl").append(records)
    ResultStore(tmp_path / "m.jsonl").append([{"data_dir": "d", "example_id": "e0", "press": "prob_snapkv",
                                               "compression_ratio": 0.5, "m": 50.0}])
    df = F.load_records(tmp_path)
    assert df.set_index("example_id")["m"].to_dict() == {"e0": 50.0, "e1": 70.0}
    assert F.layer_table(df)["m_mean"].tolist() == [60.0]


def test_scope_configs_and_table(tmp_path):
    from evaluation.store import ResultStore

    main, _ = F.build_configs(["snapkv", "prob_snapkv"], [0.5], scopes=["global", "head"])
    assert [x.label for x in main] == ["snapkv", "prob_snapkv", "prob_snapkv@budget=head"]
    assert F.make_press(main[2], 3).budget == "head" and F.make_press(main[1], 3).budget == "global"
    with pytest.raises(ValueError):
        F.make_press(F.Config("snapkv", 0.5, None, "head"), 0)
    records = []
    for i, (top, glob, head) in enumerate([(0.5, 0.3, 0.2), (0.4, 0.2, 0.25), (0.6, 0.5, 0.3)]):
        records.append(_record(f"e{i}", "snapkv", [top]))
        records.append(_record(f"e{i}", "prob_snapkv", [glob]))
        records.append(_record(f"e{i}", "prob_snapkv@budget=head", [head], method="prob_snapkv", budget="head"))
    ResultStore(tmp_path / "records.jsonl").append(records)
    F.write_report(tmp_path)
    scopes = {r["scope"]: r for r in json.loads((tmp_path / "summary.json").read_text())["scopes"]}
    assert set(scopes) == {"global", "head"}
    assert scopes["head"]["vs_global"] == pytest.approx((-0.1 + 0.05 - 0.2) / 3)
    assert scopes["head"]["vs_top-k"] == pytest.approx((0.2 + 0.25 + 0.3 - 1.5) / 3)
    assert scopes["head"]["vs_top-k_better"] == "3/3" and scopes["global"]["vs_top-k_better"] == "3/3"
    assert "Budget scope" in (tmp_path / "report.md").read_text()


def test_debiased_bias2_is_unbiased_for_zero_bias():
    """Seeds scattered around the reference (no bias): the plug-in bias^2 is about Var/S, the
    debiased one about 0."""
    g = torch.Generator().manual_seed(0)
    ref = torch.zeros(50)
    plug, debiased = [], []
    for _ in range(400):  # seeds ~ N(ref, I): ||ref||^2 = 50 = total variance, so relative Var = 1
        s_ref = F.bias_variance(torch.randn(3, 50, generator=g) + 1.0, ref + 1.0)
        plug.append(s_ref["bias2"])
        debiased.append(F.debiased_bias2(s_ref["bias2"], s_ref["variance"], 3))
    assert np.mean(plug) == pytest.approx(1 / 3, rel=0.1)  # Var / S, Var = 1 relative to ||ref||^2 = 50 / 50
    assert abs(np.mean(debiased)) < 0.03
    assert math.isnan(F.debiased_bias2(0.1, 0.0, 1))
