"""The price columns: the record's loader and the tables' columns on a small fake record, the bench's
per-round ratios, the decode-route spy, and the bench command end to end on a tiny model (seconds)."""

import json

import pandas as pd
import pytest
import torch

from evaluation.bench.speed import price as bench
from evaluation.bench.speed.parts import PARTS
from evaluation.bench.speed.route import route, routes
from evaluation.engine import press_prefill
from evaluation.report import price
from evaluation.report.press_info import price_line
from kvpress_prob import attention_dispatch
from kvpress_prob.names.registry import get_press
from tests.conftest import random_ids, tiny_model


def _row(press, m, lo, hi, route_name="sdpa", **extra):
    figures = {f"{s}_over_snapkv{end}": v for s in ("prefill", "peak", "decode") for end, v in
               (("", m), ("_lo", lo), ("_hi", hi))}
    return {"press": press, "device": "cpu", "n": 4096, "ratio": 0.5, "rounds": 3, "decode_route": route_name,
            "command": "python -m evaluation.bench price", **figures, **extra}


@pytest.fixture
def record(tmp_path):
    path = tmp_path / "price.jsonl"
    rows = [_row("snapkv", 1.0, 1.0, 1.0), _row("topk_kvzip_widest", 4.4, 4.25, 4.5, "corrected sdpa")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_columns_show_the_record_and_a_dash_where_it_has_none(record):
    loaded = price.load(record)
    cols = price.columns(["topk_kvzip_widest", "h2o", "snapkv"], loaded)
    assert list(cols.index) == ["topk_kvzip_widest", "h2o", "snapkv"]
    assert list(cols.columns) == [*price.COLUMNS.values(), "decode route"]
    assert cols.loc["topk_kvzip_widest", "prefill time / snapkv"] == "4.40 [4.25, 4.50]"
    assert cols.loc["topk_kvzip_widest", "decode route"] == "corrected sdpa"
    assert (cols.loc["h2o"] == price.MISSING).all()
    assert price.columns(["snapkv"], loaded, spread=False).loc["snapkv", "decode step / snapkv"] == "1.00"
    assert (price.columns(["snapkv"], None) == price.MISSING).all().all()
    text = price.note(loaded, cols.index, record)
    assert "`h2o`" in text and "`snapkv`" not in text and "3 rounds" in text and "n = 4096" in text


def test_the_loader_refuses_a_record_it_cannot_read_unambiguously(record, tmp_path):
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(json.dumps(r | {"n": n}) + "\n" for n in (4096, 32768) for r in rows))
    with pytest.raises(ValueError, match="more than once"):
        price.load(twice)
    assert price.load(twice, n=32768).loc["topk_kvzip_widest", "n"] == 32768
    partial = tmp_path / "partial.jsonl"
    partial.write_text(json.dumps({k: v for k, v in rows[0].items() if k != "decode_route"}) + "\n")
    with pytest.raises(ValueError, match="decode_route"):
        price.load(partial)
    assert price.maybe_load(tmp_path / "none.jsonl") is None


def test_kvprob_presses_shows_the_price_or_says_there_is_none(record):
    line = price_line("topk_kvzip_widest", record)
    assert "prefill time 4.40 [4.25, 4.50]" in line and "corrected sdpa" in line and "3 rounds" in line
    assert price_line("h2o", record).startswith(price.MISSING)


def test_ratios_are_taken_within_each_round():
    """Per-round ratios 2, 1, 3 (median 2) where the ratio of the medians would be 1."""
    raw = pd.DataFrame({
        "press": ["snapkv"] * 3 + ["x"] * 3, "round": [0, 1, 2] * 2,
        "prefill_s": [1.0, 2.0, 4.0, 2.0, 2.0, 12.0], "peak_bytes": [10, 10, 10, 5, 10, 20],
        "decode_ms": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], "kept_length": [32] * 6, "kv_bytes": [100] * 6,
        "bias_bytes": [0] * 6, "decode_route": ["sdpa", None, None] * 2, "peak_method": ["m"] * 6})
    record = bench.summarise(raw, {"n": 64}).set_index("press")
    x = record.loc["x"]
    assert (x.prefill_over_snapkv, x.prefill_over_snapkv_lo, x.prefill_over_snapkv_hi) == (2.0, 1.0, 3.0)
    assert (x.peak_over_snapkv, x.peak_over_snapkv_lo, x.peak_over_snapkv_hi) == (1.0, 0.5, 2.0)
    assert record.loc["snapkv", "decode_over_snapkv"] == 1.0 and x.decode_route == "sdpa" and x.n == 64


