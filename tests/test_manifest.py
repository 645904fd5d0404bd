"""Run manifests: a resume or a merge with other settings stops before computing, naming each field;
settings that cannot change a score may differ; legacy folders are read with a note; missing paths are errors."""

import json

import pytest
import torch
from conftest import tiny_model
from test_runner import examples

from evaluation import cli
from evaluation.store import manifest


@pytest.fixture
def fake_run(monkeypatch, tokenizer):
    """``kvprob run`` on a tiny Llama and two tiny examples. Returns its state: ``loads`` counts the model
    loads (a refused resume computes nothing, so it loads nothing), ``scale`` multiplies the output layer
    (other weights under the same name)."""
    state = {"loads": [], "scale": 1.0}

    def load(args):
        state["loads"].append(args.model)
        model = tiny_model("llama", layers=2)
        with torch.no_grad():
            model.lm_head.weight.mul_(state["scale"])
        model.generation_config.eos_token_id = 2
        return model, tokenizer

    monkeypatch.setattr(cli, "_load", load)
    monkeypatch.setattr(cli, "_frame", lambda args, tok: examples(2))
    return state


def run(out, *extra):
    cli.main(["run", "--presses", "snapkv", "--ratios", "0.5", "--context-length", "256", "--out", str(out), *extra])


def lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_a_run_writes_its_manifest_and_a_resume_with_the_same_identity_adds_a_run(tmp_path, fake_run):
    run(tmp_path, "--decode-batch", "1")
    records = lines(tmp_path / "results.jsonl")
    assert len(records) == 4  # 2 examples x (full, snapkv)
    first = json.loads((tmp_path / "results.manifest.json").read_text())
    ident = first["identity"]
    assert set(ident) == set(manifest.IDENTITY) - {"split", "scored_tokens"}  # those two are the prose benchmark's
    assert (ident["model"], ident["dataset"], ident["data_seed"], ident["context_length"], ident["query_aware"],
            ident["dtype"]) == ("SmolLM2-135M-Instruct", "ruler", 0, 256, False, "float32")
    entry = first["runs"][0]
    assert entry["decode_batch"] == 1 and entry["device"] == "cpu" and entry["torch"] and entry["kvpress"] == "0.5.5"
    run(tmp_path, "--decode-batch", "4")  # decode batch may differ: nothing left to compute, one more run entry
    assert lines(tmp_path / "results.jsonl") == records
    second = json.loads((tmp_path / "results.manifest.json").read_text())
    assert second["identity"] == ident and [r["decode_batch"] for r in second["runs"]] == [1, 4]


@pytest.mark.parametrize("extra, field, values", [
    (["--query-aware"], "query_aware", "False vs True"),
    (["--context-length", "512"], "context_length", "256 vs 512"),
    (["--model", "some/other-model"], "model", "'SmolLM2-135M-Instruct' vs 'some/other-model'"),
    (["--data-seed", "1"], "data_seed", "0 vs 1"),
])
def test_a_resume_with_another_identity_stops_before_loading_the_model(tmp_path, fake_run, extra, field, values):
    run(tmp_path)
    before = lines(tmp_path / "results.jsonl")
    with pytest.raises(SystemExit, match=f"(?s)other settings.*{field}: {values} .*results.manifest.json"):
        run(tmp_path, *extra)
    assert fake_run["loads"] == [None]  # loaded once, for the first run: the resume computed nothing
    assert lines(tmp_path / "results.jsonl") == before


def test_a_resume_with_other_weights_under_the_same_name_stops(tmp_path, fake_run):
    run(tmp_path, "--model", "local/model")
    fake_run["scale"] = 2.0
    with pytest.raises(SystemExit, match="model_digest: '[0-9a-f]{16}' vs '[0-9a-f]{16}'"):
        run(tmp_path, "--model", "local/model")
    assert len(lines(tmp_path / "results.jsonl")) == 4


def test_merge_refuses_shards_of_other_settings(tmp_path, fake_run, capsys):
    run(tmp_path / "a", "--shard", "1/2")
    run(tmp_path / "b", "--shard", "2/2", "--query-aware")
    shards = [str(tmp_path / "a" / "shard-1of2.jsonl"), str(tmp_path / "b" / "shard-2of2.jsonl")]
    out = tmp_path / "merged.jsonl"
    with pytest.raises(SystemExit, match="(?s)kvprob merge: shards computed with other settings.*query_aware: False vs True"):
        cli.main(["merge", "--out", str(out), *shards])
    assert not out.exists()
    run(tmp_path / "a", "--shard", "2/2")  # the same settings: merged, with both runs in the manifest
    cli.main(["merge", "--out", str(out), str(tmp_path / "a" / "shard-1of2.jsonl"), str(tmp_path / "a" / "shard-2of2.jsonl")])
    merged = json.loads((tmp_path / "merged.manifest.json").read_text())
    assert [r["shard"] for r in merged["runs"]] == ["1/2", "2/2"] and len(lines(out)) == 4
    with pytest.raises(SystemExit, match="no such shard file.*shard-9of9.jsonl"):
        cli.main(["merge", "--out", str(out), str(tmp_path / "a" / "shard-9of9.jsonl")])


def test_a_legacy_folder_is_read_with_a_note_and_its_records_checked(tmp_path, fake_run, capsys):
    run(tmp_path)
    (tmp_path / "results.manifest.json").unlink()  # as written before manifests
    (tmp_path / "data_seed.json").write_text('{"data_seed": 0}\n')
    with pytest.raises(SystemExit, match=r"data_dir \(context length\): '256' vs '512'"):
        run(tmp_path, "--context-length", "512")
    with pytest.raises(SystemExit, match="data_seed: 0 vs 1.*results.jsonl"):
        run(tmp_path, "--data-seed", "1")
    with pytest.raises(SystemExit, match="model: 'SmolLM2-135M-Instruct' vs 'x/y'"):
        run(tmp_path, "--model", "x/y")
    capsys.readouterr()
    run(tmp_path)  # the same settings: resumed, with a note saying what is assumed
    assert "has no manifest" in capsys.readouterr().err
    written = json.loads((tmp_path / "results.manifest.json").read_text())
    assert "query_aware" in written["assumed"] and written["identity"]["query_aware"] is False


@pytest.mark.parametrize("command", [["compare", "--split", "test", "--results"], ["report", "--results"]])
def test_reading_a_missing_folder_is_an_error_naming_it(tmp_path, command):
    missing = tmp_path / "never-run"
    with pytest.raises(SystemExit, match=f"no such results folder or file: {missing}"):
        cli.main([*command, str(missing)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no results"):
        cli.main([*command, str(tmp_path / "empty")])


def test_a_readonly_store_of_a_missing_file_raises():
    from evaluation.store.results import ResultStore, load_results

    with pytest.raises(FileNotFoundError, match="no results file nowhere.jsonl"):
        load_results("nowhere.jsonl")
    assert ResultStore("/nonexistent-dir/new.jsonl", readonly=False).records() == []  # a store to write starts empty


def test_bench_and_study_reports_refuse_a_missing_folder(tmp_path):
    from evaluation.bench.__main__ import main
    from experiments.decompose.run import main as decompose

    with pytest.raises(FileNotFoundError, match="never-run"):
        main(["fidelity", "--report-only", "--out", str(tmp_path / "never-run")])
    with pytest.raises(FileNotFoundError, match="never-run"):
        decompose(["--report", "--out", str(tmp_path / "never-run")])
