"""Checks that would catch a wrong kept set, each beside a mutant it must reject.

- The widest toprest fill (``cross_kvzip_block1_a75_toprest_widest``): each head of each layer holds ``width`` entries (an independent brute force of
  the widest allocation), KVzip's exact share (the top int(0.75 width) of its scores) and, outside it, the top of
  pi_min-h computed independently in float64 from the model's own eager attention. Mutant: a random fill.
- A deterministic sampler refuses ``correct`` and ``floor`` (it would ignore them). Mutant: an ignored ``correct``.
"""

import copy

import pytest
import torch

from kvpress_prob.names.registry import RECOMMENDED_SLOW, get_press
from kvpress_prob.presses import kvzip_scoring
from kvpress_prob.samplers.base import top_by_rank
from kvpress_prob.samplers.cross import CrossTopSampler
from tests import kept_snapshot as ks
from tests.conftest import random_ids, tiny_model
from tests.test_fast_paths import brute_fit

N, RATIO, ALPHA = 96, 0.75, 0.75
TIE = 1e-6  # relative gap below which float32 rounding, not pi_min-h, decides the fill's last entry


@torch.no_grad()
def min_h_float64(model, ids) -> torch.Tensor:
    """pi_min-h's weights (L, H_kv, n) before its floor, from a float64 copy of the model's eager attention:
    per query head sum_j h_j A[j, i] ||v_i|| (h_j ~ 1 / (n - j)), normalised, then the mean over the group."""
    net = copy.deepcopy(model).double()
    net.set_attn_implementation("eager")
    out = net.model(input_ids=ids, output_attentions=True, use_cache=True)
    n = ids.shape[1]
    h = 1.0 / (n - torch.arange(n, dtype=torch.float64))
    h /= h.sum()
    rows = []
    for layer, attention in enumerate(out.attentions):  # (1, H_q, n, n)
        values = out.past_key_values.layers[layer].values[0]  # (H_kv, n, d)
        hkv = values.shape[0]
        mass = torch.einsum("j,qji->qi", h, attention[0])  # (H_q, n)
        mass = mass.view(hkv, -1, n) * values.norm(dim=-1)[:, None, :]
        rows.append((mass / mass.sum(-1, keepdim=True)).mean(1))
    return torch.stack(rows)


def toprest_errors(model, ids, mask: torch.Tensor, scores: torch.Tensor) -> list[tuple[int, int, str]]:
    """(layer, head, what) wherever ``mask`` (L, H, n) is not the toprest set built from ``scores`` (L, 1, H, n):
    the widths of a brute-force widest allocation, KVzip's exact share, pi_min-h's float64 top outside it."""
    _, widths = brute_fit(scores.double(), RATIO)
    tail = min_h_float64(model, ids)
    errors = []
    for layer, width in enumerate(widths):
        exact_count = int(ALPHA * width)
        for head in range(mask.shape[1]):
            kept = mask[layer, head]
            if int(kept.sum()) != width:
                errors.append((layer, head, f"holds {int(kept.sum())}, width {width}"))
                continue
            exact = torch.zeros_like(kept)
            exact[scores[layer, 0, head].topk(exact_count).indices] = True
            if not kept[exact].all():
                errors.append((layer, head, "misses KVzip's exact share"))
                continue
            rest = tail[layer, head].masked_fill(exact, -1.0)
            order = rest.argsort(descending=True)
            fill = width - exact_count
            want = torch.zeros_like(kept)
            want[order[:fill]] = True
            top = rest[order[: fill + 1]]
            tied = fill < rest.numel() and (top[fill - 1] - top[fill]) / top[0] < TIE if fill > 0 else False
            if not tied and not torch.equal(kept & ~exact, want):
                errors.append((layer, head, "fill is not pi_min-h's top"))
    return errors


WIDEST_TOPREST = "cross_kvzip_block1_a75_toprest_widest"


def toprest_kept(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    kvzip_scoring.clear_scores()
    mask, _ = ks.kept(model, get_press(WIDEST_TOPREST, RATIO), ids)
    scores = kvzip_scoring.SCORES.stored(model)[0].double().clone()  # (L, 1, H, n)
    scores[..., :4] = scores.amax() + 1  # the sinks, pinned as the press pins them
    kvzip_scoring.clear_scores()
    return mask, scores


@pytest.fixture(scope="module")
def fixture():
    return tiny_model("llama"), random_ids(N, seed=31)


def test_the_widest_toprest_fills_with_the_float64_min_h_top(fixture):
    model, ids = fixture
    mask, scores = toprest_kept(model, ids)
    assert toprest_errors(model, ids, mask, scores) == []
    # the fill is not KVzip's own next entries: the check compares pi_min-h's top, not a restatement of KVzip
    _, widths = brute_fit(scores, RATIO)
    assert any(not mask[l, h][scores[l, 0, h].topk(int(w)).indices].all()
               for l, w in enumerate(widths) for h in range(mask.shape[1]))


def test_the_check_rejects_a_random_fill(fixture, monkeypatch):
    model, ids = fixture
    g = torch.Generator().manual_seed(0)

    def random_fill(self, rest, target, generator):
        noise = torch.rand(rest.shape, generator=g, dtype=rest.dtype).masked_fill(rest <= 0, -1.0)
        return top_by_rank(noise, target), torch.zeros_like(rest)

    monkeypatch.setattr(CrossTopSampler, "fill", random_fill)
    mask, scores = toprest_kept(model, ids)
    assert any(what == "fill is not pi_min-h's top" for _, _, what in toprest_errors(model, ids, mask, scores))


def refuses(name: str, **override) -> bool:
    try:
        get_press(name, 0.5, **override)
    except ValueError as error:
        assert "ignores the override" in str(error) and all(k in str(error) for k in override)
        return True
    return False


@pytest.mark.parametrize("name", [RECOMMENDED_SLOW, WIDEST_TOPREST, "topk_kvzip_head", "topk_kvzip_layers"])
def test_a_deterministic_sampler_refuses_correct_and_floor(name):
    assert refuses(name, correct=False) and refuses(name, floor=0.2) and refuses(name, seed=1)


def test_a_random_sampler_reads_correct_and_floor():
    press = get_press("cross_kvzip_block1_a75_widest", 0.5, correct=False, floor=0.2, seed=1)
    assert (press.correct, press.floor, press.seed) == (False, 0.2, 1)


def test_the_check_rejects_an_ignored_correct(monkeypatch):
    for name in (RECOMMENDED_SLOW, WIDEST_TOPREST):
        cls = type(get_press(name, 0.5))
        original = cls.unused_fields
        monkeypatch.setattr(cls, "unused_fields", lambda self, original=original: original(self) - {"correct"})
        assert not refuses(name, correct=False)
        monkeypatch.undo()
