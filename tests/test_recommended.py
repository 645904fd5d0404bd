"""The recommendations' one source (evaluation.report.recommended): registry constants, test-split table, price
records; the README's table is the generated one."""

import os
import re

import pandas as pd
import pytest

from evaluation.report import price, recommended
from kvpress_prob.names import registry

README = recommended.ROOT / "README.md"


@pytest.fixture(scope="module")
def recs():
    return recommended.rows()


def test_rows_are_the_registry_constants(recs):
    constants = sorted(n for n in vars(registry) if re.fullmatch(r"RECOMMENDED(_[A-Z]+)?", n))
    assert sorted(r.constant for r in recs) == constants
    assert {r.constant: r.press for r in recs} == {c: getattr(registry, c) for c in constants}
    assert [r.label for r in recs] == ["default", "fast", "prose", "retrieval", "slow"]


def test_quality_is_the_test_table_row(recs):
    csv = pd.read_csv(recommended.TEST_TABLE.with_suffix(".csv"), index_col="press")
    for rec in recs:
        row = csv.loc[rec.press]
        assert rec.worst == pytest.approx(row["worst"]) and rec.worst_regime == row["worst_regime"]
        assert min(rec.regime_q.values()) == pytest.approx(rec.worst)
        for regime, per in rec.quality.items():
            assert per and all(q == pytest.approx(row[f"q_{regime}_{r:g}"]) for r, q in per.items())
            assert sum(per.values()) / len(per) == pytest.approx(rec.regime_q[regime])


def test_evidence_counts_match_the_tables_interval_headers(recs):
    text = recommended.TEST_TABLE.read_text()
    for regime in ("ruler", "prose", "recall"):
        section = text.split(f"### {regime}\n", 1)[1].split("###", 1)[0]
        ns = {int(n) for n in re.findall(r"n = (\d+)\)", section)}
        assert len(ns) == 1 and {r.evidence.examples[regime] for r in recs} == ns
    for rec in recs:
        assert rec.evidence.split == "test" and rec.evidence.model and rec.evidence.folders
        for folder in rec.evidence.folders:
            rows = pd.read_json(recommended.ROOT / folder / "results.jsonl", lines=True)
            assert (rows["press"] == rec.press).any()


def _record(tmp_path, name, rows):
    cols = {c: 1 for c in price.REQUIRED} | {"ratio": recommended.PRICE_RATIO, "n": recommended.PRICE_LENGTH}
    path = tmp_path / name / "price.jsonl"
    path.parent.mkdir()
    pd.DataFrame([cols | {"device": "cpu", "decode_route": "sdpa", "command": f"cmd {name}"} | r for r in rows]
                 ).to_json(path, orient="records", lines=True)
    return path


def _row(press, m, lo, hi):
    return {"press": press, **{f"{f}_over_snapkv{e}": v for f in price.COLUMNS for e, v in
                               (("", m), ("_lo", lo), ("_hi", hi))}}


def test_price_is_the_newest_record_with_the_range_over_all(tmp_path):
    old = _record(tmp_path, "old", [_row("a", 2.0, 1.5, 2.5), _row("b", 9.0, 8.0, 10.0)])
    new = _record(tmp_path, "new", [_row("a", 3.0, 2.8, 3.2)])
    os.utime(old, (1_000_000, 1_000_000))
    os.utime(new, (2_000_000, 2_000_000))
    assert recommended.written(new) > recommended.written(old)  # outside a repository: the modification time
    records = [(str(p), price.load(p)) for p in sorted([old, new], key=recommended.written, reverse=True)]
    a = recommended.price_of("a", records)
    assert a.record == str(new) and a.records == (str(new), str(old)) and a.command == "cmd new"
    assert a.median == dict.fromkeys(price.COLUMNS, 3.0) and a.spread == dict.fromkeys(price.COLUMNS, (1.5, 3.2))
    assert recommended.price_of("b", records).median["prefill"] == 9.0
    assert recommended.price_of("c", records) is None
    other = _record(tmp_path, "other", [_row("a", 7.0, 6.0, 8.0) | {"ratio": 0.9}])
    assert recommended.price_of("a", [(str(other), price.load(other)), *records]).median["prefill"] == 3.0
    longer = _record(tmp_path, "longer", [_row("a", 5.0, 4.0, 6.0) | {"n": 2 * recommended.PRICE_LENGTH}])
    a = recommended.price_of("a", [(str(longer), price.load(longer)), *records])
    assert a.median["prefill"] == 3.0 and a.spread["prefill"] == (1.5, 3.2)  # another length is not mixed in


