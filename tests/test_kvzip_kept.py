"""Every KVzip press keeps what it kept before its scoring was made faster (tests/data/kvzip-kept-facf533.json).

The snapshot (tests/kvzip_snapshot.py, its docstring says how) holds, for every press whose name holds ``kvzip``
and r = 0.5, 0.75 and 0.9, the kept set of each head of each layer on a tiny random Llama and on the embedded
SmolLM2-135M-Instruct over a short English text, in float32, recorded at commit facf533 (before the query group
was folded into KVzip's rows, pi_min-h's mask cut to each chunk's diagonal block, and ``widest_fit`` made one
sort). Here each is recomputed (on the embedded model, one press of each design: two in `make test`, the rest
in `make test-all`) and compared head by head. A head recorded as tied (its kept set moved under a 1e-4 perturbation
of the weights) is compared by its count only: rounding, not the scores, decides which of its tied entries it keeps,
but not how many.
"""

import json
from pathlib import Path

import pytest
import torch

from tests import kept_snapshot as ks
from tests import kvzip_snapshot as kz

SNAPSHOT = json.loads((Path(__file__).resolve().parent / "data" / "kvzip-kept-facf533.json").read_text())
#: Presses renamed since the snapshot (one name, one meaning): the recorded name -> the name that builds it now, from
#: the rename map beside the records (results/renames.json; tests/test_recorded_names.py reads every record with it).
RENAMED = json.loads((Path(__file__).resolve().parents[1] / "results" / "renames.json").read_text())["renamed"]
#: KVzip presses added since, each checked against an independent computation by its own test.
SINCE = {"topk_kvzip_global": "tests/test_ragged_press.py",
         "cross_kvzip_block1_a50_toprest_ragged": "tests/test_ragged_presses.py",
         "cross_kvzip_block1_a75_toprest_ragged": "tests/test_ragged_presses.py"}
#: On the embedded model (4 s a press), one press of each design: every allocation, the toprest, cross, mix, tblock,
#: hybrid and sampled designs; the presses that differ from one of these only in a number (a, mix, block) run on
#: the tiny model, which runs every press of the snapshot.
EMBEDDED = {"kvzip", "topk_kvzip_head", "topk_kvzip_layers", "topk_kvzip_ragged", "topk_kvzip_ragged_fit",
            "topk_kvzip_widest", "cross_kvzip_block1_a75_toprest_widest", "cross_kvzip_block1_a50_toprest_widest",
            "cross_kvzip_block1_a75_widest", "cross_kvzip_block1_a90_widest_nocorr", "cross_kvzip_block8_a75",
            "cross_kvzip_block8_a75_layers", "cross_kvzip_block1_a75_mix50_layers",
            "cross_kvzip_block8_a0_mix50_tblock_layers", "hybrid_kvzip_block8_a50", "prob_kvzip_priority_head"}
#: The embedded presses `make test` runs (the plain masked press and the ragged cache); the other embedded ones run in
#: `make test-all`, the tiny model's every press in both.
QUICK = {"kvzip", "topk_kvzip_ragged"}
CASES = [(fixture, name) if fixture == "tiny" or name in QUICK else pytest.param(fixture, name, marks=pytest.mark.slow)
         for fixture, data in SNAPSHOT["fixtures"].items() for name in sorted(data["presses"])
         if fixture == "tiny" or name in EMBEDDED]
_MODELS: dict = {}


def model_of(fixture: str):
    """The fixture's model and its plain prefill of the snapshot's ids (made once per worker)."""
    if fixture not in _MODELS:
        torch.set_num_threads(1)
        ks._tokenizer_once()
        model = ks.tiny("sdpa") if fixture == "tiny" else kz.embedded()[0]
        _MODELS[fixture] = model, ks.plain_prefill(model, torch.tensor([SNAPSHOT["fixtures"][fixture]["ids"]]))
    return _MODELS[fixture]


def test_the_snapshot_covers_every_kvzip_press_and_both_fixtures():
    assert set(SNAPSHOT["fixtures"]) == {"tiny", "embedded"} and SNAPSHOT["ratios"] == [0.5, 0.75, 0.9]
    for data in SNAPSHOT["fixtures"].values():
        now = {RENAMED.get(name, name) for name in data["presses"]}
        assert now == set(kz.kvzip_names()) - set(SINCE) - set(RENAMED)  # an old name still in a record
    root = Path(__file__).resolve().parents[1]
    assert all((root / test).exists() for test in SINCE.values())
    assert QUICK <= EMBEDDED <= set(SNAPSHOT["fixtures"]["embedded"]["presses"])
    assert {"cross_kvzip_block1_a75_toprest_widest", "cross_kvzip_block1_a50_toprest_widest", "topk_kvzip_widest",
            "topk_kvzip_layers", "topk_kvzip_head", "kvzip"} <= set(kz.kvzip_names())


@pytest.mark.parametrize("fixture, name", CASES)
def test_same_kept_set_as_before_the_fast_scoring(fixture, name):
    (model, full), ids = model_of(fixture), torch.tensor([SNAPSHOT["fixtures"][fixture]["ids"]])
    entry = SNAPSHOT["fixtures"][fixture]["presses"][name]
    compared = 0
    for ratio in SNAPSHOT["ratios"]:
        want = entry[str(ratio)]
        mask, unmatched = ks.kept(model, ks.build(RENAMED.get(name, name), ratio), ids, full)
        expected = ks.unbits(want["bits"], want["shape"])
        assert list(mask.shape) == want["shape"] and unmatched == want["unmatched"], (name, ratio)
        assert torch.equal(mask.sum(-1), expected.sum(-1)), f"{name} at r = {ratio}: counts differ"
        tied = {tuple(pair) for pair in want["tied"]}
        differ = [(l, h) for l in range(mask.shape[0]) for h in range(mask.shape[1])
                  if (l, h) not in tied and not torch.equal(mask[l, h], expected[l, h])]
        assert not differ, f"{name} at r = {ratio}: kept sets differ in (layer, head) {differ}"
        compared += mask.shape[0] * mask.shape[1] - len(tied)
    assert compared >= mask.shape[0] * mask.shape[1]  # at least a third of the (ratio, layer, head) sets compared
