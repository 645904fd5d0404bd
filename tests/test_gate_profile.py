"""The per-head budget profile (kvpress_prob/presses/budget_profile.py, learned by kvpress_prob/learned/profile.py) and the press applying it in each layer's hook
(kvpress_prob/presses/gate_profile.py): counts against an exact budget and an explicit largest remainder; each
layer a RaggedLayer of its kept entries when the next layer starts; the kept set against an explicit ranking;
logits against a float64 dense reference on the kept entries; refusals of another model's profile."""

import json
from fractions import Fraction

import pytest
import torch
from kvpress.utils import compute_n_kept

from evaluation.engine import Prefill, press_prefill, teacher_forced
from kvpress_prob.testing.reference import dense_reference, float64_copy
from kvpress_prob.cache import RaggedLayer
from kvpress_prob.learned.profile import fit_profile, save_profile
from kvpress_prob.presses.budget_profile import (Profile, largest_remainder, load_profile, profile_counts,
                                                 read_profile)
from kvpress_prob.names.registry import get_press
from kvpress_prob.learned import labels as lb, training as tr
from kvpress_prob.presses.gate_profile import ProfileGatePress
from kvpress_prob.proposals.attention import SampledMinVarianceProposal
from tests.conftest import random_ids, seen_before_each_layer, tiny_model
from tests.test_gate import random_gates
from tests.test_ragged_presses import _stored_exactly

N = 96


def skewed_profile(L: int, H: int, seed: int = 0, grid=(0.5, 0.75, 0.9)) -> Profile:
    """Shares far from uniform (one head holds about half the budget at the largest ratio)."""
    g = torch.Generator().manual_seed(seed)
    shares = torch.rand(len(grid), L, H, generator=g, dtype=torch.float64) ** 3
    shares[:, 0, 0] += torch.tensor(grid, dtype=torch.float64) * shares[:, 1:].sum((1, 2))
    return Profile(shares / shares.sum((1, 2), keepdim=True), tuple(grid), 4, {"model_key": "tiny"})


def explicit_counts(share: list[list[float]], total: int, floor: int) -> list[list[int]]:
    """Largest remainder in exact rationals, no caps: floor + floor(q), then +1 to the largest fractional parts."""
    flat = [Fraction(s) for row in share for s in row]
    quota = [s / sum(flat) * total for s in flat]
    counts = [int(q) for q in quota]
    order = sorted(range(len(flat)), key=lambda i: (-(quota[i] - int(quota[i])), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    H = len(share[0])
    return [[floor + c for c in counts[l * H:(l + 1) * H]] for l in range(len(share))]


@pytest.mark.parametrize("n", [1, 7, 96, 1000, 4096, 8191])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5, 0.6, 0.75, 0.83, 0.9, 0.99])
def test_counts_sum_exactly_to_snapkvs_total(n, ratio):
    profile = skewed_profile(30, 3)
    counts = profile_counts(profile, ratio, n)
    k = compute_n_kept(n, ratio)
    assert int(counts.sum()) == 30 * 3 * k
    assert int(counts.min()) >= min(4, k) and int(counts.max()) <= n


@pytest.mark.parametrize("ratio,n", [(0.5, 1024), (0.75, 1000), (0.9, 4096)])
def test_counts_are_the_largest_remainder_of_the_shares(ratio, n):
    g = torch.Generator().manual_seed(1)
    shares = torch.rand(3, 5, 3, generator=g, dtype=torch.float64) + 0.2
    profile = Profile(shares / shares.sum((1, 2), keepdim=True), (0.5, 0.75, 0.9))
    k = compute_n_kept(n, ratio)
    share = profile.share_at(ratio)
    assert (share * 5 * 3 * (k - 4) < n - 4).all()  # no cap binds here
    assert profile_counts(profile, ratio, n).tolist() == explicit_counts(share.tolist(), 5 * 3 * (k - 4), 4)


