"""Fidelity benchmark (evaluation/bench/fidelity): figures, configurations, the engine replay against
a real compressed prefill, and the report from hand-made records."""

import json
import math

import numpy as np
import pytest
import torch
from conftest import random_ids, tiny_model

from evaluation.bench.fidelity import measure as M
from evaluation.bench.fidelity import report as R
from evaluation.bench.fidelity import tables as T
from evaluation.engine import Prefill, press_prefill, teacher_forced
from evaluation.engine.runner import Config
from evaluation.report import stats

N_CONTEXT = 160
N_CONT = 12

# --------------------------------------------------------------------------- figures


def test_bias_variance_split():
    out = M.bias_variance(torch.tensor([[1.0], [3.0]]), torch.tensor([1.0]))
    assert out == pytest.approx({"bias2": 1.0, "variance": 1.0, "mse": 2.0})
    g = torch.Generator().manual_seed(0)
    outs, ref = torch.randn(5, 3, 4, generator=g), torch.randn(3, 4, generator=g)
    s = M.bias_variance(outs, ref)
    assert s["mse"] == pytest.approx(s["bias2"] + s["variance"], rel=1e-12)
    assert M.bias_variance(ref[None].expand(3, -1, -1), ref) == pytest.approx({"bias2": 0, "variance": 0, "mse": 0})


def test_kl_per_position():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g)
    assert torch.equal(M.kl_per_position(a, a), torch.zeros(4, dtype=torch.float64))
    assert M.kl_per_position(a, a + 3.0).abs().max() < 1e-12  # shift-invariant
    kl = M.kl_per_position(a, b)
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    assert torch.allclose(kl, (p * (p / q).log()).sum(-1))
    assert (kl > 0).all()


# --------------------------------------------------------------------------- configurations


def test_settings_are_runner_configs_with_canonical_labels():
    c = M.setting("prob_min_h", 0.5, 1.0, "global")
    assert c == Config("prob_min_h", 0.5, 0) and c.label == "prob_min_h"  # defaults give no override
    assert M.setting("prob_min_h", 0.5, float("inf")).label == "prob_min_h[temperature=inf]"
    assert M.setting("prob_snapkv", 0.5, 2, "head").overrides == (("temperature", 2.0), ("budget", "head"))
    # a record written with the old labels names the same setting
    old = {"method": "prob_snapkv", "compression_ratio": 0.5, "temperature": "2", "budget": "head"}
    assert M.record_setting(old) == M.setting("prob_snapkv", 0.5, 2.0, "head")
    assert T.legacy_setting("prob_snapkv@tau=2@budget=head", 0.5) == M.record_setting(old)
    main, extra = M.build_configs(["snapkv", "prob_min_h"], [0.5], sweep=True, sweep_presses=["prob_min_h"],
                                  sweep_ratios=[0.5, 0.9], temperatures=[1.0, float("inf")])
    assert [x.label for x in main] == ["snapkv", "prob_min_h"]
    assert [(x.label, x.compression_ratio) for x in extra] == [
        ("prob_min_h[temperature=inf]", 0.5), ("prob_min_h", 0.9), ("prob_min_h[temperature=inf]", 0.9)]
    assert M.seeds_for(M.setting("snapkv", 0.5), [4, 5, 6]) == [4]
    assert M.seeds_for(M.setting("topk_min_h", 0.5), [4, 5, 6]) == [4]  # deterministic sampler
    assert M.seeds_for(M.setting("prob_snapkv_ht", 0.5), [4, 5, 6]) == [4, 5, 6]
    with pytest.raises(ValueError, match="no field 'temperature'"):
        M.setting("snapkv", 0.5, 2.0).build()
    press = M.setting("prob_tova", 0.3, 4.0).build()
    assert press.temperature == 4.0 and press.compression_ratio == 0.3
    with pytest.raises(SystemExit):
        M.build_configs(["no_such_press"], [0.5])
    main, _ = M.build_configs(["snapkv", "prob_snapkv"], [0.5], scopes=["global", "head"])
    assert [x.label for x in main] == ["snapkv", "prob_snapkv", "prob_snapkv[budget=head]"]
    assert main[2].build().budget == "head" and main[1].build().budget == "global"


