"""Press names as a grid: ``Parts(kind, proposal, unit, design, options)`` <-> a name <-> a press.

A name is written ``[prefix_]<proposal>[_<unit>][_<design>][_<option>...]`` (``press_name``), read
back by ``parse_name`` and built by ``build``. The kinds of name and their prefixes:

- ``kvpress``: kvpress's own top-k press over a scorer, named by the scorer (``snapkv``, ``h2o``);
  ``adakv``: kvpress's ``AdaKVPress`` around it (``adakv_tova``). kvpress's evaluation runs
  ExpectedAttention under AdaKV, so ``expected_attention`` is that and ``adakv_expected_attention``
  is not a second name for it.
- ``prob``: ``SamplingPress`` sampling from a proposal (``prob_min_h``, ``prob_tova_block8_priority``).
- ``topk``: the same proposal and unit kept by top-k (``topk_keydiff_block8``).
- ``adaptive``: head-adaptive top-k that frees memory, one budget per layer (``snapkv_adaptive``).
- ``hybrid``: blocks, each head's top ``a<percent>`` of its allocation kept exactly, the rest sampled
  (``hybrid_keydiff_block8_a90``).
- ``cross``: cross-proposal hybrids (``kvpress_prob.samplers.cross``): the ``a<percent>`` share of each head's
  budget kept exactly as the blocks with the largest scores of a kvpress scorer, the rest priority-sampled
  from pi_min-h with the correction (``cross_keydiff_block8_a50``); always a per-head budget. With
  ``mix<k>`` the rest is sampled from the defensive mixture (1 - k/100) pi_min-h + k/100 * the scorer's
  rank-calibrated scores (``kvpress_prob.samplers.mixture``; ``a0`` is a pure mixture, ``tblock`` samples it in
  blocks, ``peak<k>`` keeps top-k in heads whose scores are peaked): ``cross_kvzip_block8_a50_mix50_layers``.

kvpress's ``KVzipPress`` is the kvpress-kind name ``kvzip`` (it masks, as AdaKV does, and frees nothing), built as
``BoundedKVzipPress`` (its scores at bounded memory, kept per model, its refusals on entry: ``presses.kvzip_scoring``);
the proposal ``kvzip`` is its reconstruction scores kept by our designs with real eviction
(``kvpress_prob.presses.kvzip``: ``topk_kvzip_head`` is its equal-memory twin).
The proposal ``uniform`` is random eviction's: ``prob_uniform_priority_head`` is uniform random
per-head eviction at kvpress's per-head count.

Units: ``token`` (unwritten), ``block<k>`` (``BlockSampler``), ``span<k>`` (word-aligned, ``SpanPress``).
Designs (``prob``): ``poisson`` (the paper's draws; unwritten on tokens), ``threshold`` (unwritten on
blocks), ``priority``. Options, always written in ``OPTIONS`` order, each one field: see ``OPTIONS``.
The per-head budget is the default where a unit is kept whole by a fixed count per head (blocks or
spans under priority, top-k or a hybrid); elsewhere the paper's global budget. A name whose every
part is valid builds, shipped or not; a wrong part is refused with the valid ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from kvpress import (AdaKVPress, BasePress, ExpectedAttentionPress, KeyDiffPress, KnormPress, LagKVPress, SnapKVPress,
                     StreamingLLMPress, TOVAPress)

from kvpress_prob.proposals.calibrated import CalibratedProposal
from kvpress_prob.samplers.cross import CrossStratifiedSampler, CrossTopSampler
from kvpress_prob.proposals.pairs import PairProposal, UniformProposal
from kvpress_prob.presses.h2o import EagerObservedAttentionPress
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.kvzip_scoring import BoundedKVzipPress
from kvpress_prob.presses.ragged_presses import KVzipRaggedPress, RaggedAdaKVPress, RaggedSamplingPress
from kvpress_prob.samplers.mixture import MixtureSampler
from kvpress_prob.presses.sampling import SamplingPress
from kvpress_prob.proposals.attention import H2OProposal, MinVarianceProposal, SampledMinVarianceProposal
from kvpress_prob.proposals.base import Proposal, ScoreProposal
from kvpress_prob.samplers import PoissonSampler, Sampler, TopKSampler
from kvpress_prob.samplers.block import BlockSampler
from kvpress_prob.samplers.priority import PrioritySampler
from kvpress_prob.samplers.stratified import StratifiedSampler
from kvpress_prob.samplers.threshold import ThresholdSampler
from kvpress_prob.presses.spans import SpanPress
from kvpress_prob.samplers.spans import SpanSampler
from kvpress_prob.presses.summary import Summary, summarised

#: kvpress scorers by name: the class with our settings (``compression_ratio`` is given when built).
SCORERS: dict[str, Callable[..., BasePress]] = {
    "streaming_llm": StreamingLLMPress,
    "snapkv": SnapKVPress,
    "tova": TOVAPress,
    "knorm": KnormPress,
    "keydiff": KeyDiffPress,
    "expected_attention": partial(ExpectedAttentionPress, epsilon=1e-2),
    "lagkv": LagKVPress,
}

#: Proposals by name: every kvpress scorer's scores (``ScoreProposal``) and the paper's own.
PROPOSALS: dict[str, Callable[[], Proposal]] = {
    **{name: (lambda scorer=scorer: ScoreProposal(scorer=scorer())) for name, scorer in SCORERS.items()},
    "h2o": lambda: H2OProposal(harmonic=False),
    "h2o_h": lambda: H2OProposal(harmonic=True),
    "min": lambda: MinVarianceProposal(harmonic=False),
    "min_h": lambda: MinVarianceProposal(harmonic=True),
    "min_h_s256": lambda: SampledMinVarianceProposal(query_rows=256),  # 256 sampled query rows, O(s n)
    "uniform": UniformProposal,  # random eviction's (kvpress_prob.samplers.cross)
    "kvzip": UniformProposal,  # placeholder: KVzip's scores come from its reconstruction pass (kvpress_prob.presses.kvzip)
}

#: kvpress presses named by kind ``kvpress`` that are not scorers (no proposal of that name).
KVPRESS_OTHER: dict[str, Callable[..., BasePress]] = {"kvzip": BoundedKVzipPress}

KINDS = ("kvpress", "adakv", "prob", "topk", "adaptive", "hybrid", "cross")
PREFIXES = {"adakv": "adakv_", "prob": "prob_", "topk": "topk_", "hybrid": "hybrid_", "cross": "cross_"}
#: kvpress's wrapper that a scorer's kvpress name already carries (kvpress's own evaluation registry).
KVPRESS_WRAPPED = {"expected_attention": "adakv"}

#: Designs of each kind: the first is written nowhere (the kind's or the unit's default).
DESIGNS = {"prob": ("poisson", "threshold", "priority"), "topk": ("topk",), "adaptive": ("topk",),
           "hybrid": ("stratified",), "cross": ("stratified",), "kvpress": ("topk",), "adakv": ("topk",)}
UNIT = re.compile(r"^(token|block(\d+)|span(\d+))$")

#: Options in the order they are written: (pattern, what it sets, which kinds may use it).
OPTIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "c": (r"c", "proposal centred=True (pi_min of |v_i - o|)", ("prob",)),
    "shared": (r"shared", "proposal head_shared=True (one proposal per layer)", ("prob",)),
    "w": (r"w(\d+)", "proposal query_window=<k> (the last k query rows)", ("prob",)),
    "s": (r"s(\d+)", "proposal sharpness=<k> (pi proportional to pi^k)", ("prob",)),
    "rank": (r"rank", "CalibratedProposal(calibration='rank'): pi by the scorer's rank", ("prob",)),
    "ent": (r"ent", "CalibratedProposal(calibration='entropy'): entropy-matched softmax", ("prob",)),
    "a": (r"a(\d+)", "StratifiedSampler alpha=<k>/100: the top share of each head kept exactly", ("hybrid", "cross")),
    "mix": (r"mix(\d+)", "MixtureSampler lam=<k>/100: the tail priority-sampled from the defensive mixture "
            "(1 - lam) pi_min-h + lam * the scorer's rank-calibrated scores (kvpress_prob.samplers.mixture)", ("cross",)),
    "tblock": (r"tblock", "MixtureSampler unit=<block size>: the mixture's tail sampled in blocks", ("cross",)),
    "peak": (r"peak(\d+)", "MixtureSampler peaked=<k>/100: a head whose scorer mass in its top k is >= k/100 keeps "
             "top-k blocks", ("cross",)),
    "toprest": (r"toprest", "CrossTopSampler: the rest of each head is pi_min-h's top, weight 1 (deterministic)",
                ("cross",)),
    "strata": (r"strata", "PoissonSampler alpha=0.5: the top half of each head's allocation kept", ("prob",)),
    "coord": (r"coord", "PoissonSampler coordinated=True: one uniform per position for all heads", ("prob",)),
    "ht": (r"ht", "PoissonSampler inclusion_weights=True: Horvitz-Thompson weights 1/q_i", ("prob",)),
    "floor": (r"floor", "ThresholdSampler min_keep=0.5: every head keeps half its share", ("prob",)),
    "threshold": (r"threshold", "StratifiedSampler design='threshold' for the sampled rest", ("hybrid",)),
    "nowiden": (r"nowiden", "SpanSampler widen=0: kept spans not widened by a token", ("prob", "topk")),
    "layers": (r"layers", "KVzip's allocation over layers, the same count in each head of a layer (kvzip only)",
               ("prob", "topk", "hybrid", "cross")),
    "widest": (r"widest", "the widest allocation (topk_kvzip_widest's widths per layer), sampled within (kvzip only)",
               ("cross",)),
    "ragged": (r"ragged", "stored in a ragged cache, each KV head its own count, no padding "
               "(kvpress_prob.presses.ragged_presses): prob, the draw at kvpress's count; cross (kvzip only), each "
               "head's count in KVzip's global top; adakv, AdaKV's allocation evicted for real",
               ("prob", "cross", "adakv")),
    "head": (r"head", "budget='head' (one budget per head)", ("prob", "topk", "hybrid")),
    "global": (r"global", "budget='global' (one budget for the model)", ("prob", "topk", "hybrid")),
    "nocorr": (r"nocorr", "correct=False: the same kept set, no SNIS correction", ("prob", "topk", "hybrid", "cross")),
    "sum": (r"sum(\d+)", "summary n_virtual=<V>: V virtual entries per KV head, charged to the budget", KINDS),
    "seg": (r"seg", "summary grouping='segments' (position segments, not k-means)", KINDS),
    "tau": (r"tau(\d+(?:\.\d+)?)", "summary weight=<tau>: log-weight log(tau count)", KINDS),
}
_ORDER = list(OPTIONS)


@dataclass(frozen=True)
class Parts:
    """What a name says: its kind, proposal (or scorer), unit, design and options (in ``OPTIONS`` order)."""

    kind: str
    proposal: str
    unit: str = "token"
    design: str = ""
    options: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.design:
            object.__setattr__(self, "design", default_design(self.kind, self.unit))


def default_design(kind: str, unit: str) -> str:
    if kind == "prob" and unit.startswith("block"):
        return "threshold"  # BlockSampler's default inner design
    if kind == "prob" and unit.startswith("span"):
        return ""  # written: priority or topk
    return DESIGNS.get(kind, ("",))[0]


def default_budget(parts: Parts) -> str:
    if parts.kind == "adaptive":
        return "layer"
    whole_units = parts.unit != "token" and parts.design in ("priority", "topk", "stratified")
    return "head" if whole_units or parts.unit.startswith("span") else "global"


def _option_key(token: str) -> str | None:
    for key, (pattern, _, _) in OPTIONS.items():
        if re.fullmatch(pattern, token):
            return key
    return None


def _valid_parts() -> str:
    return (f"kinds {list(KINDS)} (prefixes {PREFIXES}; adaptive: <scorer>_adaptive; kvpress: the "
            f"scorer's name or h2o); scorers {list(SCORERS)}; proposals {list(PROPOSALS)}; units token, "
            f"block<k>, span<k>; designs {DESIGNS['prob']} (prob); options, in this order: "
            + ", ".join(_shown(OPTIONS[k][0]) for k in _ORDER))


def _shown(pattern: str) -> str:
    return pattern.replace(r"(\d+(?:\.\d+)?)", "<t>").replace(r"(\d+)", "<k>")


def _refuse(name: str, why: str):
    raise ValueError(f"press name {name!r}: {why}. Valid parts: {_valid_parts()}")


def press_name(parts: Parts) -> str:
    """The one name of ``parts`` (defaults left unwritten)."""
    if parts.kind == "kvpress":
        head = parts.proposal
    elif parts.kind == "adaptive":
        head = f"{parts.proposal}_adaptive"
    else:
        head = PREFIXES[parts.kind] + parts.proposal
    words = [head]
    if parts.unit != "token":
        words.append(parts.unit)
    if parts.design != default_design(parts.kind, parts.unit):
        words.append(parts.design)
    return "_".join(words + list(parts.options))


def _names(kind: str):
    """The scorers or proposals a name of ``kind`` may start with."""
    return {"kvpress": [*SCORERS, "h2o", *KVPRESS_OTHER], "adakv": list(SCORERS), "adaptive": list(SCORERS),
            "cross": [*SCORERS, "kvzip"]}.get(kind, PROPOSALS)


def _longest(names, words: list[str]) -> str | None:
    """The longest of ``names`` that ``words`` start with (how a name is read)."""
    return max((p for p in names if words[: p.count("_") + 1] == p.split("_")), key=len, default=None)


def parse_name(name: str) -> Parts:
    """The parts of a press name; a ``ValueError`` naming the wrong part and listing the valid ones."""
    words = name.split("_")
    kind = next((f for f, p in PREFIXES.items() if name.startswith(p)), None)
    if kind is not None:
        words = words[1:]
    elif "adaptive" in words[1:]:
        kind = "adaptive"
    else:
        kind = "kvpress"
    names = _names(kind)
    proposal = _longest(names, words)
    if proposal is None:
        _refuse(name, f"{'_'.join(words)!r} starts with no {'scorer' if names is not PROPOSALS else 'proposal'} "
                      f"of kind {kind!r}")
    tail = words[proposal.count("_") + 1:]
    if kind == "adaptive":
        if tail[:1] != ["adaptive"]:
            _refuse(name, "an adaptive press is named <scorer>_adaptive")
        tail = tail[1:]
    unit = tail.pop(0) if tail and UNIT.match(tail[0]) and tail[0] != "token" else "token"
    design = ""
    if tail and tail[0] in DESIGNS[kind]:
        design = tail.pop(0)
        if design == default_design(kind, unit):
            _refuse(name, f"design {design!r} is the default of kind {kind!r} on {unit!r}: leave it out")
    unknown = [w for w in tail if _option_key(w) is None]
    if unknown:
        _refuse(name, f"unknown part(s) {unknown} after {proposal!r}")
    parts = Parts(kind, proposal, unit, design, tuple(tail))
    check(parts, name)
    return parts


def check(parts: Parts, name: str | None = None) -> None:
    """Refuse parts that name no press, or a press that another name already names."""
    name = name or press_name(parts)
    kind, keys = parts.kind, [_option_key(o) for o in parts.options]
    if None in keys:
        _refuse(name, f"unknown option in {list(parts.options)}")
    if keys != sorted(keys, key=_ORDER.index) or len(set(keys)) != len(keys):
        _refuse(name, f"options {list(parts.options)} out of order or repeated")
    for option, key in zip(parts.options, keys):
        if kind not in OPTIONS[key][2]:
            _refuse(name, f"option {option!r} does not apply to kind {kind!r}")
    read = _longest(_names(kind), press_name(parts).removeprefix(PREFIXES.get(kind, "")).split("_"))
    if read != parts.proposal:  # e.g. min_h + s256 is written prob_min_h_s256, the name of proposal min_h_s256
        _refuse(name, f"proposal {parts.proposal!r} with options {list(parts.options)} is written like proposal "
                      f"{read!r}, so the name would read back as another press; build this one directly "
                      f"(SamplingPress(proposal=..., sampler=...))")
    if kind in ("kvpress", "adakv", "adaptive") and parts.unit != "token":
        _refuse(name, f"kind {kind!r} keeps tokens, not {parts.unit!r}")
    if kind == "adakv" and KVPRESS_WRAPPED.get(parts.proposal) == "adakv" and "ragged" not in keys:
        _refuse(name, f"{parts.proposal!r} already runs under AdaKV")
    if kind in ("hybrid", "cross") and (not parts.unit.startswith("block") or "a" not in keys):
        _refuse(name, f"a {kind} press needs a block unit and an a<percent> option")
    if kind == "cross" and (parts.proposal not in [*SCORERS, "kvzip"] or not 0 <= int(_value(parts, "a")) <= 100):
        _refuse(name, "a cross press names a kvpress scorer (its exact set) and a<percent> in 0..100")
    if "toprest" in keys and {"mix", "nocorr"} & set(keys):
        _refuse(name, "toprest fills each head with a top-k (weight 1): no mix<k> tail to sample, nothing to correct")
    if {"tblock", "peak"} & set(keys) and "mix" not in keys:
        _refuse(name, "tblock and peak<k> are options of the mixture tail: add mix<k>")
    if "mix" in keys and not 0 <= int(_value(parts, "mix")) <= 100:
        _refuse(name, "mix<k> is the mixture weight lam in percent, 0..100")
    if "peak" in keys and not 0 < int(_value(parts, "peak")) <= 100:
        _refuse(name, "peak<k> is the peak share in percent, 1..100")
    if kind in ("kvpress", "adakv") and parts.proposal in KVPRESS_OTHER and (kind != "kvpress" or parts.options):
        _refuse(name, f"{parts.proposal!r} is kvpress's own press, named alone")
    if parts.proposal in ("uniform", "kvzip") and set(keys) & {"c", "shared", "w", "s", "rank", "ent", "sum", "seg",
                                                               "tau", "coord", "ht", "strata", "floor"}:
        _refuse(name, f"the {parts.proposal} proposal takes no proposal, draw or summary option")
    if "widest" in keys and (parts.proposal != "kvzip" or "layers" in keys):
        _refuse(name, "widest is KVzip's widest allocation: the kvzip proposal, without layers")
    if "ragged" in keys and (parts.unit.startswith("span") or {"sum", "layers", "widest"} & set(keys)
                             or (parts.proposal == "kvzip") != (kind == "cross")):
        _refuse(name, "ragged stores token or block draws of a sampling press (not the kvzip proposal: its ragged "
                      "designs are cross_kvzip_..._ragged), a cross press of kvzip, or AdaKV; no spans, summary, "
                      "layers or widest")
    if "layers" in keys and (parts.proposal != "kvzip" or {"head", "global"} & set(keys)):
        _refuse(name, "layers is KVzip's allocation over layers: the kvzip proposal, without a budget option")
    if parts.proposal == "kvzip" and parts.unit.startswith("span"):
        _refuse(name, "the kvzip proposal takes token or block units")
    if parts.unit.startswith("span") and parts.design not in ("priority", "topk"):
        _refuse(name, "span units take the priority design (written) or the topk kind")
    if parts.design not in DESIGNS[kind]:
        _refuse(name, f"design {parts.design!r} is not one of kind {kind!r}: {DESIGNS[kind]}")
    if kind == "prob" and parts.unit.startswith("span") and "nowiden" not in keys:
        _refuse(name, "priority over widened spans has biased weights: add _nowiden")
    if "nowiden" in keys and not parts.unit.startswith("span"):
        _refuse(name, "nowiden applies to span units")
    if {"rank", "ent"} <= set(keys) or (({"rank", "ent"} & set(keys)) and parts.proposal not in SCORERS):
        _refuse(name, "rank / ent calibrate one kvpress scorer's scores")
    if "sum" in keys and (kind == "adakv" or KVPRESS_WRAPPED.get(parts.proposal) and kind == "kvpress"):
        _refuse(name, "a summary wraps a kvpress scorer or a sampling press, not AdaKV")
    budget = [k for k in keys if k in ("head", "global")]
    if budget and (len(budget) > 1 or budget[0] == default_budget(parts)):
        _refuse(name, f"budget option {budget} repeats the default {default_budget(parts)!r} or conflicts")
    sampler_options = {"strata": "poisson", "coord": "poisson", "ht": "poisson", "floor": "threshold"}
    for key in keys:
        if key in sampler_options and (parts.design != sampler_options[key] or parts.unit != "token"):
            _refuse(name, f"option {key!r} applies to the {sampler_options[key]} design over tokens")


def _value(parts: Parts, key: str) -> str | None:
    for option in parts.options:
        match = re.fullmatch(OPTIONS[key][0], option)
        if match:
            return match.group(1) if match.groups() else option
    return None


def _proposal(parts: Parts) -> Proposal:
    calibration = {"rank": "rank", "ent": "entropy"}.get(next((o for o in parts.options if o in ("rank", "ent")), ""))
    if calibration:
        proposal = CalibratedProposal(scorer=SCORERS[parts.proposal](), calibration=calibration)
    else:
        proposal = PROPOSALS[parts.proposal]()
    fields = {"centred": _value(parts, "c") and True, "head_shared": _value(parts, "shared") and True,
              "query_window": _value(parts, "w") and int(_value(parts, "w")),
              "sharpness": _value(parts, "s") and float(_value(parts, "s"))}
    fields = {k: v for k, v in fields.items() if v is not None}
    missing = [k for k in fields if not hasattr(proposal, k)]
    if missing:
        raise ValueError(f"press {press_name(parts)!r}: proposal {parts.proposal!r} has no field {missing}")
    return replace(proposal, **fields) if fields else proposal


def _token_sampler(parts: Parts) -> Sampler:
    design = parts.design
    if design == "poisson":
        fields = {"alpha": 0.5 if _value(parts, "strata") else None, "coordinated": _value(parts, "coord") and True,
                  "inclusion_weights": _value(parts, "ht") and True}
        return PoissonSampler(**{k: v for k, v in fields.items() if v is not None})
    if design == "threshold":
        return ThresholdSampler(min_keep=0.5) if _value(parts, "floor") else ThresholdSampler()
    if design == "stratified":
        alpha = int(_value(parts, "a")) / 100
        return StratifiedSampler(alpha=alpha, design="threshold" if _value(parts, "threshold") else "priority")
    return {"priority": PrioritySampler, "topk": TopKSampler}[design]()


def _cross_sampler(parts: Parts) -> CrossStratifiedSampler:
    """A cross press's draw: ``CrossStratifiedSampler``, or with ``mix<k>`` a ``MixtureSampler``."""
    alpha, size = int(_value(parts, "a")) / 100, int(parts.unit[5:])
    if _value(parts, "toprest"):
        return CrossTopSampler(alpha=alpha, size=size)
    if not _value(parts, "mix"):
        return CrossStratifiedSampler(alpha=alpha, size=size)
    peak = _value(parts, "peak")
    return MixtureSampler(alpha=alpha, size=size, lam=int(_value(parts, "mix")) / 100,
                          unit=size if _value(parts, "tblock") else 1, peaked=int(peak) / 100 if peak else None)


