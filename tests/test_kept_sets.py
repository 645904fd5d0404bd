"""Every named prefill press keeps the entries it kept when tests/data/kept-7ab10c4.json was recorded.

The snapshot (tests/kept_snapshot.py, its docstring says how) holds, for every name of the catalogue at
commit 7ab10c4 and every prefill press named under results/, the kept set of each head of each layer at
r = 0.25, 0.5 and 0.75 on a tiny random float32 Llama, seed 0. Here each is recomputed and compared head by
head, except the heads recorded as tied (their kept set changed under a 1e-3 perturbation of the weights,
so rounding decides them). A head that differs is also left out when it is tied on this machine, under a
1e-4 perturbation (a tenth of the recording's): a global budget moves a block between heads on one score's rounding, and the
perturbation that flags it on one machine may leave it on another. kvpress's ``h2o`` runs on eager attention
(recorded). The names that did not build at that commit must still be refused.
"""

import json
from pathlib import Path

import pytest
import torch

from tests import kept_snapshot as ks

SNAPSHOT = json.loads((Path(__file__).resolve().parent / "data" / "kept-7ab10c4.json").read_text())


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    nets, ids = {"sdpa": ks.tiny("sdpa"), "eager": ks.tiny("eager")}, ks.ids()
    return nets, ids, {attn: ks.plain_prefill(net, ids) for attn, net in nets.items()}


_PERTURBED: dict = {}
#: The perturbation that excuses a head here: a tenth of the recording's, so that only a head whose kept set hangs
#: on scores within about 1e-4 of each other is excused (float32 rounding moves a score by about 1e-6 of its size).
EPS_HERE = ks.EPS / 10


def tied_here(attn: str, name: str, ratio: float, mask: torch.Tensor, ids) -> set[tuple[int, int]]:
    """The (layer, head) pairs whose kept set here changes when the weights are scaled by 1 +- EPS_HERE x noise."""
    tied = set()
    for scale in (EPS_HERE, -EPS_HERE):
        net = _PERTURBED.setdefault((attn, scale), ks.tiny(attn, scale))
        other, _ = ks.kept(net, ks.build(name, ratio), ids)
        tied |= {(l, h) for l in range(mask.shape[0]) for h in range(mask.shape[1])
                 if not torch.equal(mask[l, h], other[l, h])}
    return tied


# Presses added after the snapshot's commit, with records since: their own tests check what they keep (the KVzip
# presses: every one against tests/data/kvzip-kept-facf533.json, the recommendations included).
SINCE = {"cross_kvzip_block1_a75_widest": "tests/test_kvzip_kept.py",
         "cross_kvzip_block1_a90_widest": "tests/test_kvzip_kept.py",
         "cross_kvzip_block1_a90_widest_nocorr": "tests/test_kvzip_kept.py",
         "cross_kvzip_block1_a50_toprest_widest": "tests/test_kvzip_kept.py",
         "cross_kvzip_block1_a75_toprest_widest": "tests/test_kvzip_kept.py",
         "topk_gate_widest": "tests/test_gate.py",
         **{name: "tests/test_gate_layers.py" for name in ("topk_gate_layers", "topk_gate_layers_recent10",
                                                           "topk_gate_layers_recent25", "topk_gate_layers_recent50")},
         "topk_kvzip_global": "tests/test_ragged_press.py",
         **{name: "tests/test_ragged_presses.py" for name in ("prob_min_h_ragged", "adakv_snapkv_ragged",
                                                               "topk_gate_ragged")},
         **{f"cross_kvzip_block1_a{a}_toprest_ragged": "tests/test_ragged_presses.py" for a in (50, 75)},
         **{name: "tests/test_gate_profile.py" for name in ("topk_gate_profile_ragged", "topk_gate_profile_layers_ragged",
                                                            "topk_gate_profile_recent10_ragged", "topk_gate_profile_recent25_ragged",
                                                            *(f"topk_gate_profile_a{a}_minh256_ragged"
                                                              for a in (25, 50, 75)))}}


def test_the_snapshot_covers_the_catalogue_and_the_records():
    assert SNAPSHOT["n"] == ks.N and not SNAPSHOT["failed"]
    assert len(SNAPSHOT["presses"]) >= 180
    # every prefill press named in a record or manifest is either recorded or recorded as refused, or newer
    named = {n for n in ks.record_names() if n != "full" and not n.startswith(("decode_", "prob_decode_"))}
    assert named - set(SINCE) <= set(SNAPSHOT["presses"]) | set(SNAPSHOT["unbuildable"])
    root = Path(__file__).resolve().parents[1]
    kvzip = json.loads((root / "tests" / "data" / "kvzip-kept-facf533.json").read_text())["fixtures"]
    for name, test in SINCE.items():
        assert name not in SNAPSHOT["presses"] and (root / test).exists() and ks.build(name, 0.5) is not None
        assert test != "tests/test_kvzip_kept.py" or all(name in f["presses"] for f in kvzip.values())


@pytest.mark.parametrize("name", sorted(SNAPSHOT["presses"]))
def test_same_kept_set(models, name):
    nets, ids, plain = models
    entry = SNAPSHOT["presses"][name]
    assert ks.attention_of(ks.build(name, 0.5)) == entry["attn"]
    total = 0
    for ratio in ks.RATIOS:
        want = entry[str(ratio)]
        mask, unmatched = ks.kept(nets[entry["attn"]], ks.build(name, ratio), ids, plain[entry["attn"]])
        assert list(mask.shape) == want["shape"], (name, ratio)
        assert unmatched == want["unmatched"], (name, ratio)
        expected = ks.unbits(want["bits"], want["shape"])
        compared = torch.ones(mask.shape[:2], dtype=torch.bool)
        for layer, head in want["tied"]:
            compared[layer, head] = False
        total += int(compared.sum())
        differ = [(l, h) for l, h in compared.nonzero().tolist() if not torch.equal(mask[l, h], expected[l, h])]
        if differ:  # excused here only where a 1e-4 perturbation moves the head
            tied = tied_here(entry["attn"], name, ratio, mask, ids)
            differ = [pair for pair in differ if pair not in tied]
        assert not differ, f"{name} at r = {ratio}: kept sets differ in (layer, head) {differ}"
    assert total >= 3, name  # at least a quarter of the 3 x 4 (ratio, layer, head) kept sets in the snapshot's comparison


@pytest.mark.parametrize("name", sorted(SNAPSHOT["unbuildable"]))
def test_still_refused(name):
    with pytest.raises(ValueError):
        ks.build(name, 0.5)
