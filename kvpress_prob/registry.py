"""Named presses for the evaluation harness: ``get_press(name, compression_ratio, **overrides)``.

Top-k baselines (kvpress): streaming_llm, snapkv, tova, h2o (ObservedAttentionPress, run on eager
attention, switched and restored by the press), knorm, adakv_snapkv (AdaKV over SnapKV).
Probabilistic (SamplingPress): prob_<baseline> sample from the baseline's scores (prob_h2o from
the same cumulative attention recomputed on sdpa), prob_min / prob_min_h (pi_min, pi_min-h),
prob_h2o_h; each of these (and the beyond-the-paper ones below) has an uncorrected ablation
``<name>_nocorr``; for any other sampling press pass ``correct=False``.
topk_min_h: pi_min-h kept by top-k under the same global allocation (TopKSampler).
Head-adaptive top-k that frees memory (``ADAPTIVE``): <scorer>_adaptive for snapkv, tova, knorm, keydiff,
expected_attention, lagkv, next to kvpress's AdaKV over the same scorer (adakv_<scorer>, which masks).
Beyond the paper: prob_min_c (pi_min centred), prob_min_h_strata (alpha = 0.5), prob_min_h_coord
(coordinated sampling), prob_min_h_shared (one proposal shared by a layer's heads),
prob_snapkv_strata (alpha = 0.5), prob_min_h_ht and prob_snapkv_ht (Horvitz-Thompson weights 1 / q_i).
Stronger kvpress top-k baselines (``STRONGER``): expected_attention (under AdaKV, as kvpress's own
evaluation registry runs it), keydiff, lagkv, adakv_<tova|knorm|keydiff|lagkv>.
prob_min_h_s256: pi_min-h estimated from 256 sampled query rows (sub-quadratic; ``SampledMinVarianceProposal``).
Sampling designs beyond the paper's draws (``_DESIGNS``): threshold (pi-ps), priority and block
(cluster) samplers over several proposals, sharpened proposals; topk_<proposal>_block8/16 are the
block designs' deterministic twins (top-k over blocks). ``RECOMMENDED`` names the probabilistic press
chosen on the development split (docs/protocol.md, "Splits").
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from kvpress import (
    AdaKVPress,
    BasePress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    LagKVPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)

from kvpress_prob.calibration import CalibratedProposal
from kvpress_prob.h2o import EagerObservedAttentionPress
from kvpress_prob.press import SamplingPress
from kvpress_prob.proposals import H2OProposal, MinVarianceProposal, SampledMinVarianceProposal, ScoreProposal
from kvpress_prob.samplers import PoissonSampler, Sampler, TopKSampler
from kvpress_prob.samplers.block import BlockSampler
from kvpress_prob.samplers.priority import PrioritySampler
from kvpress_prob.samplers.stratified import StratifiedSampler
from kvpress_prob.samplers.threshold import ThresholdSampler
from kvpress_prob.summary import Summary, summarised
from kvpress_prob.spans import SpanPress, SpanSampler


def _sampling(proposal_factory: Callable, sampler_factory: Callable = PoissonSampler,
              **press_kwargs) -> Callable[[float], SamplingPress]:
    return lambda ratio: SamplingPress(proposal=proposal_factory(), sampler=sampler_factory(),
                                       compression_ratio=ratio, **press_kwargs)


def _poisson(**sampler_kwargs) -> Callable[[], PoissonSampler]:
    return lambda: PoissonSampler(**sampler_kwargs)


def _uncorrected(factory: Callable[[float], SamplingPress]) -> Callable[[float], SamplingPress]:
    return lambda ratio: replace(factory(ratio), correct=False)


#: Sampling designs by name; ``get_press(..., sampler="topk")`` builds one with its defaults.
SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "poisson": PoissonSampler,
    "topk": TopKSampler,
    "threshold": ThresholdSampler,
    "priority": PrioritySampler,
    "block": BlockSampler,
    "stratified": StratifiedSampler,
}

BASELINES: dict[str, Callable[[float], BasePress]] = {
    "streaming_llm": lambda r: StreamingLLMPress(compression_ratio=r),
    "snapkv": lambda r: SnapKVPress(compression_ratio=r),
    "tova": lambda r: TOVAPress(compression_ratio=r),
    "h2o": lambda r: EagerObservedAttentionPress(compression_ratio=r),
    "knorm": lambda r: KnormPress(compression_ratio=r),
}

#: Stronger query-agnostic top-k baselines from kvpress that run offline on a CPU.
STRONGER: dict[str, Callable[[float], BasePress]] = {
    # kvpress's own evaluation registry runs ExpectedAttention under AdaKV
    "expected_attention": lambda r: AdaKVPress(press=ExpectedAttentionPress(compression_ratio=r, epsilon=1e-2)),
    "keydiff": lambda r: KeyDiffPress(compression_ratio=r),
    "lagkv": lambda r: LagKVPress(compression_ratio=r),
    **{f"adakv_{name}": (lambda r, cls=cls: AdaKVPress(press=cls(compression_ratio=r)))
       for name, cls in [("tova", TOVAPress), ("knorm", KnormPress), ("keydiff", KeyDiffPress),
                         ("lagkv", LagKVPress)]},
}


def _tova():
    return ScoreProposal(scorer=TOVAPress())


def _knorm():
    return ScoreProposal(scorer=KnormPress())


def _keydiff():
    return ScoreProposal(scorer=KeyDiffPress())


def _expected_attention():
    return ScoreProposal(scorer=ExpectedAttentionPress(epsilon=1e-2))

_PROB: dict[str, Callable[[float], SamplingPress]] = {
    "prob_streaming_llm": _sampling(lambda: ScoreProposal(scorer=StreamingLLMPress())),
    "prob_snapkv": _sampling(lambda: ScoreProposal(scorer=SnapKVPress())),
    "prob_tova": _sampling(lambda: ScoreProposal(scorer=TOVAPress())),
    "prob_h2o": _sampling(lambda: H2OProposal(harmonic=False)),
    "prob_knorm": _sampling(lambda: ScoreProposal(scorer=KnormPress())),
    "prob_min": _sampling(lambda: MinVarianceProposal(harmonic=False)),
    "prob_min_h": _sampling(lambda: MinVarianceProposal(harmonic=True)),
    "prob_h2o_h": _sampling(lambda: H2OProposal(harmonic=True)),
    # beyond the paper
    "prob_min_c": _sampling(lambda: MinVarianceProposal(harmonic=False, centred=True)),
    "prob_min_h_strata": _sampling(lambda: MinVarianceProposal(harmonic=True), _poisson(alpha=0.5)),
    "prob_min_h_coord": _sampling(lambda: MinVarianceProposal(harmonic=True), _poisson(coordinated=True)),
    "prob_min_h_shared": _sampling(lambda: MinVarianceProposal(harmonic=True, head_shared=True)),
    "prob_snapkv_strata": _sampling(lambda: ScoreProposal(scorer=SnapKVPress()), _poisson(alpha=0.5)),
    "prob_min_h_ht": _sampling(lambda: MinVarianceProposal(harmonic=True), _poisson(inclusion_weights=True)),
    "prob_snapkv_ht": _sampling(lambda: ScoreProposal(scorer=SnapKVPress()), _poisson(inclusion_weights=True)),
}

#: Proposals and sampling designs beyond the paper (their uncorrected ablation is ``correct=False``).
_DESIGNS: dict[str, Callable[[float], SamplingPress]] = {
    # proposals the paper lacks
    "prob_expected_attention": _sampling(_expected_attention),
    "prob_keydiff": _sampling(_keydiff),
    "prob_lagkv": _sampling(lambda: ScoreProposal(scorer=LagKVPress())),
    "prob_min_shared": _sampling(lambda: MinVarianceProposal(harmonic=False, head_shared=True)),
    "prob_min_h_w64": _sampling(lambda: MinVarianceProposal(harmonic=True, query_window=64)),
    # pi_min-h from 256 sampled query rows, O(s n): s chosen on the development split (docs/method.md)
    "prob_min_h_s256": _sampling(lambda: SampledMinVarianceProposal(query_rows=256)),
    # sampling designs beyond draws with replacement
    "prob_tova_threshold": _sampling(_tova, ThresholdSampler),
    "prob_tova_priority": _sampling(_tova, PrioritySampler),
    "prob_tova_threshold_s4": _sampling(lambda: ScoreProposal(scorer=TOVAPress(), sharpness=4.0), ThresholdSampler),
    "prob_tova_priority_s4": _sampling(lambda: ScoreProposal(scorer=TOVAPress(), sharpness=4.0), PrioritySampler),
    "prob_tova_threshold_floor": _sampling(_tova, lambda: ThresholdSampler(min_keep=0.5)),
    "prob_tova_threshold_s4_head": _sampling(lambda: ScoreProposal(scorer=TOVAPress(), sharpness=4.0),
                                             ThresholdSampler, budget="head"),
    "prob_tova_priority_s4_head": _sampling(lambda: ScoreProposal(scorer=TOVAPress(), sharpness=4.0),
                                            PrioritySampler, budget="head"),
    "prob_knorm_threshold": _sampling(_knorm, ThresholdSampler),
    "prob_knorm_priority": _sampling(_knorm, PrioritySampler),
    "prob_min_h_threshold": _sampling(lambda: MinVarianceProposal(harmonic=True), ThresholdSampler),
    "prob_min_h_priority": _sampling(lambda: MinVarianceProposal(harmonic=True), PrioritySampler),
    # block (cluster) designs: neighbouring positions kept or evicted together
    "prob_tova_block8": _sampling(_tova, lambda: BlockSampler(size=8)),
    "prob_tova_block16": _sampling(_tova, lambda: BlockSampler(size=16)),
    "prob_tova_block8_priority": _sampling(_tova, lambda: BlockSampler(size=8, inner=PrioritySampler()), budget="head"),
    "prob_knorm_block8": _sampling(_knorm, lambda: BlockSampler(size=8)),
    "prob_min_h_block8": _sampling(lambda: MinVarianceProposal(harmonic=True), lambda: BlockSampler(size=8)),
    "prob_keydiff_threshold": _sampling(_keydiff, ThresholdSampler),
    "prob_keydiff_block8": _sampling(_keydiff, lambda: BlockSampler(size=8)),
    "prob_expected_attention_threshold": _sampling(_expected_attention, ThresholdSampler),
    "prob_expected_attention_block8": _sampling(_expected_attention, lambda: BlockSampler(size=8)),
}

def _with_summary(factory: Callable[[float], BasePress], **summary) -> Callable[[float], BasePress]:
    return lambda ratio: summarised(factory(ratio), Summary(**summary))


def _hybrid(proposal_factory: Callable, alpha: float, design: str = "priority", budget: str = "head"):
    return _sampling(proposal_factory, lambda: BlockSampler(size=8, inner=StratifiedSampler(alpha=alpha, design=design)),
                     budget=budget)


_TOPK_BLOCK8 = {
    "topk_tova_block8": _sampling(_tova, lambda: BlockSampler(size=8, inner=TopKSampler()), budget="head"),
    "topk_keydiff_block8": _sampling(_keydiff, lambda: BlockSampler(size=8, inner=TopKSampler()), budget="head"),
}

#: Stratified hybrids (issue 16): blocks of 8, each head's top alpha of its allocation exactly, the rest
#: sampled (priority unless named) with HT weights; a per-head budget unless named ``_global``.
HYBRIDS: dict[str, Callable[[float], SamplingPress]] = {
    **{f"hybrid_{name}_block8_a{int(alpha * 100)}": _hybrid(proposal, alpha)
       for name, proposal in [("keydiff", _keydiff), ("tova", _tova), ("expected_attention", _expected_attention)]
       for alpha in (0.5, 0.75, 0.9)},
    "hybrid_keydiff_block8_a75_threshold": _hybrid(_keydiff, 0.75, design="threshold"),
    "hybrid_keydiff_block8_a75_global": _hybrid(_keydiff, 0.75, budget="global"),
}

#: Evicted-set summaries (issue 16; ``kvpress_prob.summary``): ``<press>_sum<c>`` keeps c fewer real entries
#: per head and stores c virtual ones (k-means of the evicted keys; ``_seg``: position segments), log-weight
#: log(tau count) with tau = 1 unless named ``_tau<tau>``.
SUMMARIES: dict[str, Callable[[float], BasePress]] = {
    **{f"{name}_sum{c}": _with_summary(STRONGER.get(name) or BASELINES[name], n_virtual=c)
       for name in ("keydiff", "tova", "knorm") for c in (1, 4, 16, 64)},
    **{f"keydiff_sum{c}_seg": _with_summary(STRONGER["keydiff"], n_virtual=c, grouping="segments") for c in (1, 4, 16, 64)},
    **{f"{name}_sum{c}_tau{tau}": _with_summary(STRONGER.get(name) or BASELINES[name], n_virtual=c, weight=tau)
       for name in ("keydiff", "tova", "knorm") for c in (4, 16) for tau in (0.5, 0.1)},
    **{f"{name}_sum4": _with_summary(factory, n_virtual=4) for name, factory in _TOPK_BLOCK8.items()},
    **{f"{name}_sum4": _with_summary(HYBRIDS[name], n_virtual=4)
       for name in ("hybrid_keydiff_block8_a75", "hybrid_keydiff_block8_a75_global")},
}

#: Head-adaptive top-k that frees memory, one per kvpress scorer we register, named after the kvpress press
#: it adapts (``snapkv_adaptive`` next to ``snapkv``): the scorer's scores as a proposal, each layer's
#: budget (1 - r) n H_kv shared by its heads (``budget="layer"``, chosen on the development split: the
#: global budget starves mid layers, README "Decomposition"), each head keeping its top k_h, and only
#: the kept entries stored (padded to the layer's largest head). kvpress's ``AdaKVPress`` (``adakv_*``)
#: adapts the same way but masks, and frees no memory.
ADAPTIVE: dict[str, Callable[[float], SamplingPress]] = {
    f"{name}_adaptive": _sampling(lambda scorer=scorer: ScoreProposal(scorer=scorer()), TopKSampler, budget="layer")
    for name, scorer in [("snapkv", SnapKVPress), ("tova", TOVAPress), ("knorm", KnormPress),
                         ("keydiff", KeyDiffPress), ("expected_attention", lambda: ExpectedAttentionPress(epsilon=1e-2)),
                         ("lagkv", LagKVPress)]
}


def _calibrated(scorer: Callable, calibration: str) -> Callable[[], CalibratedProposal]:
    return lambda: CalibratedProposal(scorer=scorer(), calibration=calibration)


def _block8_priority() -> BlockSampler:
    return BlockSampler(size=8, inner=PrioritySampler())


def _span(proposal_factory: Callable, inner: str, widen: int = 1) -> Callable[[float], SpanPress]:
    return lambda ratio: SpanPress(proposal=proposal_factory(), sampler=SpanSampler(inner=inner, widen=widen),
                                   compression_ratio=ratio, budget="head")


#: Calibrated proposals (score -> pi by rank or by an entropy-matched softmax) and span-aware units
#: (word-aligned blocks of up to 8 tokens, kept spans widened by one token); README, "Calibrated
#: proposals, span-aware units, and an attention measure that predicts answers".
_CALIBRATED: dict[str, Callable[[float], SamplingPress]] = {
    "prob_keydiff_block8_priority": _sampling(_keydiff, _block8_priority, budget="head"),
    "prob_keydiff_block8_priority_rank": _sampling(_calibrated(KeyDiffPress, "rank"), _block8_priority, budget="head"),
    "prob_keydiff_block8_priority_ent": _sampling(_calibrated(KeyDiffPress, "entropy"), _block8_priority,
                                                  budget="head"),
    "prob_expected_attention_block8_priority": _sampling(_expected_attention, _block8_priority, budget="head"),
    "prob_expected_attention_block8_priority_ent": _sampling(
        _calibrated(lambda: ExpectedAttentionPress(epsilon=1e-2), "entropy"), _block8_priority, budget="head"),
    "prob_tova_span8_priority": _span(_tova, "priority"),
    "prob_keydiff_span8_priority_ent": _span(_calibrated(KeyDiffPress, "entropy"), "priority"),
}

PRESSES: dict[str, Callable[[float], BasePress]] = {
    **BASELINES,
    **STRONGER,
    "adakv_snapkv": lambda r: AdaKVPress(press=SnapKVPress(compression_ratio=r)),
    "topk_min_h": _sampling(lambda: MinVarianceProposal(harmonic=True), TopKSampler),
    # the deterministic twins of the block designs: top-k over blocks, kvpress's count per head
    "topk_tova_block8": _sampling(_tova, lambda: BlockSampler(size=8, inner=TopKSampler()), budget="head"),
    "topk_tova_block16": _sampling(_tova, lambda: BlockSampler(size=16, inner=TopKSampler()), budget="head"),
    "topk_knorm_block8": _sampling(_knorm, lambda: BlockSampler(size=8, inner=TopKSampler()), budget="head"),
    "topk_keydiff_block8": _sampling(_keydiff, lambda: BlockSampler(size=8, inner=TopKSampler()), budget="head"),
    # span-aware twins: word-aligned units, kept spans widened by one token (nowiden: not widened)
    "topk_keydiff_span8": _span(_keydiff, "topk"),
    "topk_tova_span8": _span(_tova, "topk"),
    "topk_keydiff_span8_nowiden": _span(_keydiff, "topk", widen=0),
    "topk_tova_span8_nowiden": _span(_tova, "topk", widen=0),
    **_PROB,
    **_DESIGNS,
    **ADAPTIVE,
    **HYBRIDS,
    **SUMMARIES,
    **_CALIBRATED,
    **{f"{name}_nocorr": _uncorrected(factory) for name, factory in _PROB.items()},
}


#: The probabilistic press we recommend, chosen on the development split only (RULER data seed 0, 1024
#: tokens, 8 examples) by the rule in ``results/dev/recommended.md``, fixed before the new designs' test
#: runs: the sampling press with the highest mean score over r = 0.25, 0.5, 0.75, 0.9 (3 seeds). Until
#: this session it was ``prob_tova_block8_priority`` (chosen over r = 0.1 ... 0.75 on the same split).
RECOMMENDED = "hybrid_keydiff_block8_a90"


def _init_fields(obj) -> set[str]:
    return {f.name for f in fields(obj) if f.init}


def get_press(name: str, compression_ratio: float, **overrides) -> BasePress:
    """The press registered as ``name`` at ``compression_ratio``, with dataclass fields overridden.

    An override names a field of the press (``seed=3``, ``temperature=2.0``, ``budget="layer"``),
    of its sampler (``alpha=0.5``) or of its proposal (``chunk_size=256``, ``floor=0.05``); a name
    that more than one of them has is refused, pass a whole ``sampler=`` or ``proposal=`` instead.
    ``sampler`` may be a name of ``SAMPLERS``; sampler fields then apply to the new sampler.
    """
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; valid names: {', '.join(sorted(PRESSES))}")
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1), got {compression_ratio}")
    press = PRESSES[name](compression_ratio)
    if not overrides:
        return press
    if isinstance(overrides.get("sampler"), str):
        if overrides["sampler"] not in SAMPLERS:
            raise ValueError(f"unknown sampler {overrides['sampler']!r}; valid: {', '.join(sorted(SAMPLERS))}")
        overrides["sampler"] = SAMPLERS[overrides["sampler"]]()
    if "sampler" in overrides or "proposal" in overrides:
        whole = {key: overrides.pop(key) for key in ("sampler", "proposal") if key in overrides}
        press = replace(press, **whole)
        if not overrides:
            return press
    parts = {"press": press}
    if isinstance(press, SamplingPress):
        parts |= {"sampler": press.sampler, "proposal": press.proposal}
    owners: dict[str, dict] = {part: {} for part in parts}
    for key, value in overrides.items():
        having = [part for part, obj in parts.items() if key in _init_fields(obj)]
        if not having:
            valid = sorted(set().union(*(_init_fields(obj) for obj in parts.values())))
            raise ValueError(f"press {name!r} has no field {key!r}; valid: {valid}")
        if len(having) > 1:
            raise ValueError(f"field {key!r} of press {name!r} is ambiguous (a field of {' and '.join(having)})")
        owners[having[0]][key] = value
    inner = {part: replace(parts[part], **owners[part]) for part in ("sampler", "proposal") if owners.get(part)}
    return replace(press, **owners["press"], **inner)


def is_sampling(name: str, **overrides) -> bool:
    """Whether the named press (with these ``get_press`` overrides) samples: its result depends on the seed."""
    press = get_press(name, 0.5, **overrides)
    return isinstance(press, SamplingPress) and press.sampler.random
