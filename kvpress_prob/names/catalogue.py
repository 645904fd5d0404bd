"""The registered presses: which points of the grid (``kvpress_prob.names.grid``) we register, and for each
its origin (``kvpress``, ``paper``, ``ours``), its family, and its status with the finding behind it.

Statuses: ``recommended``; ``measured`` (decoded on a split, kept as a row); ``rejected`` (lost, with
the reason); ``unmeasured`` (registered, never decoded: the sweep was stopped for compute). The
findings are those of docs/findings.md (RULER at 1024 tokens on SmolLM2-135M-Instruct; development
split = data seed 0, test split = data seed 1). A family's status applies to its names unless
``STATUS`` names one.

Adding a family: one ``Family`` row, its grid points in ``REGISTERED``, a rule in ``family_of``; a
family of presses outside the grammar (a dict name -> factory) goes in ``NAMED``, e.g. for the
decoding presses: ``NAMED.update({n: (None, "ours", "decoding") for n in DECODING_PRESSES})`` and a
``Family("ours", "decoding", ...)`` row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvpress_prob.names.grid import Parts, grid, press_name
from kvpress_prob.presses.kvzip_alloc import KVZIP_ALLOCATIONS
from kvpress_prob.names.named import DECODING_NAMES, ENTROPY_HYBRIDS


@dataclass(frozen=True)
class Family:
    origin: str  # kvpress | paper | ours
    name: str
    pattern: str  # how its names are written
    paper: str
    status: str
    finding: str
    docs: str  # where the finding is


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("kvpress", "top-k", "<scorer>", "StreamingLLM, SnapKV, TOVA, H2O, K-norm, KeyDiff, LagKV, "
           "ExpectedAttention (kvpress, under AdaKV); papers in docs/presses.md", "measured",
           "the baselines; best top-k on the test split: expected_attention at r = 0.25 / 0.75 (56.8 / 35.7)",
           "docs/findings.md#3-test-split"),
    Family("kvpress", "AdaKV", "adakv_<scorer>", "AdaKV (Feng et al. 2024)", "measured",
           "head-adaptive top-k that masks: holds the full cache at every ratio", "docs/findings.md#adaptive-top-k"),
    Family("paper", "sampled", "prob_<proposal>[_nocorr]", "Geh et al. 2026", "measured",
           "does not reproduce the paper's ranking here: prob_min_h 4.2 vs tova 20.8 at r = 0.5 (66 examples)",
           "docs/findings.md#the-papers-ruler-sweep-on-the-embedded-model"),
    Family("ours", "proposals and draws", "prob_<proposal>_<c|shared|w<k>|strata|coord|ht>", "ours", "measured",
           "on one 2k needle only (results/registry-niah-2k)", "docs/presses.md#beyond-the-paper-origin-ours"),
    Family("ours", "designs", "prob_<proposal>_<threshold|priority>[_s<k>][_floor][_head]",
           "threshold (pi-ps) and priority sampling (Duffield et al. 2007)", "rejected",
           "tokens sampled one by one lose multi-token needles (prob_tova_threshold 16.7 at r = 0.5, 6 dev ex)",
           "docs/findings.md#2-sampling-designs-development-split"),
    Family("ours", "blocks", "prob_<proposal>_block<k>[_priority]", "cluster sampling", "measured",
           "blocks keep a number's digits together, for sampling and top-k alike",
           "docs/findings.md#2-sampling-designs-development-split"),
    Family("ours", "top-k twins", "topk_<proposal>[_block<k>]", "ours", "measured",
           "the sampled designs' deterministic twins (same proposal, unit and budget)",
           "docs/findings.md#3-test-split"),
    Family("ours", "adaptive", "<scorer>_adaptive", "AdaKV's budget (Feng et al. 2024), memory freed", "measured",
           "frees 1 - r of the cache where AdaKV frees nothing", "docs/findings.md#adaptive-top-k"),
    Family("ours", "hybrids", "hybrid_<proposal>_block<k>_a<pct>[_threshold|_global], cross_<scorer>_block<k>_a<pct>",
           "ours; cross: after Error Certificates (arXiv 2607.21475)", "measured",
           "the first sampling designs within noise of the best top-k", "docs/findings.md#6-the-new-recommended-on-the-test-split"),
    Family("ours", "summaries", "<press>_sum<V>[_seg][_tau<t>]", "ours", "measured",
           "lower the attention error by a fifth, move no answer beyond noise (equal memory)",
           "docs/findings.md#4-evicted-set-summaries-and-stratified-hybrids-issue-16"),
    Family("ours", "calibrated", "prob_<scorer>_block8_priority_<rank|ent>", "ours", "measured",
           "a rank map makes sampling over KeyDiff work (dev mean 39.8 vs 18.3)",
           "docs/findings.md#5-calibrated-proposals-span-aware-units-and-an-attention-measure-that-predicts-answers"),
    Family("ours", "entropy hybrids", "<prob|hybrid>_<proposal>[_block8]_ent_alpha[_nocorr]", "ours", "measured",
           "alpha_h from each head's proposal entropy: ties prob_min_h_priority on prose dev, far below the hybrids on "
           "RULER dev (-18.8 points at r = 0.5); no prefill entropy sees the question", "docs/entropy-hybrid.md"),
    Family("ours", "decoding", "<decode|prob_decode>_<proposal>_<design>[_nocorr]",
           "kvpress DecodingPress; VaSE (arXiv 2606.03928) for value protection", "measured",
           "compounded HT weights while decoding; long generation on 3 dev essays: 0.63x kvpress TOVA's NLL increase",
           "docs/decoding.md"),
    Family("ours", "spans", "topk_<proposal>_span<k>[_nowiden]", "ours", "rejected",
           "span-aware units change no answer against blocks of 8 (0.0 on 9 test examples)",
           "docs/findings.md#5-calibrated-proposals-span-aware-units-and-an-attention-measure-that-predicts-answers"),
]}

PAPER_PROPOSALS = ("streaming_llm", "snapkv", "tova", "h2o", "knorm", "min", "min_h", "h2o_h")
_NC = ((), ("nocorr",))


def family_of(parts: Parts) -> str:
    keys = {o.rstrip("0123456789.") for o in parts.options}
    if "sum" in keys:
        return "summaries"
    if parts.unit.startswith("span"):
        return "spans"
    if keys & {"rank", "ent"}:
        return "calibrated"
    if parts.kind in ("kvpress", "adakv"):
        return {"kvpress": "top-k", "adakv": "AdaKV"}[parts.kind]
    if parts.kind in ("adaptive", "hybrid", "cross"):
        return {"adaptive": "adaptive", "hybrid": "hybrids", "cross": "hybrids"}[parts.kind]
    if parts.kind == "topk":
        return "top-k twins"
    if parts.unit.startswith("block"):
        return "blocks"
    if parts.design != "poisson":
        return "designs"
    if parts.proposal in PAPER_PROPOSALS and keys <= {"nocorr"}:
        return "sampled"
    return "proposals and draws"


#: The registered points of the grid, in the order ``kvprob presses --all`` lists them.
REGISTERED: list[Parts] = [
    *grid("kvpress", ["streaming_llm", "snapkv", "tova", "h2o", "knorm", "expected_attention", "keydiff", "lagkv",
                      "kvzip"]),
    *grid("adakv", ["snapkv", "tova", "knorm", "keydiff", "lagkv"]),
    *grid("prob", PAPER_PROPOSALS, options=_NC),
    *grid("prob", ["min"], options=[("c",), ("c", "nocorr"), ("shared",)]),
    *grid("prob", ["min_h"], options=[o + n for o in [("strata",), ("coord",), ("shared",), ("ht",)] for n in _NC]),
    *grid("prob", ["snapkv"], options=[o + n for o in [("strata",), ("ht",)] for n in _NC]),
    *grid("prob", ["min_h"], options=[("w64",)]),
    *grid("prob", ["expected_attention", "keydiff", "lagkv", "min_h_s256"]),
    *grid("prob", ["tova"], designs=["threshold", "priority"], options=[(), ("s4",), ("s4", "head")]),
    *grid("prob", ["tova"], designs=["threshold"], options=[("floor",)]),
    *grid("prob", ["knorm", "min_h"], designs=["threshold", "priority"]),
    *grid("prob", ["keydiff", "expected_attention"], designs=["threshold"]),
    *grid("prob", ["tova", "knorm", "min_h", "keydiff", "expected_attention"], units=["block8"]),
    *grid("prob", ["tova"], units=["block16"]),
    *grid("prob", ["tova", "keydiff", "expected_attention"], units=["block8"], designs=["priority"]),
    *grid("prob", ["keydiff"], units=["block8"], designs=["priority"], options=[("rank",), ("ent",)]),
    *grid("prob", ["expected_attention"], units=["block8"], designs=["priority"], options=[("ent",)]),
    *grid("topk", ["min_h"]),
    *grid("topk", ["tova", "knorm", "keydiff"], units=["block8"]),
    *grid("topk", ["tova"], units=["block16"]),
    *grid("topk", ["keydiff", "tova"], units=["span8"], options=[(), ("nowiden",)]),
    *grid("adaptive", ["snapkv", "tova", "knorm", "keydiff", "expected_attention", "lagkv"]),
    *grid("hybrid", ["keydiff", "tova", "expected_attention"], units=["block8"], options=[("a50",), ("a75",), ("a90",)]),
    *grid("hybrid", ["keydiff"], units=["block8"], options=[("a75", "threshold"), ("a75", "global")]),
    *grid("kvpress", ["keydiff", "tova", "knorm"], options=[(f"sum{c}",) for c in (1, 4, 16, 64)]),
    *grid("kvpress", ["keydiff"], options=[(f"sum{c}", "seg") for c in (1, 4, 16, 64)]),
    *grid("kvpress", ["keydiff", "tova", "knorm"], options=[(f"sum{c}", f"tau{t}") for c in (4, 16) for t in (0.5, 0.1)]),
    *grid("topk", ["tova", "keydiff"], units=["block8"], options=[("sum4",)]),
    *grid("hybrid", ["keydiff"], units=["block8"], options=[("a75", "sum4"), ("a75", "global", "sum4")]),
    *grid("cross", ["keydiff"], units=["block8"], options=[("a25",), ("a50",), ("a75",), ("a50", "nocorr")]),
    *grid("cross", ["expected_attention"], units=["block8"], options=[("a25",), ("a50",), ("a75",)]),
    *grid("prob", ["uniform"], designs=["priority"], options=[("head",)]),
    *grid("topk", ["kvzip"], options=[("head",)]),
    *grid("prob", ["kvzip"], designs=["priority"], options=[("head",)]),
    *grid("hybrid", ["kvzip"], units=["block8"], options=[("a50",)]),
    *grid("cross", ["kvzip"], units=["block8"], options=[("a50",), ("a75",), ("a50", "layers")]),
    *grid("topk", ["kvzip"], options=[("layers",)]),
    *grid("cross", ["kvzip"], units=["block1"], options=[("a75", "mix50", "layers")]),
]

#: Presses outside the grammar: name -> (factory of the compression ratio, or None for a press built
#: elsewhere and only listed here, e.g. a decoding press built by ``get_decoding_press(name, target_size,
#: compression_interval)``; origin; family).
NAMED: dict[str, tuple[Callable | None, str, str]] = {
    **{name: (make, "ours", "entropy hybrids") for name, make in ENTROPY_HYBRIDS.items()},
    **{name: (None, "ours", "decoding") for name in DECODING_NAMES},
    **{name: (make, "ours", "top-k twins") for name, make in KVZIP_ALLOCATIONS.items()},
}

_UNMEASURED = "registered, never decoded (its sweep was stopped for compute)"
_EARLY = "rejected early: 1-2 development examples (results/dev/compare.md)"
_TEST = "test split, 32 examples"

#: Per-name statuses, where a name differs from its family's.
STATUS: dict[str, tuple[str, str]] = {
    "snapkv": ("measured", "near 0 on this model (6.7 at r = 0.5, 66 examples)"),
    "kvzip": ("measured", "kvpress's KVzipPress: query-agnostic context reconstruction; masks, holds the full cache"),
    "topk_kvzip_head": ("measured", "KVzip's scores, kvpress's per-head count, real eviction: kvzip at equal memory "
                        "(kvpress_prob/presses/kvzip.py, docs/three-regimes.md)"),
    "prob_kvzip_priority_head": ("measured", "KVzip's scores as the proposal, priority-sampled, corrected "
                                 "(docs/three-regimes.md)"),
    "hybrid_kvzip_block8_a50": ("measured", "KVzip's top blocks for half the budget, the rest sampled from its scores "
                                "(docs/three-regimes.md)"),
    "prob_uniform_priority_head": ("measured", "uniform random per-head eviction (arXiv 2609.03430's baseline) at "
                                   "kvpress's count: the floor (docs/three-regimes.md)"),
    **{f"cross_{s}_block8_a{a}": ("measured", f"exact {s} blocks for {a} % of each head's budget, the rest "
                                  "priority-sampled from pi_min-h, corrected (docs/three-regimes.md)")
       for s in ("keydiff", "expected_attention") for a in (25, 50, 75)},
    **{f"cross_kvzip_block8_a{a}": ("measured", f"KVzip's top blocks for {a} % of each head's budget, the rest "
                                     "priority-sampled from pi_min-h, corrected (docs/three-regimes.md)") for a in (50, 75)},
    "topk_kvzip_layers": ("measured", "round 1's RECOMMENDED (dev worst q 0.206, recall): KVzip's scores and "
                          "allocation over layers, the layer's mean head count in every head (results/rule/dev-maximin.md)"),
    "cross_kvzip_block8_a50_layers": ("measured", "round 1's RECOMMENDED_PROSE (prose q 1.000 in round 1's pool), RULER "
                                      "q 0.305, recall 0.129 (results/rule/dev-maximin.md)"),
    "topk_kvzip_widest": ("recommended", "RECOMMENDED (round 2): first by maximin on dev, worst q 0.457 (recall; RULER "
                          "0.849, prose 0.477): every head of a layer keeps its neediest head's KVzip count, at "
                          "kvpress's bytes (results/rule/dev-maximin-round2.md)"),
    "topk_kvzip_ragged_fit": ("recommended", "RECOMMENDED_RETRIEVAL (round 2): RULER q 0.978 on dev, prose 0.202, recall "
                              "0.279: the largest global KVzip top whose padded layers fit kvpress's bytes"),
    "cross_kvzip_block1_a75_mix50_layers": ("recommended", "RECOMMENDED_PROSE (round 2): prose q 0.924 on dev, RULER "
                                            "0.365, recall 0.211: KVzip's top tokens for 75 %, the rest priority-sampled "
                                            "from a defensive mixture of pi_min-h and KVzip's ranks, corrected"),
    "cross_keydiff_block8_a50_nocorr": ("measured", "cross_keydiff_block8_a50 without the correction "
                                        "(docs/three-regimes.md)"),
    "keydiff": ("measured", f"39.1 / 25.3 at r = 0.5 / 0.75 ({_TEST})"),
    "adakv_knorm": ("measured", "knorm_adaptive is ahead: +20.8 [+6.8, +34.8] at r = 0.25 (32 test examples)"),
    "prob_min_h_s256": ("measured", "within noise of prob_min_h (-0.4 [-2.3, +1.5], 17 test examples); "
                        "prefill 0.90x snapkv's at 8k"),
    "prob_min_h_ht": ("measured", "HT weights lower KL vs count weights: -0.015 [-0.023, -0.006] (6 NIAH at 2k)"),
    "prob_snapkv_ht": ("measured", "HT weights lower KL vs count weights: -0.016 [-0.029, -0.002] (6 NIAH at 2k)"),
    "prob_tova_threshold_s4": ("rejected", "sharpening moves mass to sinks and recent tokens, the needle falls "
                               "into the tail (13.3 / 0.0 at r = 0.25 / 0.5, 5 dev ex)"),
    "prob_tova_threshold_floor": ("rejected", _EARLY),
    "prob_tova_priority_s4": ("rejected", _EARLY),
    "prob_tova_priority_s4_head": ("rejected", _EARLY),
    "prob_min_h_threshold": ("rejected", _EARLY),
    "prob_min_h_block8": ("rejected", _EARLY),
    "prob_tova_block8": ("rejected", "a random block count per head (14.9 at r = 0.5 vs 25.3 for priority, dev)"),
    "prob_tova_block8_priority": ("measured", "the previous RECOMMENDED: 29.9 at r = 0.5 (test); "
                                  "the hybrid beats it by +18.7 [+6.2, +31.2]"),
    "prob_knorm_block8": ("measured", f"development runner-up; 21.4 at r = 0.5 ({_TEST})"),
    "topk_keydiff_block8": ("recommended", f"best top-k: win score 0.656, 52.9 at r = 0.5 ({_TEST})"),
    "topk_min_h": ("measured", "the decomposition's allocation step: loses the 2k needle at r = 0.25"),
    "expected_attention_adaptive": ("rejected", "AdaKV is far ahead at r = 0.75: -35.7 [-51.1, -20.2] "
                                    "(the allocation stays near uniform)"),
    "knorm_adaptive": ("measured", "+20.8 [+6.8, +34.8] over adakv_knorm at r = 0.25 (32 test examples)"),
    "hybrid_keydiff_block8_a90": ("measured", "round 1's RECOMMENDED_RETRIEVAL: best RULER q among equal-memory presses on dev "
                                  "(0.707), prose q 0.154, recall q 0.051 (results/rule/dev-maximin.md); before: "
                                  "first on RULER dev (win 0.809); 33rd of 40 "
                                  "on prose dev (KL 2.82x h2o at r = 0.5, 7 windows); results/rule/dev-rule.md"),
    "prob_min_h_priority": ("measured", "the previous RECOMMENDED (two-regime rule); holds 1.13x top-k's bytes "
                            "(padding): no candidate under the maximin rule. First on prose dev (win 0.938; KL 0.68x "
                            "topk_min_h at r = 0.75, 7 windows); RULER dev win 0.405; results/rule/dev-rule.md"),
    "hybrid_tova_block8_a50": ("measured", "RULER dev win 0.567, prose dev 0.527 (results/rule/dev-rule.md)"),
    "hybrid_tova_block8_a90": ("measured", "RULER dev win 0.634, prose dev 0.256 (results/rule/dev-rule.md)"),
    "hybrid_keydiff_block8_a75": ("measured", "dev mean 42.3 (8 examples)"),
    "keydiff_sum4": ("measured", "+5.5 [-3.2, +14.2] over keydiff at r = 0.5, -2.3 [-5.6, +1.0] at 0.75 (29 test ex)"),
    "tova_sum4": ("measured", "every answer the same as tova's (29 test examples)"),
    "knorm_sum4": ("measured", "+8.0 [-1.9, +18.0] over knorm at r = 0.5 (29 test examples)"),
    "keydiff_sum64": ("rejected", "64 entries raise the KL (0.056 vs 0.046 at r = 0.5, 4 dev examples)"),
    "prob_keydiff_block8_priority_rank": ("measured", "dev mean 39.8, second to the hybrids; 6 test examples only"),
    "prob_keydiff_block8_priority_ent": ("rejected", "the entropy-matched softmax sharpens onto keys that are not "
                                         "the needle (needle share 0.49x uniform; dev mean 27.1)"),
    "prob_expected_attention_block8_priority_ent": ("rejected", "screened out without decoding: needle share "
                                                    "0.34x uniform"),
    **{f"keydiff_sum{c}_seg": ("rejected", "position segments do worse than k-means (error 0.209 vs 0.199 at "
                               "r = 0.5)") for c in (1, 4, 16, 64)},
    **{f"keydiff_sum{c}_tau{t}": ("rejected", "no tempered weight did better: tau = 0.5 gave the answers of tau = 1")
       for c in (4, 16) for t in (0.5, 0.1)},
    **{name: ("unmeasured", _UNMEASURED) for name in (
        "topk_keydiff_span8_nowiden", "topk_tova_span8_nowiden", "prob_keydiff", "prob_lagkv", "prob_min_shared",
        "prob_min_h_w64", "prob_tova_threshold_s4_head", "prob_knorm_priority",
        "prob_keydiff_threshold", "prob_expected_attention_threshold", "prob_expected_attention_block8",
        "prob_keydiff_block8",
        "hybrid_expected_attention_block8_a50", "hybrid_expected_attention_block8_a90",
        "hybrid_keydiff_block8_a75_threshold", "tova_sum1", "tova_sum64", "knorm_sum1", "knorm_sum16",
        "knorm_sum64", "tova_sum4_tau0.5", "tova_sum4_tau0.1", "tova_sum16_tau0.5", "tova_sum16_tau0.1",
        "knorm_sum4_tau0.5", "knorm_sum4_tau0.1", "knorm_sum16_tau0.5", "knorm_sum16_tau0.1",
        "topk_tova_block8_sum4", "hybrid_keydiff_block8_a75_global_sum4")},
    **{name: ("measured", "1 development example (stopped for compute)") for name in (
        "hybrid_keydiff_block8_a50", "hybrid_keydiff_block8_a75_global", "hybrid_tova_block8_a75",
        "hybrid_expected_attention_block8_a75")},
    **{f"prob_{p}_nocorr": ("measured", "the correction's step: -1.0 to +5.9 points, every interval containing 0 "
                            "(decomposition, dev)") for p in PAPER_PROPOSALS},
}


@dataclass(frozen=True)
class Entry:
    name: str
    parts: Parts | None  # None for a NAMED press
    origin: str
    family: str
    status: str
    finding: str
    docs: str


def origin_of(parts: Parts) -> str:
    return FAMILIES[family_of(parts)].origin


def entries() -> dict[str, Entry]:
    """Every registered press by name, in ``REGISTERED`` order, then ``NAMED``."""
    out = {}
    for parts in REGISTERED:
        name, family = press_name(parts), FAMILIES[family_of(parts)]
        status, finding = STATUS.get(name, (family.status, family.finding))
        out[name] = Entry(name, parts, family.origin, family.name, status, finding, family.docs)
    for name, (_, origin, family) in NAMED.items():
        fam = FAMILIES[family]
        status, finding = STATUS.get(name, (fam.status, fam.finding))
        out[name] = Entry(name, None, origin, family, status, finding, fam.docs)
    return out
