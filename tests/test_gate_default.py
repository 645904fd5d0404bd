"""The gate a gate press loads: found by its name (the corpus and the settings), the model's default set by
``kvprob train-gate --set-default``, never the newest file; read once per process; and RECOMMENDED_FAST run as
kvpress's evaluate.py runs it, by name, with the model's default gate in place, or a clear error without one."""

import argparse

import pytest
import torch
from kvpress.utils import compute_n_kept

from evaluation.tasks.prose.gate import cmd_train_gate
from kvpress_prob.cache import head_entries, held_counts
from kvpress_prob.integrations.kvpress_eval import register
from kvpress_prob.learned import training as tr
from kvpress_prob.learned.profile import learn_profile
from kvpress_prob.names.registry import RECOMMENDED_FAST, get_press
from kvpress_prob.presses import gate_store as gs
from tests.conftest import random_ids, tiny_model
from tests.test_kvpress_eval import evaluate_setup_press


def kept_keys(model, press, ids) -> list[torch.Tensor]:
    """Every KV head's held keys (c_h, d), layer by layer, after ``press``'s prefill of ``ids``."""
    from evaluation.engine import press_prefill

    return [keys for layer in press_prefill(model, ids, press).layers for keys, _ in head_entries(layer)]


def test_a_gate_is_found_by_its_settings_never_by_its_age(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=2)
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))  # after the model: its tokenizer stays where it was converted
    contexts = [random_ids(48, seed=s) for s in (1, 2)]
    default, _ = tr.fit(model, contexts, gs.DEFAULT_CORPUS, gs.TrainSettings(batch_size=64), progress=False)
    short, _ = tr.fit(model, contexts, gs.DEFAULT_CORPUS, gs.TrainSettings(steps=5, batch_size=32), progress=False)
    learn_profile(model, contexts, "test")  # the budget profile a profile press also needs (labels cached by fit)
    assert short.stat().st_mtime_ns >= default.stat().st_mtime_ns and default.stem != short.stem
    monkeypatch.setattr(gs, "DEFAULT_GATE", default.stem)  # the press's named default: these settings' gate
    ids = random_ids(64, seed=3)
    plain = get_press(RECOMMENDED_FAST, 0.5)
    named = get_press(RECOMMENDED_FAST, 0.5, gate=short.stem)
    by_path = get_press(RECOMMENDED_FAST, 0.5, gate=str(short))
    got_plain, got_named, got_path = (kept_keys(model, p, ids) for p in (plain, named, by_path))
    assert plain.gate_used == default.stem and named.gate_used == by_path.gate_used == short.stem
    expected = {stem: kept_keys(model, get_press(RECOMMENDED_FAST, 0.5, gates=gs.load_gates(path)), ids)
                for stem, path in ((default.stem, default), (short.stem, short))}
    assert all(torch.equal(a, b) for a, b in zip(got_plain, expected[default.stem]))  # the newest is not loaded
    assert all(torch.equal(a, b) for a, b in zip(got_named, expected[short.stem]))
    assert all(torch.equal(a, b) for a, b in zip(got_path, expected[short.stem]))
    assert any(not torch.equal(a, b) for a, b in zip(expected[default.stem], expected[short.stem]))  # they differ
    gs.set_default(model, short.stem)  # kvprob train-gate --set-default
    again = get_press(RECOMMENDED_FAST, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(kept_keys(model, again, ids), expected[short.stem]))
    assert again.gate_used == short.stem
    with pytest.raises(FileNotFoundError, match="kvprob train-gate"):
        gs.set_default(model, "never-trained")


def test_a_gate_is_read_once_per_process(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=2)
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))
    path, _ = tr.fit(model, [random_ids(40, seed=1)], "one", gs.TrainSettings(steps=3, batch_size=16), progress=False)
    reads = []
    read_gates = gs.read_gates
    monkeypatch.setattr(gs, "read_gates", lambda p: reads.append(p) or read_gates(p))
    for ratio in (0.5, 0.75, 0.5):
        with get_press("topk_gate_layers", ratio, gate=path.stem)(model):
            model.model(input_ids=random_ids(32, seed=2))
    assert len(reads) == 1