def test_a_press_without_record_shows_no_price_and_no_other_press_figures(monkeypatch, tmp_path):
    records = [("x.jsonl", price.load(_record(tmp_path, "x", [_row(registry.RECOMMENDED, 7.25, 7.0, 7.5)])))]
    monkeypatch.setattr(registry, "RECOMMENDED_FAST", registry.RECOMMENDED_RETRIEVAL)
    recs = recommended.rows(records=records)
    assert recs[0].price.cell("prefill") == "7.25 [7.00, 7.50]"
    table = recommended.frame(recs)
    others = [(rec, row) for rec, (_, row) in zip(recs, table.iterrows()) if rec.press != registry.RECOMMENDED]
    assert others  # RECOMMENDED_FAST and RECOMMENDED_RETRIEVAL name other presses here
    for rec, row in others:
        assert [row[price.COLUMNS[f]] for f in price.COLUMNS] == [recommended.NO_PRICE] * 3
        assert "7.25" not in " ".join(map(str, row.values))
    assert recs[1].press == registry.RECOMMENDED_RETRIEVAL  # the row follows the registry
    assert recommended.NO_PRICE in recommended.price_line(recs[1].press, recs[1].price)


def test_every_recommendation_is_priced_by_a_committed_record(recs):
    for rec in recs:
        assert rec.price is not None, f"{rec.constant}: {recommended.NO_PRICE}"
        rows = pd.concat([price.load(recommended.ROOT / p).loc[[rec.press]] for p in rec.price.records])
        newest = price.load(recommended.ROOT / rec.price.record).loc[rec.press]
        assert rec.price.median["prefill"] == newest["prefill_over_snapkv"]
        assert rec.price.spread["peak"] == (rows["peak_over_snapkv_lo"].min(), rows["peak_over_snapkv_hi"].max())


def test_markdown_table_has_one_row_per_distinct_press_naming_every_role(recs):
    text = recommended.markdown(recs)
    body = [line for line in text.splitlines() if line.startswith("| ")][2:]
    presses = list(dict.fromkeys(rec.press for rec in recs))
    assert len(body) == len(presses)
    for line, press in zip(body, presses):
        held = [rec for rec in recs if rec.press == press]
        assert f"`{press}`" in line and f"{held[0].worst:.3f}" in line
        assert all(f"`{rec.constant}`" in line for rec in held)
    assert sum(line.count("`RECOMMENDED") for line in body) == len(recommended.LABELS)  # every role once


def test_replace_block_round_trips(recs):
    readme = f"intro\n{recommended.BEGIN}\nstale\n{recommended.END}\nrest\n"
    out = recommended.replace_block(readme, recs)
    assert out.startswith("intro\n") and out.endswith(f"{recommended.END}\nrest\n") and "stale" not in out
    assert recommended.block(out) == recommended.markdown(recs)
    with pytest.raises(ValueError, match="recommended table"):
        recommended.replace_block("no markers", recs)


def test_readme_table_is_the_generated_one(recs):
    found = recommended.block(README.read_text())
    if found is None:
        pytest.skip("README.md has no generated recommended table yet")
    assert found == recommended.markdown(recs), "run: kvprob recommended --write README.md"


def test_cli_prints_the_generated_table(capsys, recs):
    from evaluation.cli import main

    main(["recommended", "--markdown"])
    assert capsys.readouterr().out.strip() == recommended.markdown(recs)
    main(["recommended"])
    out = capsys.readouterr().out
    assert all(f"{r.constant} = {r.press}" in out for r in recs)
