"""Named presses: ``get_press(name, compression_ratio, **overrides)``.

Names are points of a grid, (kind x proposal x unit x design x options), written, read back and built by
``kvpress_prob.names.grid``; ``kvpress_prob.names.catalogue`` says which of them ship, with their origin
(kvpress / paper / ours) and status. ``kvprob presses`` prints them. ``PRESSES`` maps every shipped name to
its factory of the compression ratio, and also finds (``in``, ``[]``) any other name ``get_press`` builds:
a valid grid name (``prob_lagkv_block8``) or one of ``names.named``. An invalid name is refused with the
valid parts.

Families: kvpress's top-k presses by scorer name (``snapkv``, ``h2o``: ObservedAttentionPress on eager
attention) and under AdaKV (``adakv_<scorer>``; ``expected_attention`` is AdaKV's, as in kvpress's own
evaluation); the paper's sampling presses ``prob_<proposal>`` (pi_min, pi_min-h, H2O, a scorer's scores);
and ours: other proposals and draws, priority designs, blocks, their top-k twins ``topk_*``, head-adaptive
top-k ``<scorer>_adaptive``, stratified hybrids ``hybrid_*`` and ``cross_*``, evicted-set summaries
``*_sum<c>``, calibrated proposals ``*_rank``, and KVzip's allocations ``topk_kvzip_<allocation>``.
``RECOMMENDED`` names the press chosen on the three development splits by the maximin rule.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable

from kvpress import BasePress

from kvpress_prob.names.catalogue import Entry, entries
from kvpress_prob.names.decoding import DECODING_PRESSES
from kvpress_prob.names.grid import build, parse_name
from kvpress_prob.names.named import NAMED
from kvpress_prob.presses.kvzip import KVzipSampledPress
from kvpress_prob.presses.sampling import SamplingPress
from kvpress_prob.samplers import PoissonSampler, Sampler, TopKSampler
from kvpress_prob.samplers.block import BlockSampler
from kvpress_prob.samplers.priority import PrioritySampler
from kvpress_prob.samplers.stratified import StratifiedSampler
from kvpress_prob.samplers.threshold import ThresholdSampler

#: Sampling designs by name; ``get_press(..., sampler="topk")`` builds one with its defaults.
SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "poisson": PoissonSampler,
    "topk": TopKSampler,
    "threshold": ThresholdSampler,
    "priority": PrioritySampler,
    "block": BlockSampler,
    "stratified": StratifiedSampler,
}

#: Every shipped press: name -> entry (origin, family, status).
CATALOGUE: dict[str, Entry] = entries()


def _factory(name: str) -> Callable[[float], BasePress]:
    if name in NAMED:
        return NAMED[name]
    parts = CATALOGUE[name].parts
    return lambda ratio: build(parts, ratio)


def _where(**wanted) -> dict[str, Callable[[float], BasePress]]:
    return {name: PRESSES[name] for name, entry in CATALOGUE.items() if entry.parts is not None
            and all(getattr(entry.parts, key, None) == value for key, value in wanted.items())}


class Presses(dict):
    """The shipped presses, name -> factory of the compression ratio. A name it does not list but
    ``get_press`` builds (any valid grid name, or one of ``names.named``) is found too: ``name in
    PRESSES`` is whether it builds, ``PRESSES[name]`` its factory."""

    def __contains__(self, name) -> bool:
        if dict.__contains__(self, name):
            return True
        try:
            self[name]
        except (KeyError, ValueError):
            return False
        return True

    def __missing__(self, name):
        if name in NAMED:
            return NAMED[name]
        if not isinstance(name, str) or name in DECODING_PRESSES:
            raise KeyError(name)
        parts = parse_name(name)  # ValueError on an invalid name
        return lambda ratio: build(parts, ratio)


#: name -> factory of the compression ratio, for every shipped prefill press (decoding presses are built by
#: ``get_decoding_press``).
PRESSES: Presses = Presses({name: _factory(name) for name, entry in CATALOGUE.items()
                            if entry.family != "decoding" and entry.status != "learned"})
#: The paper's top-k baselines (kvpress).
BASELINES = {name: PRESSES[name] for name in ("streaming_llm", "snapkv", "tova", "h2o", "knorm")}
#: Stronger kvpress top-k baselines that run offline on a CPU.
STRONGER = {name: PRESSES[name] for name in ("expected_attention", "keydiff", "lagkv", "adakv_tova",
                                              "adakv_knorm", "adakv_keydiff", "adakv_lagkv")}
#: Head-adaptive top-k that frees memory (``<scorer>_adaptive``, one budget per layer).
ADAPTIVE = _where(kind="adaptive")
#: Stratified hybrids over blocks (``hybrid_*``).
HYBRIDS = {name: f for name, f in _where(kind="hybrid").items() if CATALOGUE[name].family == "hybrids"}
#: Evicted-set summaries (``*_sum<c>``).
SUMMARIES = {name: PRESSES[name] for name, entry in CATALOGUE.items() if entry.family == "summaries"}


#: The recommendations, chosen on the three development splits (RULER, prose, natural-text recall) at r = 0.5,
#: 0.75 and 0.9 by the maximin rule: the best worst of a press's three scores relative to each regime's best press,
#: among the presses holding at most kvpress top-k's bytes (+1 %) on the cache and decoding a step within 1.10 x
#: snapkv's. RECOMMENDED_FAST is the same choice among the presses whose prefill takes at most 1.2 x snapkv's time
#: and peak; it becomes RECOMMENDED when its worst is within 0.03 of the best, and the press it replaces is then
#: RECOMMENDED_SLOW. RECOMMENDED_PROSE and RECOMMENDED_RETRIEVAL are the per-regime picks.
#: RECOMMENDED: each KV head keeps its count of a per-head budget profile learned offline, evicted in each layer's
#: hook into a ragged cache (each head its own length): a quarter of it Fast KVzip's learned gate's top entries, the
#: rest pi_min-h's top from 256 sampled query rows; real eviction, no weights. It needs the model's gate and profile
#: (the embedded model's ship; ``kvprob train-gate`` trains another model's). RECOMMENDED_SLOW needs neither: the
#: count KVzip's global top gives each head, half of it KVzip's top entries, the rest pi_min-h's top.
RECOMMENDED = "topk_gate_profile_a25_minh256_ragged"
RECOMMENDED_FAST = "topk_gate_profile_a25_minh256_ragged"
RECOMMENDED_PROSE = "topk_gate_profile_a25_minh256_ragged"
RECOMMENDED_SLOW = "cross_kvzip_block1_a50_toprest_ragged"
RECOMMENDED_RETRIEVAL = "topk_kvzip_global"


def counts() -> dict[str, int]:
    """How many presses ship: ``prefill`` (``PRESSES``, built by ``get_press``) and ``decoding``
    (``DECODING_PRESSES``, built by ``get_decoding_press``). ``kvprob presses`` and the README print these."""
    return {"prefill": len(PRESSES), "decoding": len(DECODING_PRESSES)}


def factory(name: str) -> Callable[[float], BasePress]:
    """The factory of a shipped name, or of any name ``get_press`` builds (``parse_name`` refuses the rest)."""
    if name in DECODING_PRESSES:
        raise ValueError(f"press name {name!r} is a decoding press (it compresses while generating, to a target "
                         f"size, not at a compression ratio): build it with kvpress_prob.get_decoding_press("
                         f"{name!r}, target_size, compression_interval)")
    return PRESSES[name]


def _init_fields(obj) -> set[str]:
    return {f.name for f in fields(obj) if f.init}


def get_press(name: str, compression_ratio: float, **overrides) -> BasePress:
    """The press named ``name`` (shipped, or any name the grid or ``names.named`` builds) at ``compression_ratio``, with
    dataclass fields overridden.

    An override names a field of the press (``seed=3``, ``temperature=2.0``, ``budget="layer"``),
    of its sampler (``alpha=0.5``) or of its proposal (``chunk_size=256``, ``floor=0.05``); a name
    that more than one of them has is refused, pass a whole ``sampler=`` or ``proposal=`` instead.
    ``sampler`` may be a name of ``SAMPLERS``; sampler fields then apply to the new sampler. An override the
    press ignores (its ``unused_fields``: ``seed`` on a KVzip top-k press) is refused.
    """
    make = factory(name)
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1), got {compression_ratio}")
    press = make(compression_ratio)
    if not overrides:
        return press
    if isinstance(overrides.get("sampler"), str):
        if overrides["sampler"] not in SAMPLERS:
            raise ValueError(f"unknown sampler {overrides['sampler']!r}; valid: {', '.join(sorted(SAMPLERS))}")
        overrides["sampler"] = SAMPLERS[overrides["sampler"]]()
    given = set(overrides)
    if "sampler" in overrides or "proposal" in overrides:
        whole = {key: overrides.pop(key) for key in ("sampler", "proposal") if key in overrides}
        press = replace(press, **whole)
        if not overrides:
            return refuse_unused(name, press, given)
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
    return refuse_unused(name, replace(press, **owners["press"], **inner), given)


def refuse_unused(name: str, press: BasePress, given: set[str]) -> BasePress:
    """``press``, unless it ignores one of the ``given`` override names (its ``unused_fields``, if it has them)."""
    unused = sorted(given & (press.unused_fields() if hasattr(press, "unused_fields") else set()))
    if unused:
        raise ValueError(f"press {name!r} ignores the override(s) {unused}: they would change nothing")
    return press


def is_sampling(name: str, **overrides) -> bool:
    """Whether the named press (with these ``get_press`` overrides) samples: its result depends on the seed."""
    press = get_press(name, 0.5, **overrides)
    return isinstance(press, (SamplingPress, KVzipSampledPress)) and press.sampler.random
