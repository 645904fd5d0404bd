"""The embedded model's default gate, shipped as package data (kvpress_prob/learned/artefacts/): RECOMMENDED_FAST
runs on a fresh install with an empty cache, in kvpress's pipeline (as its evaluate.py builds it) and under
model.generate; the 16-bit copy keeps the float32 gate's kept sets; a gate of another model, or of other shapes,
refuses to load."""

from dataclasses import asdict

import pytest
import torch
from kvpress import KVPressTextGenerationPipeline
from kvpress.utils import compute_n_kept
from transformers import DynamicCache

from kvpress_prob.integrations.kvpress_eval import register
from kvpress_prob.learned import package
from kvpress_prob.learned import training as tr
from kvpress_prob.cache import held_counts
from kvpress_prob.names.registry import RECOMMENDED_FAST, get_press
from kvpress_prob.presses import artefacts as af
from kvpress_prob.presses import gate_store as gs
from kvpress_prob.presses.gate import GatePress
from kvpress_prob.presses.sampling import language_model
from tests.conftest import random_ids, tiny_model
from tests.test_kvpress_eval import evaluate_setup_press

CONTEXT = " ".join(f"The code of room {i} is {i * 37 % 101}." for i in range(40))


@pytest.fixture(scope="module")
def embedded():
    from kvpress_prob.models import load_model

    return load_model(device="cpu", dtype=torch.float32)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty user cache, as on a fresh install (the model, already converted, is loaded before)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path


def shipped(model):
    """The package's file of the model's default gate."""
    path = af.PACKAGE_DIR / af.model_key(model) / f"{gs.DEFAULT_GATE}{gs.SUFFIX}"
    assert path.is_file(), f"the embedded model's default gate is not shipped: {path}"
    return path


def test_the_shipped_gate_records_what_made_it(embedded):
    model, _ = embedded
    tensors, meta = af.read(shipped(model))
    assert meta["model_key"] == af.model_key(model) and meta["shapes"] == af.shapes(model)
    assert meta["corpus"] == gs.DEFAULT_CORPUS and meta["settings"] == asdict(gs.TrainSettings())
    assert meta["command"].startswith("python -m evaluation train-gate") and "--package" in meta["package_command"]
    assert len(meta["context_digests"]) == meta["contexts"] == 30
    assert {v.dtype for k, v in tensors.items() if k[0].isdigit()} == {package.PACKAGE_DTYPE}
    assert sum(p.stat().st_size for p in af.PACKAGE_DIR.rglob("*.safetensors")) <= 8 * 2**20


def test_recommended_fast_runs_on_a_fresh_install(embedded, fresh):
    model, tokenizer = embedded
    registry = {}
    register(registry)
    press = evaluate_setup_press(registry, RECOMMENDED_FAST, 0.5)  # as kvpress's evaluate.py builds it
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    with torch.no_grad():
        out = pipe(CONTEXT, question="What is the code of room 7?", press=press, max_new_tokens=4)
    assert isinstance(out["answer"], str) and press.gate_used == gs.DEFAULT_GATE
    assert not list(fresh.rglob("*.safetensors")) and not list(fresh.rglob("*.pt"))  # nothing trained, nothing cached

    ids = tokenizer(CONTEXT, return_tensors="pt").input_ids
    n, L = ids.shape[1], model.config.num_hidden_layers
    generated = get_press(RECOMMENDED_FAST, 0.5)
    seen = []
    handle = language_model(model).layers[1].self_attn.register_forward_pre_hook(
        lambda m, a, k: seen.append((k["hidden_states"].shape[1], sum(held_counts(k["past_key_values"].layers[1]))
                                     if k["past_key_values"].layers[1].keys is not None else 0)), with_kwargs=True)
    try:
        with torch.no_grad(), generated(model):
            result = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                                    pad_token_id=tokenizer.pad_token_id)
    finally:
        handle.remove()
    assert generated.gate_used == gs.DEFAULT_GATE and result.sequences.shape[1] == n + 3
    H = model.config.num_key_value_heads
    held = sum(c - 2 for layer in result.past_key_values.layers for c in held_counts(layer))  # less 2 decoded tokens
    assert held == L * H * compute_n_kept(n, 0.5)  # snapkv's total, evicted with no training
    decoding = [cached for q_len, cached in seen[1:] if q_len == 1]
    assert decoding and all(c < H * n for c in decoding)  # decoding reads the compressed cache (all heads' entries)