def _step(model, cache, n):
    return lambda: model(input_ids=torch.tensor([[5]]), past_key_values=cache, position_ids=torch.tensor([[n]]))


@torch.no_grad()
def test_the_spy_names_the_function_that_decodes():
    model, n = tiny_model("llama"), 96
    ids = random_ids(n, seed=2)
    plain = press_prefill(model, ids, get_press("snapkv", 0.5))
    assert routes(model, _step(model, plain, n)) == ["sdpa"] * 3  # one per layer
    biased = press_prefill(model, ids, get_press("prob_snapkv", 0.5))
    assert route(model, _step(model, biased, n)) == "corrected sdpa"
    previous = attention_dispatch.set_route(corrected="fused")
    try:
        assert route(model, _step(model, biased, n + 1)) == "flex"
    finally:
        attention_dispatch.set_route(**previous)
    assert route(model, _step(model, plain, n + 1)) == "sdpa"  # the spies are gone: nothing left behind


def test_rounds_on_a_tiny_model():
    """Three presses and kvpress's own KVzipPress, two rounds (in this process: ``run_here``): snapkv's ratios 1,
    each median within its range, KVzip's reconstruction and scoring paid in every round (fresh scores), and the
    parts adding up to the prefill."""
    model, ids = tiny_model("llama"), random_ids(96, seed=3)
    raw = bench.run_here(model, ids, ["snapkv", "topk_kvzip_widest", "prob_snapkv", "kvpress_kvzip"], 0.5, 2, 2, 1)
    record = bench.summarise(raw, {"n": 96}).set_index("press")
    assert list(record.index) == ["snapkv", "topk_kvzip_widest", "prob_snapkv", "kvpress_kvzip"]
    assert (record.rounds == 2).all()
    for figure in price.COLUMNS:
        assert (record.loc["snapkv", [f"{figure}_over_snapkv{e}" for e in ("", "_lo", "_hi")]] == 1.0).all()
        assert (record[f"{figure}_over_snapkv_lo"] <= record[f"{figure}_over_snapkv"]).all()
        assert (record[f"{figure}_over_snapkv"] <= record[f"{figure}_over_snapkv_hi"]).all()
    assert record.loc["snapkv", "decode_route"] == "sdpa"
    assert record.loc["prob_snapkv", "decode_route"] == "corrected sdpa"
    assert record.loc["kvpress_kvzip", "decode_route"] == "sdpa + kvpress masks"  # kvpress's masking, as shipped
    assert record.loc["snapkv", "kept_length"] == 48 and record.loc["kvpress_kvzip", "kept_length"] == 96
    assert len(raw) == 8 and set(raw["round"]) == {0, 1}
    for press, scored in (("topk_kvzip_widest", "fused_attention_s"), ("kvpress_kvzip", "scoring_s")):
        rows = raw[raw.press == press]
        assert (rows.reconstruction_s > 0).all() and (rows[scored] > 0).all() and (rows.allocation_s > 0).all()
    assert (raw[raw.press == "kvpress_kvzip"].fused_attention_s == 0).all()  # kvpress's own scoring, as shipped
    snapkv = raw[raw.press == "snapkv"]
    assert (snapkv[["reconstruction_s", "scoring_s", "fused_attention_s", "proposal_s", "allocation_s"]] == 0).all().all()
    assert (raw[raw.press == "prob_snapkv"].proposal_s == 0).all()  # a SamplingPress's proposal is in its hooks
    parts = raw[[f"{p}_s" for p in PARTS]].sum(axis=1)
    assert ((parts - raw.prefill_s).abs() < 1e-6).all()
    assert (raw[[f"{p}_s" for p in PARTS if p != "other"]] >= 0).all().all()
    assert raw.loadavg_before.notna().all() and raw.loadavg_after.notna().all()
    text = bench.markdown(record.reset_index().assign(device="cpu", ratio=0.5, command="c", model="m", dtype="d",
                                                      threads=1, decode_steps=2, elapsed_s=1.0, loadavg_start="[1.0]",
                                                      loadavg="[1.0]"), raw)
    assert "Where the prefill's time goes" in text and "load average" in text


