"""Our presses in kvpress's evaluation registry: the format evaluate.py reads, and its way of using it.

kvpress's ``evaluation/evaluate_registry.py`` defines ``PRESS_REGISTRY = {name: press instance or
None}``; ``evaluate.py`` checks ``press_name in PRESS_REGISTRY``, then (outside its special cases
DuoAttention / DMS / Composed / ThinK / Decoding) sets ``press.compression_ratio`` on the instance
and runs the "kv-press-text-generation" pipeline with it, saving ``str(press)`` in its config.
"""

import json
import sys

import pytest
import torch
from kvpress import (
    BasePress,
    ComposedPress,
    DecodingPress,
    DMSPress,
    DuoAttentionPress,
    KnormPress,
    KVPressTextGenerationPipeline,
    SnapKVPress,
    ThinKPress,
)

from kvpress_prob.integrations.kvpress_eval import RECOMMENDATIONS, main, press_instances, register
from kvpress_prob.names import registry as names_registry
from kvpress_prob.presses.sampling import SamplingPress
from kvpress_prob.names.registry import PRESSES, RECOMMENDED_FAST
from tests.conftest import tiny_model

SPECIAL_CASES = (DuoAttentionPress, DMSPress, ComposedPress, ThinKPress, DecodingPress)


def kvpress_like_registry() -> dict:
    """A few entries in the shape of kvpress's PRESS_REGISTRY."""
    return {"snapkv": SnapKVPress(), "knorm": KnormPress(), "no_press": None}


def evaluate_setup_press(registry: dict, press_name: str, compression_ratio: float) -> BasePress:
    """What evaluate.py's ``_setup_press`` does for a press outside its special cases."""
    assert press_name in registry, f"Press '{press_name}' not found in PRESS_REGISTRY"
    press = registry[press_name]
    assert not isinstance(press, SPECIAL_CASES)
    assert hasattr(press, "compression_ratio")
    press.compression_ratio = compression_ratio
    str(press)  # saved as press_init_command
    return press


def test_register_adds_every_missing_name_and_keeps_kvpress_entries():
    registry = kvpress_like_registry()
    before = dict(registry)
    added = register(registry)
    recommended = {getattr(names_registry, c) for c in RECOMMENDATIONS}
    assert set(added) == (set(dict.keys(PRESSES)) | recommended) - set(before)
    assert recommended <= set(registry)  # every recommendation, RECOMMENDED_FAST's gate press included
    assert all(registry[name] is press for name, press in before.items())  # kvpress's own left alone
    for name in added:
        press = registry[name]
        assert isinstance(press, BasePress) and not isinstance(press, SPECIAL_CASES), name
        assert press.compression_ratio == 0.0, name
        assert "compression_ratio" in str(press), name
    assert register(registry) == []  # idempotent


def test_recommendations_are_the_registrys_constants():
    constants = sorted(n for n in vars(names_registry) if n.startswith("RECOMMENDED") and n.isupper())
    assert sorted(RECOMMENDATIONS) == constants


def test_register_refuses_silent_clashes_and_bad_input():
    registry = kvpress_like_registry()
    with pytest.raises(ValueError, match="already has \\['snapkv'\\].*overwrite=True"):
        register(registry, ["snapkv", "prob_snapkv"])
    assert "prob_snapkv" not in registry  # nothing half-added
    assert register(registry, ["snapkv"], overwrite=True) == ["snapkv"]
    assert isinstance(registry["snapkv"], SnapKVPress)
    assert register(registry, ["snapkv", "prob_min"], prefix="kvprob_") == ["kvprob_snapkv", "kvprob_prob_min"]
    with pytest.raises(ValueError, match="unknown press.*valid names"):
        register(registry, ["prob_magic"])
    with pytest.raises(ValueError, match="no selected press has the field.*tempreature"):
        register({}, ["prob_min"], tempreature=2.0)
    with pytest.raises(TypeError, match="PRESS_REGISTRY"):
        register([("a", None)])


