"""A new sampling design and a new proposal, defined in this file alone and registered by name, run
through get_press, the runner and the fidelity bench with no other change anywhere."""

from dataclasses import dataclass

import pandas as pd
import pytest
import torch
from conftest import TIE, boundary_gap, random_ids, tiny_model
from kvpress import KVPressTextGenerationPipeline

from evaluation.bench.fidelity import measure as fidelity
from evaluation.engine import Prefill
from evaluation.engine.runner import Config, run
from evaluation.store.results import ResultStore
from kvpress_prob import SamplingPress, get_press
from kvpress_prob.names import registry
from kvpress_prob.proposals.base import Proposal
from kvpress_prob.samplers import Draw, Sampler


@dataclass(kw_only=True)
class KeepLargest(Sampler):
    """Toy design: every head keeps exactly its round((1 - r) n) entries of largest pi, weight 1."""

    random = False

    def __call__(self, pi, compression_ratio, scope, generator) -> Draw:
        n = pi.shape[-1]
        k = round((1.0 - compression_ratio) * n)
        top = pi.topk(k, dim=-1).indices
        keep = torch.zeros_like(pi, dtype=torch.bool).scatter_(-1, top, True)
        return Draw(keep=keep, log_weight=torch.where(keep, 0.0, float("-inf")).float(), stats={"k": k})


@dataclass(kw_only=True)
class Recency(Proposal):
    """Toy proposal: weight i + 1 for position i (later tokens are more likely)."""

    def weights(self, module, hidden_states, keys, values, kwargs):
        n = keys.shape[2]
        return torch.arange(1, n + 1, dtype=torch.float32, device=keys.device).expand(*keys.shape[:2], n)


def kept_count(n: int, ratio: float) -> int:
    return round((1.0 - ratio) * n)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(registry.SAMPLERS, "keep_largest", KeepLargest)
    monkeypatch.setitem(registry.PRESSES, "toy_recency",
                        lambda r: SamplingPress(proposal=Recency(), sampler=KeepLargest(), compression_ratio=r))


def test_get_press_builds_the_toys_by_name(registered):
    press = get_press("toy_recency", 0.25, floor=0.1, seed=3)
    assert isinstance(press.proposal, Recency) and press.proposal.floor == 0.1
    assert isinstance(press.sampler, KeepLargest) and press.seed == 3
    mixed = get_press("prob_knorm", 0.5, sampler="keep_largest")  # a registry proposal with the toy design
    assert isinstance(mixed.sampler, KeepLargest) and not registry.is_sampling("prob_knorm", sampler="keep_largest")
    with pytest.raises(ValueError, match="unknown sampler"):
        get_press("prob_knorm", 0.5, sampler="nope")


def test_toy_sampler_keeps_what_it_should(registered):
    """Through the engine: recency + keep-largest keeps the last k positions of every head; the toy
    design over the K-norm proposal keeps the k smallest key norms, kvpress KnormPress's set."""
    model = tiny_model("llama")
    n, ratio = 90, 0.4
    k = kept_count(n, ratio)
    shared = Prefill(model, random_ids(n, seed=3))
    press = get_press("toy_recency", ratio)
    cache = shared.compress(press)
    keep = press.last_draw.keep  # (L, 1, H, n)
    assert keep[..., n - k:].all() and not keep[..., : n - k].any()
    assert press.stats["realised_ratio"] == pytest.approx(1 - k / n)
    assert all(layer.keys.shape[2] == k for layer in cache.layers)
    torch.testing.assert_close(cache.layers[1].keys, shared.keys[1][:, :, n - k:])  # the last k, in order

    press = get_press("prob_knorm", ratio, sampler="keep_largest")
    shared.compress(press)
    for layer in range(3):
        norms = shared.keys[layer][0].norm(dim=-1)  # (H, n)
        # the smallest k norms are a set only where the k-th and (k+1)-th differ beyond float error (the tiny
        # Llama has no k-norm, its key norms spread; a Qwen3 with unit k-norm gains would give 4 +- 4e-5)
        assert bool((boundary_gap(-norms, k) > TIE).all()), (layer, boundary_gap(-norms, k))
        expected = torch.zeros_like(norms, dtype=torch.bool).scatter_(-1, norms.topk(k, largest=False).indices, True)
        assert torch.equal(press.last_draw.keep[layer, 0], expected)


def test_runner_stores_the_toys_realised_ratio(registered, tmp_path, tokenizer):
    model = tiny_model("qwen3")
    model.generation_config.eos_token_id = 2
    rows = [dict(example_id=f"ex-{i}", task="niah_single_1", context=" ".join(f"w{j}x{i}" for j in range(60 + 7 * i)),
                 question="What?", answer_prefix="Answer:", answer=["w1"], max_new_tokens=4, context_tokens=0)
            for i in range(2)]
    configs = [Config("toy_recency", 0.5, 0), Config("prob_knorm", 0.75, 0, (("sampler", "keep_largest"),))]
    store = ResultStore(tmp_path / "r.jsonl")
    written = run(model, tokenizer, pd.DataFrame(rows), configs, store, model_name="tiny", dataset="ruler",
                  data_dir="x", decode_batch=2, progress=False)
    assert written == 4
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    records = store.load().set_index(["example_id", "press"])
    for row in rows:
        n = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], 10**9)["context_ids"].shape[1]
        toy = records.loc[(row["example_id"], "toy_recency")]
        mixed = records.loc[(row["example_id"], "prob_knorm[sampler=keep_largest]")]
        assert toy.realised_ratio == pytest.approx(1 - kept_count(n, 0.5) / n, abs=1e-12)
        assert mixed.realised_ratio == pytest.approx(1 - kept_count(n, 0.75) / n, abs=1e-12)
        assert toy.kv_bytes == 3 * 2 * 2 * kept_count(n, 0.5) * 16 * 4  # layers x (K, V) x heads x k x d x fp32
        assert toy.seed == 0 and isinstance(toy.prediction, str)


def test_fidelity_bench_measures_the_toys(registered):
    model = tiny_model("llama")
    n, cont = 100, random_ids(10, seed=4)
    shared = Prefill(model, random_ids(n, seed=5))
    reference = fidelity.reference_of(model, shared, cont, 4)
    main, _ = fidelity.build_configs(["toy_recency", "snapkv"], [0.5], scopes=["head"])
    assert [c.label for c in main] == ["toy_recency", "snapkv"]  # deterministic: no scope variants, one seed
    assert fidelity.seeds_for(main[0], [0, 1, 2]) == [0]
    res = fidelity.evaluate_config(model, shared, main[0], [0], cont, 4, reference)
    assert res["realised_ratio"] == [pytest.approx(1 - kept_count(n, 0.5) / n)]
    assert res["kl"][0] > 0 and res["m"] is None  # no m: the toy design has none
    full = fidelity.evaluate_config(model, shared, fidelity.setting("toy_recency", 0.0), [0], cont, 4, reference)
    assert full["kl"] == [0.0]