def test_the_16_bit_copy_keeps_the_float32_gates_kept_sets(embedded):
    """The file's check: a held-out development context and the float32 gate's kept sets of it (widest allocation
    at 0.5 / 0.75 / 0.9), recomputed here from the stored 16-bit weights."""
    model, _ = embedded
    tensors, meta = af.read(shipped(model))
    check = meta["check"]
    ids = tensors["check.ids"].long()
    reference = package.unpack(tensors["check.kept"], tuple(check["shape"]))
    assert reference.shape[1:] == (model.config.num_hidden_layers, model.config.num_key_value_heads, ids.shape[1])
    gates = gs.load_gates(shipped(model))
    here = package.kept_sets(model, gates, ids, check["n_sink"])
    shares = package.agreement(reference, here)
    assert min(shares) >= 0.99, shares
    other = package.kept_sets(model, tr.new_gates(model, gs.TrainSettings(seed=1)), ids, check["n_sink"])
    assert max(package.agreement(reference, other)) < 0.95  # the check tells a gate from another


def test_pack_and_the_stored_rounding():
    mask = torch.rand(3, 5, 13, generator=torch.Generator().manual_seed(0)) > 0.5
    bits = package.pack(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-mask.numel() // 8)
    assert torch.equal(package.unpack(bits, tuple(mask.shape)), mask)
    model = tiny_model("llama", layers=2)
    gates = tr.new_gates(model, gs.TrainSettings())
    rounded = package.stored(gates)
    assert all(g.q_proj.weight.dtype == torch.float32 for g in rounded)
    for a, b in zip(gates, rounded):
        assert torch.equal(b.q_proj.weight, a.q_proj.weight.to(package.PACKAGE_DTYPE).float())
        assert not torch.equal(b.q_proj.weight, a.q_proj.weight)  # rounded, not the float32 weights


def test_a_gate_of_another_model_or_shape_refuses_to_load(tmp_path, monkeypatch, embedded):
    model, other, more_heads = (tiny_model("llama", layers=2) for _ in range(3))  # before the cache moves: no
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))  # second conversion of the embedded model into tmp_path
    path, _ = tr.fit(model, [random_ids(40, seed=1)], "one", gs.TrainSettings(steps=3, batch_size=16), progress=False)
    ids = random_ids(32, seed=2)
    with GatePress(compression_ratio=0.5, gate=str(path))(model):  # its own model loads it
        model.model(input_ids=ids, past_key_values=DynamicCache())
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.neg_()  # same shapes, other weights: another model
    assert af.shapes(other) == af.shapes(model) and af.model_key(other) != af.model_key(model)
    with pytest.raises(ValueError, match="trained for the model .*not this one"):  # passed by path
        with GatePress(compression_ratio=0.5, gate=str(path))(other):
            pass
    with pytest.raises(FileNotFoundError, match="kvprob train-gate"):  # by name: not in the other model's folder
        with GatePress(compression_ratio=0.5, gate=path.stem)(other):
            pass
    more_heads.config.num_key_value_heads = 4  # the shapes the metadata records, checked before the weights
    with pytest.raises(ValueError, match="num_key_value_heads 2 \\(this model: 4\\)"):
        af.check_model(more_heads, af.read_meta(path), path, "gate")
    embedded_model, _ = embedded  # the shipped gate on a tiny model: other shapes
    with pytest.raises(ValueError, match="does not fit this model"):
        with GatePress(compression_ratio=0.5, gate=str(shipped(embedded_model)))(model):
            pass
    unchecked = tmp_path / "no-key.safetensors"  # a gate file that names no model is refused too
    af.save(unchecked, gs.state_dicts(gs.load_gates(path)), {"kind": "gate"})
    with pytest.raises(ValueError, match="records no model_key"):
        with GatePress(compression_ratio=0.5, gate=str(unchecked))(model):
            pass