def test_overrides_reach_only_presses_with_the_field():
    presses = press_instances(["snapkv", "prob_min_h"], seed=7, budget="layer", chunk_size=256)
    assert presses["prob_min_h"].seed == 7 and presses["prob_min_h"].budget == "layer"
    assert presses["prob_min_h"].proposal.chunk_size == 256  # a proposal field, routed by get_press
    assert isinstance(presses["snapkv"], SnapKVPress)


def test_evaluate_py_sets_the_ratio_and_the_press_compresses(tokenizer):
    """The registered instance, with its ratio set the way evaluate.py sets it, evicts at that ratio
    in kvpress's pipeline."""
    registry = kvpress_like_registry()
    register(registry)
    press = evaluate_setup_press(registry, "prob_min_h", 0.5)
    assert isinstance(press, SamplingPress)
    model = tiny_model("llama")
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
    with torch.no_grad():
        pipe(context, question="What is item 3?", press=press, max_new_tokens=3)
    assert press.stats["target_ratio"] == 0.5
    assert abs(press.stats["realised_ratio"] - 0.5) < 0.1


def test_launcher_registers_then_runs_evaluate(tmp_path, monkeypatch):
    """``python -m kvpress_prob.integrations.kvpress_eval ARGS`` from an evaluation/ folder: evaluate.py finds our name."""
    (tmp_path / "evaluate_registry.py").write_text(
        "from kvpress import SnapKVPress\nPRESS_REGISTRY = {'snapkv': SnapKVPress(), 'no_press': None}\n")
    (tmp_path / "evaluate.py").write_text(
        "import json\nfrom evaluate_registry import PRESS_REGISTRY\n"
        "class CliEntryPoint:\n"
        "    def __call__(self, press_name='knorm', compression_ratio=1.0, out='out.json'):\n"
        "        assert press_name in PRESS_REGISTRY, press_name\n"
        "        press = PRESS_REGISTRY[press_name]\n"
        "        press.compression_ratio = compression_ratio\n"
        "        json.dump({'type': type(press).__name__, 'ratio': press.compression_ratio}, open(out, 'w'))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for module in ("evaluate", "evaluate_registry"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    try:
        main(["--press_name", "prob_min_h", "--compression_ratio", "0.25", "--out", str(tmp_path / "r.json")])
    finally:
        for module in ("evaluate", "evaluate_registry"):
            sys.modules.pop(module, None)
    assert json.loads((tmp_path / "r.json").read_text()) == {"type": "SamplingPress", "ratio": 0.25}


def test_launcher_outside_an_evaluation_folder_says_where_to_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "evaluate_registry", raising=False)
    with pytest.raises(SystemExit, match="kvpress's evaluation/ folder"):
        main([])


#: A stand-in for kvpress's ``evaluation/evaluate.py`` (not in the kvpress wheel; nothing of it is
#: copied here): the steps of its ``EvaluationRunner`` for a press outside its special cases, written
#: against the installed kvpress: ``load_dataset(DATASET_REGISTRY[dataset], data_dir=..., split="test")``,
#: ``PRESS_REGISTRY[press_name]`` with ``compression_ratio`` set, ``str(press)`` saved as
#: ``press_init_command``, the "kv-press-text-generation" pipeline once per context with all its
#: questions, then predictions.csv, metrics.json and config.yaml in a results folder.
EVALUATE_STAND_IN = '''
import json
from pathlib import Path

import yaml
from datasets import load_dataset
from transformers import pipeline

from evaluate_registry import DATASET_REGISTRY, PRESS_REGISTRY, SCORER_REGISTRY


class CliEntryPoint:
    def __call__(self, dataset="ruler", data_dir=None, model="", press_name="knorm", compression_ratio=1.0,
                 output_dir="./results", max_new_tokens=None):
        assert dataset in DATASET_REGISTRY and press_name in PRESS_REGISTRY, (dataset, press_name)
        press = PRESS_REGISTRY[press_name]
        press.compression_ratio = compression_ratio
        config = dict(dataset=dataset, data_dir=str(data_dir), model=model, press_name=press_name,
                      compression_ratio=compression_ratio, press_init_command=str(press))
        pipe = pipeline("kv-press-text-generation", model=model, device="cpu")
        df = load_dataset(DATASET_REGISTRY[dataset], data_dir=str(data_dir), split="test").to_pandas()
        df["predicted_answer"] = None
        for context, group in df.groupby("context"):
            output = pipe(context, questions=group["question"].to_list(), answer_prefix=group["answer_prefix"].iloc[0],
                          press=press, max_new_tokens=max_new_tokens or int(group["max_new_tokens"].iloc[0]))
            df.loc[group.index, "predicted_answer"] = output["answers"]
        out = Path(output_dir) / "__".join([dataset, str(data_dir), press_name, f"{compression_ratio:.2f}"])
        out.mkdir(parents=True, exist_ok=True)
        df.drop(columns=["context"]).to_csv(out / "predictions.csv", index=False)
        json.dump(SCORER_REGISTRY[dataset](df), open(out / "metrics.json", "w"))
        yaml.dump(config, open(out / "config.yaml", "w"))
'''