def test_caps_redistribute_and_shares_interpolate():
    weights = torch.tensor([[100.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    counts = largest_remainder(weights, 20, torch.full((2, 3), 6))
    assert counts.tolist() == [[6, 4, 4], [3, 3, 0]] and int(counts.sum()) == 20
    with pytest.raises(ValueError, match="caps"):
        largest_remainder(weights, 37, torch.full((2, 3), 6))
    profile = skewed_profile(4, 2)
    assert torch.allclose(profile.share_at(0.75), profile.shares[1] / profile.shares[1].sum())
    middle = (profile.shares[0] + profile.shares[1]) / 2
    assert torch.allclose(profile.share_at(0.625), middle / middle.sum())
    assert torch.allclose(profile.share_at(0.0), torch.full((4, 2), 1 / 8, dtype=torch.float64))
    assert torch.equal(profile.share_at(0.95), profile.share_at(0.9))


def test_fit_profile_is_kvzips_mean_global_share():
    g = torch.Generator().manual_seed(5)
    labels = [torch.rand(3, 2, 40, generator=g), torch.rand(3, 2, 50, generator=g)]
    profile = fit_profile(labels, (0.5, 0.8), n_sink=2)
    for i, ratio in enumerate((0.5, 0.8)):
        expected = torch.zeros(3, 2, dtype=torch.float64)
        for scores in labels:
            pinned = scores.clone()
            pinned[..., :2] = 2.0
            n = scores.shape[-1]
            total = 6 * compute_n_kept(n, ratio)
            ranked = pinned.flatten().argsort(descending=True)[:total]
            expected += torch.bincount(ranked // n, minlength=6).view(3, 2).double() / total / 2
        assert torch.allclose(profile.shares[i], expected)


def test_profile_file_round_trips_and_refuses_another_model(tmp_path):
    profile = skewed_profile(3, 2)
    path = tmp_path / "p.safetensors"
    save_profile(profile, path)
    back = read_profile(path)
    assert back.grid == profile.grid and back.n_sink == 4 and back.meta["model_key"] == "tiny"
    assert torch.allclose(back.shares, profile.shares.float().double())
    assert load_profile("tiny", (3, 2), path).grid == profile.grid
    with pytest.raises(ValueError, match="learned for the model"):
        load_profile("another", (3, 2), path)
    with pytest.raises(ValueError, match="KV heads"):
        load_profile("tiny", (3, 4), path)
    with pytest.raises(FileNotFoundError, match="no budget profile"):
        load_profile("tiny", (3, 2), tmp_path / "missing.safetensors")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="KV heads"):
        with ProfileGatePress(compression_ratio=0.5, gates=random_gates(model), profile=skewed_profile(3, 4))(model):
            pass


def expected_keep(scores: torch.Tensor, counts: torch.Tensor, n_sink: int, window: float) -> torch.Tensor:
    """(L, 1, H, n): per head, its sinks, its int(window * count) latest, then the highest scores (float64, one by
    one), cut at its count."""
    L, H, n = scores.shape
    keep = torch.zeros(L, 1, H, n, dtype=torch.bool)
    for l in range(L):
        for h in range(H):
            c = int(counts[l, h])
            recent = int(window * c)
            first = list(range(min(n_sink, n))) + [i for i in range(n - 1, n - 1 - recent, -1) if i >= n_sink]
            rest = sorted(set(range(n)) - set(first), key=lambda i: (-float(scores[l, h, i].double()), i))
            keep[l, 0, h, (first + rest)[:c]] = True
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,ratio", [(0.0, 0.5), (0.1, 0.75), (0.25, 0.9)])
def test_each_head_keeps_its_profile_count_of_sinks_window_and_gate_top(dtype, window, ratio):
    model = tiny_model("llama", dtype=dtype)
    ids = random_ids(N, seed=31)
    gates = random_gates(model)
    profile = skewed_profile(3, 2, seed=2)
    scores = tr.gate_scores(gates, lb.attention_inputs(model, ids))  # an independent plain prefill
    counts = profile_counts(profile, ratio, N)
    press = ProfileGatePress(compression_ratio=ratio, gates=gates, window=window, profile=profile)
    cache = press_prefill(model, ids, press)
    assert [list(layer.lengths) for layer in cache.layers] == counts.tolist() == press.kept
    assert len(set(counts.flatten().tolist())) > 1
    _stored_exactly(cache, press_prefill(model, ids, None), expected_keep(scores, counts, 4, window))


def fill_keep(gate: torch.Tensor, fill: torch.Tensor, counts: torch.Tensor, n_sink: int, share: float) -> torch.Tensor:
    """(L, 1, H, n): per head, its sinks and then the gate's top (float64, one by one) for count - floor(share *
    count), then the fill's top among the rest for floor(share * count)."""
    L, H, n = gate.shape
    keep = expected_keep(gate, counts - (share * counts.double()).floor().long(), n_sink, 0.0)
    for l in range(L):
        for h in range(H):
            rest = sorted((i for i in range(n) if not keep[l, 0, h, i]), key=lambda i: (-float(fill[l, h, i].double()), i))
            keep[l, 0, h, rest[: int(share * int(counts[l, h]))]] = True
    return keep


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen3", torch.float32)])
@pytest.mark.parametrize("share,ratio", [(0.5, 0.5), (0.25, 0.75), (0.75, 0.9)])
def test_the_fill_keeps_its_share_as_its_top_outside_the_gates_top(arch, dtype, share, ratio):
    """The fill (pi_min-h from 16 sampled rows, the proposal recomputed independently on a plain prefill's cache)
    takes floor(share * count) of each head's count; the gate keeps the rest; in the hooks and in the engine's shared
    prefill alike; on Llama (fp32, bf16) and Qwen3 (its query and key norms)."""
    model = tiny_model(arch, dtype=dtype)
    ids, gates, profile = random_ids(N, seed=41), random_gates(model), skewed_profile(3, 2, seed=8)
    scores = tr.gate_scores(gates, lb.attention_inputs(model, ids))
    fill = SampledMinVarianceProposal(query_rows=16, row_seed=3)
    plain = press_prefill(model, ids, None)
    fills = torch.stack([fill_of(model, plain, fill, ids, l)[0] for l in range(3)])  # (L, H, n)
    counts = profile_counts(profile, ratio, N)
    press = ProfileGatePress(compression_ratio=ratio, gates=gates, profile=profile, fill=fill, fill_share=share)
    keep = fill_keep(scores, fills, counts, 4, share)
    gate_only = expected_keep(scores, counts, 4, 0.0)
    assert (keep != gate_only).any()  # the fill changes what is kept
    cache = press_prefill(model, ids, press)
    assert [list(layer.lengths) for layer in cache.layers] == counts.tolist() == press.kept
    _stored_exactly(cache, plain, keep)
    _stored_exactly(Prefill(model, ids, [press]).compress(press), plain, keep)


def fill_of(model, cache, fill, ids, layer_idx):
    """The fill's scores (1, H, n) of layer ``layer_idx`` from the plain prefill's cache and attention input."""
    module = model.model.layers[layer_idx].self_attn
    hidden = lb.attention_inputs(model, ids)[layer_idx][None].to(model.dtype)
    positions = torch.arange(ids.shape[1])[None]
    kwargs = {"position_embeddings": model.model.rotary_emb(hidden, positions)}
    layer = cache.layers[layer_idx]
    return fill(module, hidden, layer.keys, layer.values, kwargs)


def test_the_fill_refuses_a_layer_scope_a_share_out_of_range_and_a_non_proposal():
    with pytest.raises(ValueError, match="fill_share"):
        ProfileGatePress(compression_ratio=0.5, fill_share=1.5)
    with pytest.raises(ValueError, match="scope"):
        ProfileGatePress(compression_ratio=0.5, scope="layer", fill=SampledMinVarianceProposal(query_rows=4))
    with pytest.raises(TypeError, match="Proposal"):
        ProfileGatePress(compression_ratio=0.5, fill="snapkv")
    press = get_press("topk_gate_profile_a25_minh256_ragged", 0.5)
    assert press.fill_share == 0.75 and press.fill.query_rows == 256


def test_layer_scope_keeps_each_layers_total_as_the_top_over_its_heads():
    model, ratio = tiny_model("llama"), 0.75
    ids, gates, profile = random_ids(N, seed=35), random_gates(model), skewed_profile(3, 2, seed=7)
    scores = tr.gate_scores(gates, lb.attention_inputs(model, ids))
    totals = profile_counts(profile, ratio, N).sum(-1)
    press = ProfileGatePress(compression_ratio=ratio, gates=gates, profile=profile, scope="layer")
    cache = press_prefill(model, ids, press)
    keep = torch.zeros(3, 1, 2, N, dtype=torch.bool)
    for l in range(3):  # the sinks of both heads, then the layer's highest scores, one at a time
        entries = [(h, i) for h in range(2) for i in range(4)]
        rest = sorted(((h, i) for h in range(2) for i in range(4, N)),
                      key=lambda e: (-float(scores[l, e[0], e[1]].double()), e[0], e[1]))
        for h, i in (entries + rest)[: int(totals[l])]:
            keep[l, 0, h, i] = True
    assert [sum(layer.lengths) for layer in cache.layers] == totals.tolist()
    _stored_exactly(cache, press_prefill(model, ids, None), keep)
    with pytest.raises(ValueError, match="scope"):
        ProfileGatePress(compression_ratio=0.5, scope="model")


def test_each_layer_is_ragged_when_the_next_layer_starts():
    """When layer l + 1 starts its attention, layers 0..l are RaggedLayers holding exactly their profile counts: no
    full K+V outlives its hook."""
    model, ratio = tiny_model("qwen3", layers=4), 0.75
    profile = skewed_profile(4, 2, seed=3)
    press = ProfileGatePress(compression_ratio=ratio, gates=random_gates(model), profile=profile)
    seen = seen_before_each_layer(model, press, random_ids(N, seed=2), lambda cache_layers, i: [
        (type(c).__name__, list(c.lengths) if isinstance(c, RaggedLayer) else c.keys.shape[2])
        for c in cache_layers[:i]])
    counts = profile_counts(profile, ratio, N).tolist()
    for layer_idx in range(1, 4):
        assert seen[layer_idx] == [("RaggedLayer", counts[i]) for i in range(layer_idx)]


def test_logits_match_a_float64_dense_reference_on_the_kept_entries():
    model, ratio = tiny_model("qwen3"), 0.75
    model64 = float64_copy(model)
    ids, fed = random_ids(N, seed=33), random_ids(5, seed=34)
    gates, profile = random_gates(model), skewed_profile(3, 2, seed=4)
    press = ProfileGatePress(compression_ratio=ratio, gates=gates, window=0.1, profile=profile)
    cache = press_prefill(model, ids, press)
    keep = expected_keep(tr.gate_scores(gates, lb.attention_inputs(model, ids)), profile_counts(profile, ratio, N),
                         4, 0.1)
    got, _ = teacher_forced(model, cache, fed, N)
    reference = dense_reference(model64, ids, fed, keep).float()
    full = dense_reference(model64, ids, fed, None).float()
    assert (full - reference).abs().max() > 1e-2  # the evicted entries matter
    assert (got - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_engine_shared_prefill_matches_the_press_and_names_read_back():
    model = tiny_model("llama")
    ids, gates, profile = random_ids(N, seed=4), random_gates(model), skewed_profile(3, 2, seed=6)
    presses = [ProfileGatePress(compression_ratio=r, gates=gates, profile=profile) for r in (0.5, 0.9)]
    shared = Prefill(model, ids, presses)
    for press in presses:
        ours = shared.compress(press)
        theirs = press_prefill(model, ids, ProfileGatePress(compression_ratio=press.compression_ratio, gates=gates,
                                                            profile=profile))
        assert shared.prefills == 1
        assert [list(a.lengths) for a in ours.layers] == [list(b.lengths) for b in theirs.layers]
        for a, b in zip(ours.layers, theirs.layers):
            assert torch.equal(a.flat_keys, b.flat_keys) and torch.equal(a.flat_values, b.flat_values)
    press = get_press("topk_gate_profile_ragged", 0.5)
    assert isinstance(press, ProfileGatePress) and press.window == 0.0
    assert get_press("topk_gate_profile_recent10_ragged", 0.5).window == 0.1
    assert get_press("topk_gate_profile_layers_ragged", 0.5).scope == "layer"
    with pytest.raises(ValueError, match="window"):
        ProfileGatePress(compression_ratio=0.5, window=2.0)


def test_the_shipped_profile_names_its_model_and_sums_exactly():
    from kvpress_prob.presses.artefacts import PACKAGE_DIR
    from kvpress_prob.presses.budget_profile import profile_path

    files = sorted(PACKAGE_DIR.glob("*/profile.safetensors"))
    assert files  # the embedded model's profile is package data
    for path in files:
        key = path.parent.name
        profile = load_profile(key, read_profile(path).heads)
        assert profile_path(key) == path and profile.meta["model_key"] == key
        assert len(json.loads(profile.meta["context_digests"])) == 30 and "experiments.fast_profile learn" in profile.meta["command"]
        L, H = profile.heads
        for n, ratio in [(1024, 0.5), (4096, 0.75), (8192, 0.9)]:
            assert int(profile_counts(profile, ratio, n).sum()) == L * H * compute_n_kept(n, ratio)
        with pytest.raises(ValueError, match="learned for the model"):
            load_profile("another-000000000000", profile.heads, path)


def test_learn_profile_writes_the_users_profile_which_loads_before_the_packages(tmp_path, monkeypatch):
    """``kvprob train-gate``'s profile step: fitted on the contexts' KVzip labels, written to the user's cache under
    the model's key, and read from there (not the package's files); another model's key is refused."""
    from kvpress_prob.learned import labels as lb
    from kvpress_prob.learned.profile import GRID, learn_profile
    from kvpress_prob.presses import artefacts

    model = tiny_model("qwen3")
    monkeypatch.setenv("KVPROB_CACHE", str(tmp_path))  # after the model: its tokenizer stays where it was converted
    contexts = [random_ids(64, seed=s) for s in (11, 12)]
    path = learn_profile(model, contexts, "the test's command")
    key = artefacts.model_key(model)
    assert path == artefacts.model_dir(model) / "profile.safetensors" and path.is_file()
    heads = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    profile = load_profile(key, heads)
    assert profile.meta["command"] == "the test's command" and profile.grid == GRID
    assert json.loads(profile.meta["context_digests"]) == [lb.ids_digest(c) for c in contexts]
    assert torch.allclose(profile.shares.double().sum((-2, -1)), torch.ones(len(GRID), dtype=torch.float64))
    with pytest.raises(ValueError, match="learned for the model"):
        load_profile("llama-000000000000", heads, path)


def test_stand_ins_run_the_learned_press_on_an_untrained_model_and_leave_no_trace(monkeypatch):
    """A model nothing was trained for: RECOMMENDED refuses, naming `kvprob train-gate`; under untrained stand-ins it
    evicts to snapkv's total (uniform profile); afterwards $KVPROB_CACHE is what it was and the refusal is back."""
    import os

    from kvpress_prob.learned.stand_in import stand_in_artefacts
    from kvpress_prob.names.registry import RECOMMENDED

    model, ratio = tiny_model("llama"), 0.5
    ids = random_ids(N, seed=51)
    monkeypatch.setenv("KVPROB_CACHE", "/nonexistent-kvprob-cache")
    with pytest.raises(FileNotFoundError, match="kvprob train-gate"):
        press_prefill(model, ids, get_press(RECOMMENDED, ratio))
    with stand_in_artefacts(model) as folder:
        assert os.environ["KVPROB_CACHE"] == str(folder)
        press = get_press(RECOMMENDED, ratio)
        cache = press_prefill(model, ids, press)
        assert press.gate_used.startswith("stand-in-untrained")
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert sum(sum(layer.lengths) for layer in cache.layers) == L * H * compute_n_kept(N, ratio)
    assert os.environ["KVPROB_CACHE"] == "/nonexistent-kvprob-cache" and not folder.exists()
    with pytest.raises(FileNotFoundError, match="kvprob train-gate"):
        press_prefill(model, ids, get_press(RECOMMENDED, ratio))
