"""The recall benchmark (evaluation/tasks/recall/): sentence finding on hand-made tokens, cues on the real
essays, the full cache against itself, the cache restored between cues, a run with every kind of press
and its resume, the tables, the CLI's manifest."""

import pytest
import torch

from evaluation import cli
from evaluation.engine import Prefill
from evaluation.engine.runner import Config, configurations
from evaluation.store import manifest
from evaluation.store.results import ResultStore
from evaluation.tasks.recall import tables
from evaluation.tasks.recall.cues import sentence_spans, window_cues, windows
from evaluation.tasks.recall.measure import cue_logits, cue_metrics, run, window_metrics
from tests.conftest import tiny_model

N = 128


def test_sentence_spans_on_hand_made_tokens():
    pieces = ["It", " rained", ".", " The", " sky", " was", " grey", " all", " day", ".", " so", "\n", "Then",
              " we", " went", " home", " at", " last", "!", " ok"]
    assert sentence_spans(pieces, cue_tokens=2) == [(3, 9), (12, 18)]
    assert sentence_spans(pieces, cue_tokens=3) == [(3, 9), (12, 18)]  # 7 tokens >= 3 + 4
    assert sentence_spans(pieces, cue_tokens=4) == []  # 7 tokens < 4 + 4


@pytest.fixture(scope="module")
def recall_windows(tokenizer):
    return windows(tokenizer, N, "dev", sentences=4, cue_tokens=3, scored=8, max_per_essay=2)


def test_cues_are_spread_and_begin_with_a_blank_line(tokenizer, recall_windows):
    assert recall_windows and all(1 <= len(w.cues) <= 4 for w in recall_windows)
    blank = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    for w in recall_windows:
        parts = [c.start * 4 // N for c in w.cues]
        assert parts == sorted(set(parts))  # at most one per quarter, in order
        for c in w.cues:
            assert c.cue.shape[1] == len(blank) + 3 and 2 <= len(c.targets) <= 8
            text = tokenizer.decode(torch.cat([c.cue[0], c.targets]))
            assert text.startswith("\n\n") and text[2:3].isupper()  # a blank line, then the sentence
            sentence = tokenizer.decode(w.ids[0, c.start :].tolist())
            assert sentence.strip().startswith(text.strip())
    with pytest.raises(ValueError, match="sentences"):
        window_cues(tokenizer, recall_windows[0].ids[0].tolist(), 0, 3, 8)
    with pytest.raises(ValueError, match="n \\(context tokens\\)"):
        windows(tokenizer, 1, "dev", 4, 3, 8)


def test_full_cache_against_itself_and_the_cache_is_restored(recall_windows):
    model = tiny_model("llama")
    w = recall_windows[0]
    shared = Prefill(model, w.ids, [])
    cache = shared.compress(None)
    before = [layer.keys for layer in cache.layers]
    a = [cue_logits(model, cache, c, N) for c in w.cues]
    assert [layer.keys for layer in cache.layers] == before  # the same tensors: nothing appended
    b = [cue_logits(model, shared.compress(None), c, N) for c in w.cues]
    m = window_metrics([cue_metrics(x, y, c.targets) for x, y, c in zip(a, b, w.cues)])
    assert m["kl"] == 0.0 and m["nll_delta"] == 0.0 and m["acc"] == m["acc_full"]
    assert a[0].shape[0] == len(w.cues[0].targets)


def test_cue_metrics_on_a_hand_case():
    ref = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    m = cue_metrics(ref, logits, torch.tensor([0, 1]))
    assert m["acc"] == 0.5 and m["acc_full"] == 1.0 and m["exact"] == 0.0 and m["kl"] > 0 and m["nll_delta"] > 0


PRESSES = ["snapkv", "h2o", "expected_attention", "topk_keydiff_block8", "prob_min_h_priority",
           "cross_keydiff_block8_a50", "prob_uniform_priority_head", "keydiff_sum4"]


def test_a_run_with_every_kind_of_press_resumes_and_reports(recall_windows, tmp_path):
    model = tiny_model("qwen3")
    store = ResultStore(tmp_path / "results.jsonl")
    configs = configurations(PRESSES, [0.5], [0, 1])
    written = run(model, recall_windows[:2], configs, store, model_name="tiny", split="dev", progress=False)
    assert written == 2 * len(configs)
    assert run(model, recall_windows[:2], configs, store, model_name="tiny", split="dev", progress=False) == 0
    df = store.load()
    full = df[df["press"] == "full"]
    assert (full["kl"] == 0).all() and (full["acc"] == full["acc_full"]).all()
    rest = df[df["press"] != "full"]
    assert (rest["kl"] > 0).all() and rest["acc"].between(0, 100).all()
    sampled = rest[rest["press"].map(lambda p: Config(p, 0.5).samples)]
    assert (sampled["bias_bytes"] > 0).all()
    df["split"] = "dev"
    text = tables.markdown(df, {"split": "dev", "context_length": N, "commands": []})
    assert "## r = 0.5" in text and "cross_keydiff_block8_a50" in text
    s = tables.summary(tables.prepare(df), tables.references(tables.prepare(df)))
    ref = s["reference"].iloc[0]
    assert not Config(ref, 0.5).samples
    assert s.loc[s["press"] == ref, "acc"].iloc[0] == s.loc[~s["press"].map(lambda p: Config(p, 0.5).samples), "acc"].max()


def test_cli_writes_a_manifest_and_refuses_other_settings(tmp_path, tokenizer):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    argv = ["recall", "run", "--model", str(folder), "--split", "dev", "--context", str(N), "--cue-tokens", "3",
            "--scored-tokens", "8", "--presses", "snapkv", "--ratios", "0.5", "--max-windows", "2", "--out", str(out)]
    cli.main(argv)
    m = manifest.read(out / "results.jsonl")
    assert m["identity"]["dataset"] == "recall" and m["identity"]["dataset_version"].endswith("cue3")
    assert (out / "report.md").exists()
    with pytest.raises((SystemExit, manifest.ManifestMismatch)):
        cli.main([a if a != "3" else "4" for a in argv])