def test_launcher_runs_kvpress_evaluation_end_to_end_on_a_local_dataset(tmp_path, monkeypatch, tokenizer):
    """``python -m kvpress_prob.integrations.kvpress_eval`` from an evaluation/ folder, on a local dataset in kvpress's
    format (columns context, question, answer_prefix, answer, max_new_tokens, task; a data_dir holding
    a test split) and a tiny model saved to disk: every question is answered by our press, which evicted
    at the ratio evaluate.py set on the registered instance, and the saved config names it."""
    import pandas as pd
    import yaml

    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "ruler-local" / "1024"
    data.mkdir(parents=True)
    contexts = [" ".join(f"item {i} is {(i * k) % 13}." for i in range(40)) for k in (3, 7)]
    pd.DataFrame([dict(context=c, question=f"What is item {q}?", answer_prefix="Answer:", answer=[str(q)],
                       max_new_tokens=3, task="niah_single_1") for c in contexts for q in (2, 5)]
                 ).to_parquet(data / "test-00000.parquet")
    folder = tmp_path / "evaluation"
    folder.mkdir()
    (folder / "evaluate_registry.py").write_text(
        "from kvpress import SnapKVPress\n"
        f"DATASET_REGISTRY = {{'ruler': {str(tmp_path / 'ruler-local')!r}}}\n"
        "SCORER_REGISTRY = {'ruler': lambda df: {'n': len(df)}}\n"
        "PRESS_REGISTRY = {'snapkv': SnapKVPress(), 'no_press': None}\n")
    (folder / "evaluate.py").write_text(EVALUATE_STAND_IN)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for module in ("evaluate", "evaluate_registry"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    try:
        main(["--dataset", "ruler", "--data_dir", "1024", "--model", str(model_dir), "--press_name", "prob_min_h",
              "--compression_ratio", "0.5", "--output_dir", str(tmp_path / "results")])
        press = sys.modules["evaluate_registry"].PRESS_REGISTRY["prob_min_h"]
    finally:
        for module in ("evaluate", "evaluate_registry"):
            sys.modules.pop(module, None)
    assert isinstance(press, SamplingPress) and press.stats["target_ratio"] == 0.5
    assert abs(press.stats["realised_ratio"] - 0.5) < 0.1  # it evicted, in evaluate.py's pipeline
    (results,) = (tmp_path / "results").iterdir()
    predictions = pd.read_csv(results / "predictions.csv")
    assert len(predictions) == 4 and predictions["predicted_answer"].notna().all()
    config = yaml.safe_load((results / "config.yaml").read_text())
    assert config["press_name"] == "prob_min_h" and "compression_ratio=0.5" in config["press_init_command"]
    assert json.loads((results / "metrics.json").read_text()) == {"n": 4}
