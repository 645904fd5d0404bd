"""Fast KVzip's gates (kvpress_prob/presses/gate.py, gate_store.py, kvpress_prob/learned/): kvpress's
FastKVzipPress scores, the widest allocation's kept set with real eviction at kvpress's count, compression under
model.generate, a deterministic trainer cached outside the repository, and refusals."""

import copy

import pytest
import torch
from kvpress.presses.fastkvzip_press import FastKVzipGate, FastKVzipPress
from kvpress.utils import compute_n_kept
from transformers import DynamicCache

from kvpress_prob.learned import labels as lb
from kvpress_prob.learned import training as tr
from kvpress_prob.names.registry import get_press
from kvpress_prob.presses import artefacts as af
from kvpress_prob.presses import gate_store as gs
from kvpress_prob.presses.allocations import allocation_keep
from kvpress_prob.presses.gate import GatePress
from kvpress_prob.presses.sampling import language_model
from tests.conftest import random_ids, tiny_model


def random_gates(model, seed: int = 3, dtype=torch.float32) -> list[FastKVzipGate]:
    """kvpress's own gates for ``model``, every parameter random (a fresh gate has zero sink keys and bias)."""
    config = model.config
    heads = config.num_key_value_heads
    torch.manual_seed(seed)
    gates = [FastKVzipGate(i, config.hidden_size, heads, config.num_attention_heads // heads, dtype)
             for i in range(config.num_hidden_layers)]
    with torch.no_grad():
        for g in gates:
            g.k_base.normal_()
            g.b.normal_()
            g.q_norm.weight.uniform_(0.5, 1.5)
    return gates


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_scores_are_fastkvzip_press_scores_from_its_own_gates(arch):
    model, n = tiny_model(arch), 96
    ids = random_ids(n, seed=5)
    gates = random_gates(model)
    reference = FastKVzipPress(compression_ratio=0.0)
    reference.gates = gates  # FastKVzipPress loads from the hub only; its gates attribute is what it scores with
    with reference(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    theirs = reference.score_val  # (L, 1, H, n): their sinks and last window set to 1
    window = max(1, int(n * reference.window_ratio))
    states = [{k: v.clone() for k, v in g.state_dict().items()} for g in gates]
    for given in (gates, states):  # modules, and FastKVzipPress's file format (per-layer state dicts)
        press = GatePress(compression_ratio=0.5, gates=given)
        captured = {}
        for layer in language_model(model).layers:  # the press's own scores at each hook
            layer.self_attn.register_forward_hook(
                lambda m, a, k, o: captured.__setitem__(m.layer_idx, press.gate_scores(m.layer_idx, k["hidden_states"])),
                with_kwargs=True)
        with press(model):
            model.model(input_ids=ids, past_key_values=DynamicCache())
        for layer in language_model(model).layers:
            layer.self_attn._forward_hooks.clear()
        ours = torch.stack([captured[i] for i in range(len(captured))])
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours[..., 4:-window], theirs[..., 4:-window].float(), rtol=1e-6, atol=1e-7)
        assert ours.std() > 1e-3  # the scores rank something


def _length(layer) -> int:
    return 0 if layer.keys is None else layer.keys.shape[2]  # a layer not yet filled (the prefill's own forward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_widest_kept_set_and_kvpress_count_under_generate(dtype):
    model, n, ratio = tiny_model("llama", dtype=dtype), 80, 0.75
    ids = random_ids(n, seed=7)
    gates = random_gates(model)
    inputs = lb.attention_inputs(model, ids)  # the reference: the gates on an independent plain prefill
    expected = allocation_keep(GatePress(gates=gates).pinned(tr.gate_scores(gates, inputs)[:, None]), ratio, "widest")
    press = GatePress(compression_ratio=ratio, gates=gates)
    seen = []
    handle = language_model(model).layers[1].self_attn.register_forward_pre_hook(
        lambda m, a, k: seen.append((k["hidden_states"].shape[1], _length(k["past_key_values"].layers[1]))),
        with_kwargs=True)
    try:
        with press(model):
            out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                                 pad_token_id=2)
    finally:
        handle.remove()
    L = model.config.num_hidden_layers
    assert press.kept == expected.sum(-1)[:, 0].tolist()  # every head keeps the widest allocation's set
    stored = [layer.keys.shape[2] - 2 for layer in out.past_key_values.layers]  # less the decoded tokens
    assert sum(stored) <= L * compute_n_kept(n, ratio) < L * n  # kvpress's count, summed over layers
    decode_lengths = [cached for q_len, cached in seen[1:] if q_len == 1]
    assert decode_lengths and all(c < n for c in decode_lengths)  # decoding forwards see the compressed cache
    assert (expected[..., :4]).all()  # the sinks are kept


