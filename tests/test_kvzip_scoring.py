"""KVzip's scoring at bounded memory (kvpress_prob/presses/kvzip_scoring.py): blocks of query rows give the scores of
the whole pass and of a float64 dense reference (kvpress's own code, explicit softmax); the score cache is per model,
freed with it, bounded by bytes, reused across ratios; the warning prints once; refusals before any pass."""

import copy
import gc
import logging

import pytest
import torch
from kvpress import KVzipPress

from evaluation.engine import press_prefill
from kvpress_prob.names.registry import get_press
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.presses.kvzip_scoring import SCORES, clear_scores
from tests.conftest import random_ids, tiny_model

N, CHUNK = 64, 24  # context tokens; reconstruction chunk (three reconstruction passes)


class _Reference(KVzipPress):
    """kvpress's own KVzipPress (dense, unchunked), its scores captured before its masking; its causal mask built
    in the weights' dtype (kvpress builds it in the default float32, which cannot hold float64's lowest)."""

    def _make_mask(self, attn_weights, window_size):
        lowest = torch.finfo(attn_weights.dtype).min
        mask = torch.full((window_size, window_size), lowest, dtype=attn_weights.dtype, device=attn_weights.device)
        self.causal_mask_score = mask.triu(1)[None, None, None]

    def compress_post(self, model):
        self.captured = self.score_val.clone()


def reference_scores(model, ids, plus: bool, chunk_size: int = CHUNK) -> torch.Tensor:
    press = _Reference(compression_ratio=0.5, chunk_size=chunk_size, kvzip_plus_normalization=plus)
    press_prefill(model, ids, press)
    return press.captured