@pytest.mark.slow  # the bench command, its press in a child process: `make test-all`
def test_the_bench_command_runs_each_press_in_a_fresh_process(tmp_path, tokenizer, monkeypatch):
    """The command end to end on a saved tiny model, one round: the press runs in a child process (a press that
    ran here would count in ``calls``), large blocks unmapped when freed there."""
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    calls = []
    monkeypatch.setattr(bench, "price_row", lambda *a, **k: calls.append(a))
    from evaluation.bench.__main__ import main

    main(["price", "--model", str(folder), "--length", "96", "--repeats", "1", "--decode-steps", "2",
          "--warmup-steps", "1", "--presses", "snapkv", "--out", str(tmp_path / "out")])
    assert not calls
    record = price.load(tmp_path / "out" / "price.jsonl")
    assert list(record.index) == ["snapkv"] and record.loc["snapkv", "kept_length"] == 48
    assert "MALLOC_MMAP_THRESHOLD_" in (tmp_path / "out" / "price.md").read_text()


def test_the_maximin_table_shows_the_price_columns(record, tmp_path):
    """The maximin command on hand-made records of three presses, with the fake price record: the priced
    presses' cells, a dash and the note's name for the one it lacks."""
    from evaluation.report.maximin_table import main as maximin_table
    from tests.test_maximin import _records

    values = {"snapkv": (40, 0.02, 0.04), "topk_kvzip_widest": (50, 0.01, 0.02), "tova": (30, 0.03, 0.05)}
    dirs = {}
    for i, (regime, column) in enumerate([("ruler", "score"), ("prose", "kl"), ("recall", "kl")]):
        dirs[regime] = tmp_path / regime
        dirs[regime].mkdir()
        _records({(p, r): v[i] for p, v in values.items() for r in (0.5, 0.75)}, column).to_json(
            dirs[regime] / "results.jsonl", orient="records", lines=True)
    out = maximin_table(["dev", *[a for r, d in dirs.items() for a in (f"--{r}", str(d))],
                         "--price", str(record), "--out", str(tmp_path / "t.md")])
    lines = out.read_text().splitlines()
    header = next(line for line in lines if line.startswith("| press"))
    assert all(name in header for name in [*price.COLUMNS.values(), "decode route"])
    widest = next(line for line in lines if line.startswith("| topk_kvzip_widest"))
    assert "4.40 [4.25, 4.50]" in widest and "corrected sdpa" in widest
    assert next(line for line in lines if line.startswith("| tova")).count(price.MISSING) == 4
    assert any(line.startswith("Price columns") and "`tova`" in line for line in lines)
    assert "prefill time / snapkv" not in out.with_suffix(".csv").read_text()  # the rule's CSV is unchanged


def test_records_combine_first_wins_and_the_note_names_each_run(record, tmp_path):
    first = price.load(record)
    other = tmp_path / "other.jsonl"
    rows = [_row("snapkv", 1.0, 1.0, 1.0), _row("topk_kvzip_widest", 9.0, 9.0, 9.0), _row("toprest", 5.0, 4.9, 5.1)]
    other.write_text("".join(json.dumps(r | {"command": "python -m evaluation.bench price --presses toprest"}) + "\n"
                             for r in rows))
    both = price.combine([first, None, price.load(other)])
    assert list(both.index) == ["snapkv", "topk_kvzip_widest", "toprest"]
    assert both.loc["topk_kvzip_widest", "prefill_over_snapkv"] == 4.4  # the first record's row
    assert both.loc["toprest", "prefill_over_snapkv"] == 5.0
    text = price.note(both, ["toprest"], [record, other])
    assert "within each run" in text and "--presses toprest` for `toprest`" in text
    assert price.combine([None]) is None


def test_a_rule_reads_each_press_at_its_dearest_row_of_enough_rounds(record, tmp_path):
    """``highest``: the largest of each figure over every record's rows of at least 3 rounds; a press priced only
    in fewer rounds is absent (no candidate under a rule's price bounds)."""
    other = tmp_path / "r09.jsonl"
    rows = [_row("snapkv", 1.0, 1.0, 1.0, ratio=0.9), _row("topk_kvzip_widest", 4.0, 3.9, 4.1, ratio=0.9),
            _row("short", 1.0, 1.0, 1.0, rounds=2)]
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bound = price.highest([price.load(record), None, price.load(other)])
    assert bound.loc["topk_kvzip_widest", "prefill_over_snapkv"] == 4.4  # r = 0.5's row is the dearer
    assert bound.loc["snapkv", "decode_over_snapkv"] == 1.0
    assert "short" not in bound.index
    assert price.highest([None]).empty