def test_trainer_is_deterministic_and_names_its_gate_by_its_settings(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=2)
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))  # after the model: its tokenizer stays where it was converted
    contexts = [random_ids(48, seed=s) for s in (1, 2)]
    settings = gs.TrainSettings(steps=12, batch_size=32)
    labels = [lb.kvzip_labels(model, c) for c in contexts]
    assert all(s.shape == (2, 2, 48) and 0 <= s.min() and s.max() <= 1 for s, _ in labels)
    inputs = [lb.attention_inputs(model, c) for c in contexts]
    first, record = tr.train_gates(model, inputs, labels, settings)
    second, _ = tr.train_gates(model, inputs, labels, settings)
    for a, b in zip(first, second):
        for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(va, vb), k
    fresh = tr.new_gates(model, settings)
    assert any(not torch.equal(a.q_proj.weight, f.q_proj.weight) for a, f in zip(first, fresh))  # it trained
    assert record["tokens"] == 2 * (48 - max(settings.n_sink, labels[0][1]))

    path, meta = tr.fit(model, contexts, "two", settings, progress=False)
    assert path == af.model_dir(model) / f"{gs.gate_name('two', settings)}.safetensors" and "steps12-batch32" in path.name
    assert meta["corpus"] == "two" and meta["contexts"] == 2
    loaded = gs.load_gates(path)
    assert all(torch.equal(a.q_proj.weight, b.q_proj.weight) for a, b in zip(loaded, first))  # same data, same gate
    assert tr.fit(model, contexts, "two", settings)[0] == path and len(list(path.parent.glob("*.safetensors"))) == 1
    with pytest.raises(ValueError, match="other contexts"):  # one name, one corpus
        tr.fit(model, contexts[:1], "two", settings)
    for dtype in (torch.bfloat16, torch.float16):  # the same model in the dtypes users run: the same gate
        cast = copy.deepcopy(model).to(dtype)
        assert af.model_key(cast) == af.model_key(model)
        with torch.no_grad(), GatePress(compression_ratio=0.5, gate=path.stem)(cast):
            cast.model(input_ids=contexts[0], past_key_values=DynamicCache())


def test_kept_recall_counts_the_intersection():
    torch.manual_seed(0)
    scores = torch.rand(3, 2, 50)
    both, kept = tr.kept_recall(scores, scores, 0.75)
    assert both == kept > 0
    both, kept = tr.kept_recall(-scores, scores, 0.75)  # the reversed ranking keeps only the pinned sinks in common
    assert both <= 3 * 2 * 4 < kept


def test_refusals_and_the_name(tmp_path, monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))  # after the model: its tokenizer stays where it was converted
    assert isinstance(get_press("topk_gate_widest", 0.75), GatePress)
    with pytest.raises(ValueError, match="compression_ratio"):
        GatePress(compression_ratio=1.0)
    with pytest.raises(ValueError, match="one gate per layer"):
        with GatePress(compression_ratio=0.5, gates=random_gates(model)[:2])(model):
            pass
    with pytest.raises(FileNotFoundError, match="kvprob train-gate.*minutes"):  # no default gate: how, and how long
        with GatePress(compression_ratio=0.5)(model):
            pass
    with pytest.raises(ValueError, match="not both"):
        GatePress(gate="a", gates=random_gates(model))
    press = GatePress(compression_ratio=0.5, gates=random_gates(model))
    with pytest.raises(ValueError, match="batch size 1"):
        with press(model):
            model.model(input_ids=torch.cat([random_ids(16)] * 2), past_key_values=DynamicCache())