def train_gate_args(**given) -> argparse.Namespace:
    """``kvprob train-gate``'s arguments, small: 2 prose contexts of 64 tokens, no RULER, one held out."""
    args = dict(model=None, context=64, prose_texts=2, ruler_texts=0, heldout_texts=1, steps=4, batch_size=32, seed=0,
                set_default=True, package=False, out=None)
    return argparse.Namespace(**(args | given))


def test_recommended_fast_runs_as_kvpress_evaluate_runs_it(tmp_path, monkeypatch, tokenizer):
    from kvpress import KVPressTextGenerationPipeline

    model = tiny_model("llama")
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
    registry = {}
    register(registry)
    press = evaluate_setup_press(registry, RECOMMENDED_FAST, 0.5)
    with pytest.raises(FileNotFoundError, match="kvprob train-gate"):  # no gate yet: how to get one
        with torch.no_grad():
            pipe(context, question="What is item 3?", press=press, max_new_tokens=3)
    record = cmd_train_gate(train_gate_args(), lambda args: (model, tokenizer))  # what `kvprob train-gate` runs
    assert record["default"] and gs.default_gate(model) == record["gate"] != gs.DEFAULT_GATE
    lengths = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: lengths.append(kw["hidden_states"].shape[1]), with_kwargs=True)
    try:
        with torch.no_grad():
            out = pipe(context, question="What is item 3?", press=press, max_new_tokens=3)
    finally:
        handle.remove()
    assert isinstance(out["answer"], str) and press.gate_used == record["gate"] and lengths
    ids = tokenizer(context, return_tensors="pt").input_ids
    n, L, H = ids.shape[1], model.config.num_hidden_layers, model.config.num_key_value_heads
    held = sum(len(k) for k in kept_keys(model, press, ids))  # entries on the cache after the prefill
    assert 0 < held <= L * H * compute_n_kept(n, 0.5) < L * H * n  # evicted at the set ratio


def test_harness_records_name_the_gate_and_equal_the_pipeline(tmp_path, monkeypatch, tokenizer):
    """A sweep of gate presses (their scores shared across ratios) gives the pipeline's answers with each press run
    from scratch, and every record of a gate press names the gate it used."""
    from kvpress import KVPressTextGenerationPipeline

    from evaluation.engine.runner import configurations, run
    from evaluation.store.results import ResultStore
    from tests.test_runner import examples

    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))
    path, _ = tr.fit(model, [random_ids(60, seed=1)], "one", gs.TrainSettings(steps=3, batch_size=16), progress=False)
    learn_profile(model, [random_ids(60, seed=1)], "test")
    gs.set_default(model, path.stem)
    gates = list(dict.fromkeys([RECOMMENDED_FAST, "topk_gate_layers_recent25", "topk_gate_widest"]))[:2]
    configs = configurations(gates, [0.5, 0.75], [0])
    store, frame = ResultStore(tmp_path / "r.jsonl"), examples(1)
    run(model, tokenizer, frame, configs, store, model_name="tiny", dataset="ruler", data_dir="64", progress=False)
    records = store.records()
    assert len(records) == len(configs) == 5
    pipe, row = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer), frame.iloc[0]
    for record, cfg in zip(sorted(records, key=lambda r: (r["press"], r["compression_ratio"])),
                           sorted(configs, key=lambda c: (c.label, c.compression_ratio))):
        assert record.get("gate") == (None if cfg.press == "full" else path.stem)
        reference = pipe(row.context, question=row.question, answer_prefix=row.answer_prefix, press=cfg.build(),
                         max_new_tokens=int(row.max_new_tokens))["answer"]
        assert record["prediction"] == reference, cfg