# --------------------------------------------------------------------------- model side (tiny random Llama)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    ctx, cont = random_ids(N_CONTEXT, seed=1), random_ids(N_CONT, seed=2)
    prefill = Prefill(model, ctx)
    return model, ctx, cont, prefill, M.reference_of(model, prefill, cont, 5)


def test_full_cache_against_itself_is_exact(setup):
    model, ctx, cont, prefill, ref = setup
    assert ref["logits"].shape == (N_CONT, 49152) and ref["attention"].shape == (3, N_CONT, 64)
    logits, att = teacher_forced(model, prefill.compress(None), cont, N_CONTEXT, capture_attention=True)
    assert M.kl_per_position(ref["logits"], logits).max().item() == 0.0
    assert M.relative_error(att, ref["attention"]) == [0.0, 0.0, 0.0]
    assert prefill.full_cache.layers[0].keys.shape[2] == N_CONTEXT  # the reference ran on a copy


@pytest.mark.parametrize("name", ["prob_min_h", "prob_snapkv", "snapkv"])
def test_ratio_zero_gives_zero_kl(setup, name):
    model, ctx, cont, prefill, ref = setup
    res = M.evaluate_config(model, prefill, M.setting(name, 0.0), [0], cont, 5, ref)
    assert res["kl"] == [0.0] and res["realised_ratio"] == [0.0]
    assert res["layer_err"] == [[0.0, 0.0, 0.0]] and res["bias2"] == [0.0, 0.0, 0.0]


def test_compressed_cache_has_positive_kl(setup):
    model, ctx, cont, prefill, ref = setup
    for name in ("snapkv", "prob_min_h"):
        res = M.evaluate_config(model, prefill, M.setting(name, 0.6), [0, 1], cont, 5, ref)
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
                                        ("prob_tova_nocorr", 2), ("topk_min_h", 0), ("h2o", 0)])
def test_engine_replay_equals_real_compressed_prefill(setup, name, seed):
    """The bench's fast path (one engine prefill, proposals shared across seeds) gives the same
    KL figures as the slow reference, a real prefill under the press then the continuation."""
    model, ctx, cont, prefill, ref = setup
    M.evaluate_config(model, prefill, M.setting(name, 0.5), [seed + 100], cont, 5, ref)  # warms the proposal memo
    fast = M.evaluate_config(model, prefill, M.setting(name, 0.5), [seed], cont, 5, ref)
    press = Config(name, 0.5, seed).build()
    logits, attention = teacher_forced(model, press_prefill(model, ctx, press), cont, N_CONTEXT, capture_attention=True)
    kl = M.kl_per_position(ref["logits"], logits)
    assert fast["kl"][0] == pytest.approx(float(kl.mean()), abs=1e-6)
    assert fast["layer_err"][0] == pytest.approx(M.relative_error(attention, ref["attention"]), abs=1e-5)
    if hasattr(press, "stats") and press.stats:
        assert fast["realised_ratio"][0] == press.stats["realised_ratio"]
    assert prefill.full_cache.layers[0].keys.shape[2] == N_CONTEXT  # the full cache is never modified


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
    from evaluation.store.results import ResultStore

    records = []
    for i, (top, samp) in enumerate([(0.5, [0.1, 0.3]), (0.4, [0.2, 0.2]), (0.6, [0.3, 0.5])]):
        records.append(_record(f"e{i}", "snapkv", [top]))
        records.append(_record(f"e{i}", "prob_snapkv", samp, seeds=(0, 1)))
        # an old-style label: relabelled to the runner's
        records.append(_record(f"e{i}", "prob_snapkv@tau=inf", samp, tau="inf", method="prob_snapkv", seeds=(0, 1)))
    ResultStore(tmp_path / "records.jsonl").append(records)
    paths = R.write_report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    kl = {(r["press"], r["ratio"]): r for r in summary["kl"]}
    assert set(kl) == {("snapkv", 0.5), ("prob_snapkv", 0.5), ("prob_snapkv[temperature=inf]", 0.5)}
    assert kl[("snapkv", 0.5)]["kl"] == pytest.approx(0.5)
    assert kl[("prob_snapkv", 0.5)]["kl"] == pytest.approx(0.8 / 3)  # seed means 0.2, 0.2, 0.4
    half = 4.302653 * np.std([0.2, 0.2, 0.4], ddof=1) / math.sqrt(3)  # t_{0.975, 2} from tables
    assert kl[("prob_snapkv", 0.5)]["kl_lo"] == pytest.approx(0.8 / 3 - half, abs=1e-6)
    paired = [r for r in summary["paired"] if r["A"] == "prob_snapkv" and r["B"] == "snapkv"]
    assert len(paired) == 1 and paired[0]["diff"] == pytest.approx(0.8 / 3 - 0.5) and paired[0]["A_better"] == 3
    assert paired[0]["p_value"] == pytest.approx(stats.paired_difference([0.2, 0.2, 0.4], [0.5, 0.4, 0.6])["p_value"])
    text = (tmp_path / "report.md").read_text()
    assert "Paired comparisons" in text and "Temperature" in text and "prob_snapkv" in text
    row = next(line for line in text.splitlines() if line.startswith("| prob_snapkv |"))
    assert "–" not in row and "0.5000" in row and "1.000" in row  # every cell of the KL table filled
    assert paths["kl_bars"].exists() and paths["layer_error"].exists()