def build(parts: Parts, compression_ratio: float) -> BasePress:
    """The press that ``parts`` name, at ``compression_ratio``."""
    check(parts)
    r = compression_ratio
    if parts.kind == "cross":
        sampler = _cross_sampler(parts)
    if parts.kind == "cross" and parts.proposal == "kvzip" and _value(parts, "ragged"):
        press = KVzipRaggedPress(compression_ratio=r, sampler=sampler, correct=not _value(parts, "nocorr"),
                                 tail=MinVarianceProposal(harmonic=True))
    elif parts.kind == "cross" and parts.proposal == "kvzip":
        press = KVzipSampledPress(compression_ratio=r, sampler=sampler, budget="head", correct=not _value(parts, "nocorr"),
                                  tail=MinVarianceProposal(harmonic=True), layers=bool(_value(parts, "layers")),
                                  widest=bool(_value(parts, "widest")))
    elif parts.kind == "cross":
        exact = ScoreProposal(scorer=SCORERS[parts.proposal]())
        press = SamplingPress(proposal=PairProposal(exact=exact), sampler=sampler, compression_ratio=r,
                              budget="head", correct=not _value(parts, "nocorr"))
    elif parts.kind in ("kvpress", "adakv") and parts.proposal in KVPRESS_OTHER:
        press = KVPRESS_OTHER[parts.proposal](compression_ratio=r)
    elif parts.kind in ("kvpress", "adakv"):
        if parts.proposal == "h2o":
            press = EagerObservedAttentionPress(compression_ratio=r)
        else:
            press = SCORERS[parts.proposal](compression_ratio=r)
        if parts.kind == "adakv" and _value(parts, "ragged"):
            press = RaggedAdaKVPress(press=press)
        elif parts.kind == "adakv" or KVPRESS_WRAPPED.get(parts.proposal) == "adakv":
            press = AdaKVPress(press=press)
    else:
        kwargs = {"compression_ratio": r}
        if parts.kind == "adaptive":
            kwargs["budget"] = "layer"
        elif (budget := _value(parts, "head") or _value(parts, "global") or default_budget(parts)) != "global":
            kwargs["budget"] = budget
        if _value(parts, "nocorr"):
            kwargs["correct"] = False
        if parts.unit.startswith("span"):
            widen = 0 if _value(parts, "nowiden") else 1
            sampler = SpanSampler(inner=parts.design, widen=widen)
            press = SpanPress(proposal=_proposal(parts), sampler=sampler, size=int(parts.unit[4:]), **kwargs)
        else:
            sampler = _token_sampler(parts)
            if parts.unit.startswith("block"):
                sampler = BlockSampler(size=int(parts.unit[5:]), inner=sampler)
            ragged = RaggedSamplingPress if _value(parts, "ragged") else SamplingPress
            press = ragged(proposal=_proposal(parts), sampler=sampler, **kwargs)
        if parts.proposal == "kvzip":
            press = KVzipSampledPress(compression_ratio=r, sampler=press.sampler, budget=press.budget,
                                      correct=press.correct, layers=bool(_value(parts, "layers")))
    if _value(parts, "sum"):
        summary = {"n_virtual": int(_value(parts, "sum"))}
        if _value(parts, "seg"):
            summary["grouping"] = "segments"
        if _value(parts, "tau"):
            summary["weight"] = float(_value(parts, "tau"))
        press = summarised(press, Summary(**summary))
    return press


def grid(kind: str, proposals, units=("token",), designs=("",), options=((),)) -> list[Parts]:
    """Every combination of the given parts, in order (each ``options`` item is a tuple of option words)."""
    return [Parts(kind, p, u, d, tuple(o)) for p in proposals for u in units for d in designs for o in options]