def bounded_scores(model, ids, plus: bool, attention_bytes: int, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(kvzip_scoring, "ATTENTION_BYTES", attention_bytes)
    clear_scores()
    press_prefill(model, ids, get_press("kvzip", 0.5, chunk_size=CHUNK, kvzip_plus_normalization=plus))
    (scores,) = SCORES.stored(model)
    clear_scores()
    return scores


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("plus", [False, True])
def test_row_blocks_give_the_whole_pass_scores_and_a_float64_reference(arch, plus, monkeypatch):
    model, ids = tiny_model(arch), random_ids(N, seed=21)
    row = 4 * (4 + CHUNK + 60) * 4  # bytes of one query row's logits: H_q x (keys of the longest pass) x fp32
    blocked = bounded_scores(model, ids, plus, 2 * row, monkeypatch)  # two rows (or more, on shorter passes)
    one_row = bounded_scores(model, ids, plus, 1, monkeypatch)  # at least one row per block
    default = bounded_scores(model, ids, plus, kvzip_scoring.ATTENTION_BYTES, monkeypatch)  # one layer's K+V
    whole = reference_scores(model, ids, plus).cpu()  # kvpress's: every row in one dense tensor
    exact = reference_scores(copy.deepcopy(model).double(), ids, plus).cpu()
    assert blocked.shape == (3, 1, 2, N) and (blocked[..., 24:] > 0).all()  # (KVzip skips the chat template's 24-token prefix)
    for scores in (blocked, one_row, default):
        torch.testing.assert_close(scores, whole, rtol=1e-5, atol=1e-8)
        # float32 against float64 through three layers: relative rounding ~1e-6 per op, far below 1e-4
        torch.testing.assert_close(scores.double(), exact, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_blocks_in_half_precision_match_kvpress_dense_scores(dtype, monkeypatch):
    """Same inputs, same ops by rows: a block's matmul and softmax may round each value once differently (one ulp
    of the dtype, relative 2^-8 in bf16, 2^-11 in fp16); four ulps leave room for a logit's ulp through exp."""
    model, ids = tiny_model("qwen3", dtype=dtype), random_ids(N, seed=22)
    blocked = bounded_scores(model, ids, False, 2 * 4 * 88 * 2, monkeypatch)
    kvpress = reference_scores(model, ids, False).cpu()
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert blocked.dtype == dtype
    torch.testing.assert_close(blocked.float(), kvpress.float(), rtol=4 * ulp, atol=1e-6)


def count_passes(monkeypatch) -> list:
    calls = []
    original = KVzipPress._perform_kvzip_compression  # kvpress's: the reconstruction passes
    monkeypatch.setattr(KVzipPress, "_perform_kvzip_compression", lambda self, m, t: calls.append(1) or original(self, m, t))
    return calls


def test_scores_are_reused_across_ratios_and_seeds_of_one_context(monkeypatch):
    model, ids = tiny_model("llama"), random_ids(N, seed=23)
    clear_scores()
    calls = count_passes(monkeypatch)
    press_prefill(model, ids, get_press("topk_kvzip_widest", 0.5))
    press_prefill(model, ids, get_press("topk_kvzip_widest", 0.75))
    press_prefill(model, ids, get_press("prob_kvzip_priority_head", 0.25, seed=3))
    press_prefill(model, ids, get_press("kvzip", 0.5))
    assert calls == [1] and len(SCORES) == 1
    press_prefill(model, random_ids(N, seed=24), get_press("topk_kvzip_widest", 0.5))
    assert calls == [1, 1] and len(SCORES) == 2
    model.to(torch.bfloat16)  # the same model object in another dtype scores afresh
    press_prefill(model, ids, get_press("topk_kvzip_widest", 0.5))
    assert calls == [1, 1, 1]
    clear_scores()
    assert len(SCORES) == 0


def test_another_model_never_reads_the_first_ones_scores(monkeypatch):
    clear_scores()
    ids = random_ids(N, seed=25)
    first = tiny_model("llama")
    press_prefill(first, ids, get_press("topk_kvzip_widest", 0.5))
    (before,) = SCORES.stored(first)
    del first
    gc.collect()
    assert len(SCORES) == 0 and SCORES.nbytes() == 0  # freed with its model
    second = tiny_model("llama")  # the same shape, and the same weights but one layer's
    with torch.no_grad():
        second.model.layers[1].self_attn.k_proj.weight.mul_(3.0)
    calls = count_passes(monkeypatch)
    press_prefill(second, ids, get_press("topk_kvzip_widest", 0.5))
    assert calls == [1]  # scored afresh
    (scores,) = SCORES.stored(second)
    clear_scores()
    torch.testing.assert_close(scores, reference_scores(second, ids, False, 2048).cpu(), rtol=1e-5, atol=1e-8)
    assert not torch.allclose(scores[1], before[1], rtol=1e-2)  # the first model's would have been wrong


def test_the_cache_never_exceeds_its_bound(monkeypatch):
    model = tiny_model("llama")
    one = 3 * 2 * N * 4  # L x H_kv x n scores in fp32
    monkeypatch.setattr(kvzip_scoring, "SCORE_CACHE_BYTES", int(2.5 * one))
    clear_scores()
    kept = []
    for seed in range(4):
        press_prefill(model, random_ids(N, seed=30 + seed), get_press("topk_kvzip_widest", 0.5))
        kept.append(SCORES.stored(model)[-1])
        assert SCORES.nbytes() <= 2.5 * one
    assert len(SCORES) == 2 and all(torch.equal(a, b) for a, b in zip(SCORES.stored(model), kept[2:]))  # newest
    monkeypatch.setattr(kvzip_scoring, "SCORE_CACHE_BYTES", one - 1)  # below one context's: nothing kept
    clear_scores()
    press_prefill(model, random_ids(N, seed=40), get_press("topk_kvzip_widest", 0.5))
    assert len(SCORES) == 0
    clear_scores()


def test_kvpress_warning_prints_once(caplog):
    get_press("topk_kvzip_widest", 0.5)  # the process's first has printed it by now
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvpress.presses.kvzip_press"):
        for name in ("kvzip", "topk_kvzip_widest", "prob_kvzip_priority_head"):
            get_press(name, 0.5)
        KVzipPress(compression_ratio=0.5)
    assert not [r for r in caplog.records if "KVzipPress requires" in r.getMessage()]


@pytest.mark.parametrize("name", ["kvzip", "topk_kvzip_widest", "cross_kvzip_block1_a75_mix50_layers"])
def test_eager_attention_and_a_batch_are_refused_before_any_pass(name, monkeypatch):
    calls = count_passes(monkeypatch)
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"
    forwards = []
    model.model.register_forward_hook(lambda *a: forwards.append(1))  # a forward that ran
    with pytest.raises(ValueError, match="attn_implementation 'eager'"):
        press_prefill(model, random_ids(N), get_press(name, 0.5))
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="input_ids must have batch size 1.*\\(2, 64\\)"):
        press_prefill(model, torch.cat([random_ids(N, 1), random_ids(N, 2)]), get_press(name, 0.5))
    assert forwards == [] and calls == []


def test_the_shared_prefill_refuses_a_batch_before_scoring(monkeypatch):
    from evaluation.engine import Prefill

    calls = count_passes(monkeypatch)
    model = tiny_model("qwen3")
    press = get_press("topk_kvzip_widest", 0.5)
    shared = Prefill(model, torch.cat([random_ids(N, 1), random_ids(N, 2)]), [press])
    with pytest.raises(ValueError, match="batch size 1"):
        shared.compress(press)
    assert calls == []


def test_widest_fit_refuses_a_budget_below_one_entry_per_layer():
    from kvpress_prob.presses.allocations import widest_fit

    scores = torch.rand(3, 1, 2, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"ratio 1\.0 at context length 8 .* below one entry per layer"):
        widest_fit(scores, 1.0)
    # below a ratio of 1, kvpress's count keeps at least one entry per head: the refusal is unreachable
    for n in (1, 2, 8):
        for ratio in (0.0, 0.5, 0.99, 0.999999):
            k, widths = widest_fit(torch.rand(3, 1, 2, n, generator=torch.Generator().manual_seed(n)), ratio)
            assert int(widths.sum()) <= 3 * max(1, int(n * (1 - ratio))) and (widths >= 1).all()


@pytest.mark.parametrize("name", ["topk_kvzip_widest", "topk_kvzip_padded", "topk_kvzip_ragged_fit"])
def test_get_press_refuses_overrides_the_allocated_presses_ignore(name):
    for key, value in dict(seed=3, floor=0.1, layers=True, sampler="priority", budget="layer", correct=False,
                           layerwise=True).items():
        with pytest.raises(ValueError, match=rf"press '{name}' ignores the override\(s\) \['{key}'\]"):
            get_press(name, 0.5, **{key: value})
    with pytest.raises(ValueError, match=r"\['floor', 'seed'\]"):
        get_press(name, 0.5, seed=1, floor=0.2)
    assert get_press(name, 0.5, n_sink=8, chunk_size=512).chunk_size == 512  # the fields it reads


def test_get_press_refuses_a_seed_a_deterministic_kvzip_design_ignores():
    with pytest.raises(ValueError, match=r"ignores the override\(s\) \['seed'\]"):
        get_press("topk_kvzip_head", 0.5, seed=2)
    with pytest.raises(ValueError, match=r"\['budget'\]"):
        get_press("topk_kvzip_layers", 0.5, budget="global")
    assert get_press("topk_kvzip_head", 0.5, sampler="priority", seed=2).seed == 2  # a random design reads it
    assert get_press("prob_kvzip_priority_head", 0.5, seed=2, budget="layer").budget == "layer"
