"""The prose benchmark (evaluation/tasks/prose/): its metric against a hand computation, the full cache
against itself, every kind of registry press on tiny models, resumption and refused resumes, and the
tables' paired statistics against scipy directly."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats as sps

from evaluation import cli
from evaluation.engine import Prefill, press_prefill, teacher_forced
from evaluation.engine.runner import Config, configurations
from evaluation.report.stats import ratio_ci
from evaluation.store import manifest
from evaluation.store.results import ResultStore
from evaluation.tasks.prose import tables
from evaluation.tasks.prose.essays import windows
from evaluation.tasks.prose.measure import order, run, window_metrics
from tests.conftest import tiny_model

N, T = 128, 16  # a tiny model's windows: 128 context tokens, 16 scored


def test_window_metrics_against_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    ref, logits = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    targets = torch.tensor([0, 3, 6, 2, 2])
    kl = nll = nll_full = agree = 0.0
    for t in range(5):
        zp, zq = sum(math.exp(x) for x in ref[t].tolist()), sum(math.exp(x) for x in logits[t].tolist())
        p = [math.exp(x) / zp for x in ref[t].tolist()]
        q = [math.exp(x) / zq for x in logits[t].tolist()]
        kl += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)) / 5
        nll += -math.log(q[targets[t]]) / 5
        nll_full += -math.log(p[targets[t]]) / 5
        agree += (max(range(7), key=lambda i: p[i]) == max(range(7), key=lambda i: q[i])) / 5
    m = window_metrics(ref, logits, targets)
    assert m["kl"] == pytest.approx(kl, rel=1e-12) and m["kl"] > 0
    assert m["nll"] == pytest.approx(nll, rel=1e-12) and m["nll_full"] == pytest.approx(nll_full, rel=1e-12)
    assert m["nll_delta"] == pytest.approx(nll - nll_full, rel=1e-10, abs=1e-12)
    assert m["top1"] == pytest.approx(agree)
    with pytest.raises(ValueError, match="targets must have shape"):
        window_metrics(ref, logits, targets[:3])


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prose_windows(tokenizer):
    return order(windows(tokenizer, N, T, "dev", max_per_essay=1))


def test_full_cache_against_itself_is_exactly_zero(llama, prose_windows):
    ids = prose_windows[0].ids
    prefill = Prefill(llama, ids[:, :N], [])
    a, _ = teacher_forced(llama, prefill.compress(None), ids[:, N : N + T], N)
    b, _ = teacher_forced(llama, prefill.compress(None), ids[:, N : N + T], N)
    m = window_metrics(a, b, ids[0, N + 1 :])
    assert m["kl"] == 0.0 and m["nll_delta"] == 0.0 and m["top1"] == 1.0


SAMPLE = ["streaming_llm", "snapkv", "tova", "h2o", "knorm", "keydiff", "expected_attention", "adakv_snapkv",
          "snapkv_adaptive", "topk_min_h", "prob_min_h", "prob_min_h_nocorr", "prob_h2o", "prob_min_h_block8",
          "prob_tova_block8_priority", "hybrid_keydiff_block8_a90", "topk_keydiff_block8", "keydiff_sum4"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_kind_of_registry_press_runs_and_matches_a_real_prefill(arch, tokenizer, prose_windows, tmp_path):
    model = tiny_model(arch)
    store = ResultStore(tmp_path / "results.jsonl")
    found = prose_windows[:1]
    written = run(model, tokenizer, found, configurations(SAMPLE, [0.5], [0, 1]), store, model_name="tiny",
                  split="dev", scored_tokens=T, progress=False)
    df = store.load()
    assert written == len(df) == 1 + sum(2 if Config(p, 0.5).samples else 1 for p in SAMPLE)
    full = df[df["press"] == "full"].iloc[0]
    assert full["kl"] == 0.0 and full["nll_delta"] == 0.0 and full["bias_bytes"] == 0
    rest = df[df["press"] != "full"]
    assert set(rest["press"]) == set(SAMPLE)
    assert (rest["kl"] > 0).all() and np.isfinite(rest["nll_delta"]).all()  # every press changed the output
    assert ((rest["realised_ratio"] - 0.5).abs() < 0.15).all()
    sampled = rest[rest["press"].map(lambda p: Config(p, 0.5).samples)]
    assert (sampled["bias_bytes"] > 0).all()  # log-weights, or (uncorrected) the padding's mask: held beside K, V
    kvpress_own = rest[rest["press"].isin(["snapkv", "tova", "h2o", "knorm", "keydiff", "streaming_llm"])]
    assert (kvpress_own["bias_bytes"] == 0).all()
    # the replayed compression against kvpress's own path: a prefill under the press, then the continuation
    ids = found[0].ids
    for name, seed in (("snapkv", 0), ("prob_min_h", 1), ("keydiff_sum4", 0)):
        reference, _ = teacher_forced(model, press_prefill(model, ids[:, :N], None), ids[:, N : N + T], N)
        press = Config(name, 0.5, seed).build()
        logits, _ = teacher_forced(model, press_prefill(model, ids[:, :N], press), ids[:, N : N + T], N)
        expected = window_metrics(reference, logits, ids[0, N + 1 :])
        got = df[(df["press"] == name) & (df["seed"] == seed)].iloc[0]
        assert got["kl"] == pytest.approx(expected["kl"], rel=1e-4, abs=1e-7), name
        assert got["nll_delta"] == pytest.approx(expected["nll_delta"], rel=1e-3, abs=1e-6), name


def test_a_resume_computes_only_what_is_missing(llama, tokenizer, prose_windows, tmp_path):
    store = ResultStore(tmp_path / "results.jsonl")
    configs = configurations(["snapkv", "prob_min_h"], [0.5], [0, 1])
    assert run(llama, tokenizer, prose_windows[:1], configs, store, model_name="m", split="dev", scored_tokens=T,
               progress=False) == 4
    first = store.path.read_text()
    with open(store.path, "a") as f:  # a kill in the middle of a line
        f.write('{"model": "m", "dataset": "prose", "data_dir": "128", "exa')
    store = ResultStore(store.path)  # opening for writing cuts the partial line
    assert run(llama, tokenizer, prose_windows[:2], configs, store, model_name="m", split="dev", scored_tokens=T,
               progress=False) == 4  # the second window only
    assert store.path.read_text().startswith(first)
    assert run(llama, tokenizer, prose_windows[:2], configs, store, model_name="m", split="dev", scored_tokens=T,
               progress=False) == 0
    records = store.records()
    assert len(records) == 8 and len({r["example_id"] for r in records}) == 2
    again = [r for r in records if r["press"] == "prob_min_h" and r["example_id"] == records[0]["example_id"]]
    rerun = ResultStore(tmp_path / "again.jsonl")
    run(llama, tokenizer, prose_windows[:1], configs, rerun, model_name="m", split="dev", scored_tokens=T, progress=False)
    assert [r["kl"] for r in rerun.records() if r["press"] == "prob_min_h"] == [r["kl"] for r in again]  # same seeds


def test_cli_runs_resumes_and_refuses_another_split_or_length(tmp_path, tokenizer, capsys):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    argv = ["prose", "run", "--model", str(folder), "--split", "dev", "--context", str(N), "--scored-tokens", str(T),
            "--presses", "snapkv", "prob_min_h", "--ratios", "0.5", "--seeds", "0", "1", "--max-windows", "3",
            "--out", str(out)]
    cli.main(argv)
    records = ResultStore(out / "results.jsonl", readonly=True).records()
    assert len(records) == 3 * 4 and {r["split"] for r in records} == {"dev"}
    m = manifest.read(out / "results.jsonl")
    assert m["identity"]["split"] == "dev" and m["identity"]["scored_tokens"] == T
    assert m["runs"][0]["command"].startswith("kvprob prose run --split dev")
    report = (out / "report.md").read_text()
    assert "dev split" in report and "3 windows of 3 essays" in report and m["runs"][0]["command"] in report
    cli.main(argv)  # nothing left to do
    assert len(ResultStore(out / "results.jsonl", readonly=True).records()) == 12
    for option, value in (("--split", "test"), ("--context", "96"), ("--scored-tokens", "10")):
        changed = list(argv)
        changed[changed.index(option) + 1] = value
        with pytest.raises(SystemExit, match="other settings"):
            cli.main(changed)
    assert len(ResultStore(out / "results.jsonl", readonly=True).records()) == 12


# --------------------------------------------------------------------------- tables


def synthetic(kls: dict, essays_of=lambda w: f"e{w // 2}") -> pd.DataFrame:
    """Records from {(press, window, seed): kl}; nll_delta = 2 kl; the full cache with kl 0."""
    rows = []
    windows_ = sorted({w for _, w, _ in kls})
    for w in windows_:
        rows.append(dict(model="m", dataset="prose", data_dir="8", split="dev", task=essays_of(w), example_id=f"w{w}",
                         press="full", compression_ratio=0.0, seed=0, kl=0.0, nll_delta=0.0, nll_full=3.0,
                         realised_ratio=0.0, kv_bytes=1000, bias_bytes=0, seconds=1.0))
    for (press, w, seed), kl in kls.items():
        rows.append(dict(model="m", dataset="prose", data_dir="8", split="dev", task=essays_of(w), example_id=f"w{w}",
                         press=press, compression_ratio=0.5, seed=seed, kl=kl, nll_delta=2 * kl, nll_full=3.0,
                         realised_ratio=0.5, kv_bytes=500, bias_bytes=4 if press.startswith("prob") else 0,
                         seconds=1.0))
    return tables.prepare(pd.DataFrame(rows))


def test_paired_tables_average_seeds_within_a_window_then_pair_over_windows():
    rng = np.random.default_rng(0)
    snap = rng.uniform(0.02, 0.05, 6)
    prob = {(w, s): snap[w] * 0.8 + rng.normal(0, 0.003) for w in range(6) for s in range(3)}
    kls = {("snapkv", w, 0): snap[w] for w in range(6)} | {("tova", w, 0): snap[w] * 1.5 for w in range(6)}
    kls |= {("prob_min_h", w, s): v for (w, s), v in prob.items()}
    kls |= {("prob_min_h_nocorr", w, s): v + 0.01 for (w, s), v in prob.items()}
    df = synthetic(kls)
    refs = tables.references(df)
    assert refs == {0.5: "snapkv"}  # the deterministic press with the lowest mean KL
    s = tables.summary(df, refs).set_index("press")
    window_means = np.array([np.mean([prob[(w, s_)] for s_ in range(3)]) for w in range(6)])
    diff = window_means - snap
    half = sps.t.ppf(0.975, 5) * diff.std(ddof=1) / np.sqrt(6)
    row = s.loc["prob_min_h"]
    assert row["kl_diff"] == pytest.approx(diff.mean()) and row["kl_diff_hi"] - row["kl_diff"] == pytest.approx(half)
    assert row["kl_lower"] == int((diff < 0).sum()) and row["pairs"] == 6 and row["windows"] == 6 and row["seeds"] == 3
    assert row["kl_ratio"] == pytest.approx(window_means.mean() / snap.mean())
    assert row["kl_ratio_lo"] < row["kl_ratio"] < row["kl_ratio_hi"]
    assert row["nll_delta_diff"] == pytest.approx(2 * diff.mean())
    assert row["held"] == pytest.approx(0.504) and s.loc["snapkv", "held"] == pytest.approx(0.5)
    twins = tables.twins(df)
    kl_twin = twins[twins["value"] == "kl"].iloc[0]
    assert (kl_twin["a"], kl_twin["b"]) == ("prob_min_h", "prob_min_h_nocorr")
    assert kl_twin["mean"] == pytest.approx(-0.01) and kl_twin["a_better"] == 6
    wins = tables.wins(df).set_index("press")
    assert wins.loc["prob_min_h", "kl_win_score"] == 1.0 and wins.loc["tova", "kl_win_score"] == 0.0
    assert wins.loc["prob_min_h", "kl_units"] == 3  # three essays at one ratio
    text = tables.markdown(df, {"split": "dev", "context_length": 8, "scored_tokens": 4, "commands": ["kvprob x"]})
    assert "dev split" in text and "6 windows of 3 essays" in text and "Command: `kvprob x`" in text
    assert "(6/6)" in text  # prob_min_h lower than snapkv on all 6 windows
    lead = tables.leaders(tables.summary(df, refs)).set_index("kind")["press"].to_dict()
    assert lead == {"top-k": "snapkv", "sampled, corrected": "prob_min_h", "sampled, uncorrected": "prob_min_h_nocorr"}


def test_incomplete_windows_are_left_out_and_counted():
    kls = {("snapkv", w, 0): 0.1 for w in range(4)} | {("tova", w, 0): 0.2 for w in range(3)}
    df, dropped = tables.complete_windows(synthetic(kls))
    assert dropped == 1 and set(df["example_id"]) == {"w0", "w1", "w2"}


def test_ratio_interval_resamples_pairs():
    a, b = np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, 4.0, 6.0, 8.0])
    r = ratio_ci(a, b)
    assert r["ratio"] == 0.5 and r["lo"] == pytest.approx(0.5) and r["hi"] == pytest.approx(0.5)  # a = b / 2 in every pair
    r = ratio_ci(a, b[::-1])
    assert r["ratio"] == pytest.approx(0.5) and r["lo"] < 0.5 < r["hi"]
    assert ratio_ci(a, b[::-1]) == r  # seeded
    with pytest.raises(ValueError, match="same shape"):
        ratio_ci(a, b[:2])


def test_report_refuses_mixed_splits(tmp_path):
    for split in ("dev", "test"):
        folder = tmp_path / split
        folder.mkdir()
        (folder / "results.jsonl").write_text(json.dumps(dict(model="m", dataset="prose", data_dir="8", example_id="w",
                                                              press="full", compression_ratio=0, seed=0)) + "\n")
        (folder / "results.manifest.json").write_text(json.dumps({"identity": {"split": split}, "runs": []}))
    with pytest.raises(manifest.ManifestMismatch, match="split"):
        tables.load([tmp_path / "dev", tmp_path / "test"])