def test_loglog_slope_and_backfilled_m(tmp_path):
    from evaluation.store.results import ResultStore

    x = np.array([10.0, 20.0, 40.0, 80.0])
    assert T.loglog_slope(x, 3.0 / x**2) == pytest.approx(-2.0)
    assert math.isnan(T.loglog_slope(x, np.array([1.0, -1.0, 0.5, np.nan])))  # fewer than 3 usable points
    records = [dict(_record("e0", "prob_snapkv", [0.2]), m=None), dict(_record("e1", "prob_snapkv", [0.3]), m=70.0),
               dict(_record("e0", "prob_snapkv@budget=head", [0.2], method="prob_snapkv", budget="head"), m=None)]
    ResultStore(tmp_path / "records.jsonl").append(records)
    ResultStore(tmp_path / "m.jsonl").append([
        {"data_dir": "d", "example_id": "e0", "press": "prob_snapkv", "compression_ratio": 0.5, "m": 50.0},
        {"data_dir": "d", "example_id": "e0", "press": "prob_snapkv@budget=head", "compression_ratio": 0.5, "m": 9.0}])
    df = T.load_records(tmp_path)
    assert df.set_index(["example_id", "press"])["m"].to_dict() == {
        ("e0", "prob_snapkv"): 50.0, ("e1", "prob_snapkv"): 70.0, ("e0", "prob_snapkv[budget=head]"): 9.0}
    assert T.layer_table(df).set_index("press")["m_mean"].to_dict() == {"prob_snapkv": 60.0, "prob_snapkv[budget=head]": 9.0}


def test_scope_table(tmp_path):
    from evaluation.store.results import ResultStore

    records = []
    for i, (top, glob, head) in enumerate([(0.5, 0.3, 0.2), (0.4, 0.2, 0.25), (0.6, 0.5, 0.3)]):
        records.append(_record(f"e{i}", "snapkv", [top]))
        records.append(_record(f"e{i}", "prob_snapkv", [glob]))
        records.append(_record(f"e{i}", "prob_snapkv[budget=head]", [head], method="prob_snapkv", budget="head"))
    ResultStore(tmp_path / "records.jsonl").append(records)
    R.write_report(tmp_path)
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
        s_ref = M.bias_variance(torch.randn(3, 50, generator=g) + 1.0, ref + 1.0)
        plug.append(s_ref["bias2"])
        debiased.append(T.debiased_bias2(s_ref["bias2"], s_ref["variance"], 3))
    assert np.mean(plug) == pytest.approx(1 / 3, rel=0.1)  # Var / S, Var = 1 relative to ||ref||^2 = 50 / 50
    assert abs(np.mean(debiased)) < 0.03
    assert math.isnan(T.debiased_bias2(0.1, 0.0, 1))
