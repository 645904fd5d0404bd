"""Presses outside the name grammar of ``kvpress_prob.names.grid``: name -> factory of the compression ratio.

- ``KVZIP_ALLOCATIONS``: KVzip's scores under an allocation over layers and heads (``presses.kvzip_alloc``),
  ``topk_kvzip_<allocation>``.
- ``GATES``: Fast KVzip's learned gates (catalogued with the status ``learned``: a gate is trained per model; the
  embedded model's default ships with the package): under KVzip's widest allocation over all layers
  (``presses.gate``), ``topk_gate_widest``; under their global top per head in a ragged cache
  (``presses.ragged_presses``), ``topk_gate_ragged``; or each layer evicted in its own hook at kvpress's count
  (``presses.gate_layers``, snapkv's prefill time and peak), ``topk_gate_layers``, with the most recent ``<pct>`` %
  of each head's count kept as the fill in ``topk_gate_layers_recent<pct>``; or each layer evicted in its own hook
  into a ragged cache, each head keeping its count of a per-head budget profile learned offline
  (``presses.gate_profile``), ``topk_gate_profile_ragged`` and ``topk_gate_profile_recent<pct>_ragged``, or each
  layer keeping its heads' total of the profile as the top over its heads, ``topk_gate_profile_layers_ragged``;
  ``topk_gate_profile_a<pct>_minh256_ragged``: each head's count is the gate's top for ``<pct>`` % and pi_min-h's
  top from 256 sampled query rows for the rest.
- ``ENTROPY_HYBRIDS`` (not shipped; built by name): each head's exact fraction alpha_h follows the entropy of its
  own proposal (``samplers.entropy_stratified``); the rest is priority-sampled with correction. pi_min-h under the
  global budget of prob_min_h (positions, or blocks of 8); KeyDiff softmax-calibrated to the window attention's
  entropy (the proposal of ``prob_keydiff_block8_priority_ent``, not the grid's plain ``keydiff``) and TOVA over
  blocks of 8 with a per-head budget. Each has a ``_nocorr`` twin.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from kvpress import KeyDiffPress, TOVAPress

from kvpress_prob.proposals.calibrated import CalibratedProposal
from kvpress_prob.presses.gate import GatePress
from kvpress_prob.presses.gate_layers import LayerGatePress
from kvpress_prob.presses.gate_profile import ProfileGatePress
from kvpress_prob.presses.allocations import ALLOCATIONS
from kvpress_prob.presses.kvzip_alloc import KVzipAllocatedPress
from kvpress_prob.presses.ragged_presses import RaggedGatePress
from kvpress_prob.presses.sampling import SamplingPress
from kvpress_prob.proposals.attention import MinVarianceProposal, SampledMinVarianceProposal
from kvpress_prob.proposals.base import ScoreProposal
from kvpress_prob.samplers.block import BlockSampler
from kvpress_prob.samplers.entropy_stratified import EntropyStratifiedSampler


def _press(proposal: Callable, sampler: Callable, **fields) -> Callable[[float], SamplingPress]:
    return lambda ratio: SamplingPress(proposal=proposal(), sampler=sampler(), compression_ratio=ratio, **fields)


def _blocks() -> BlockSampler:
    return BlockSampler(size=8, inner=EntropyStratifiedSampler())


def _min_h() -> MinVarianceProposal:
    return MinVarianceProposal(harmonic=True)


_ENTROPY: dict[str, Callable[[float], SamplingPress]] = {
    "prob_min_h_ent_alpha": _press(_min_h, EntropyStratifiedSampler),
    "prob_min_h_block8_ent_alpha": _press(_min_h, _blocks),
    "hybrid_keydiff_block8_ent_alpha": _press(lambda: CalibratedProposal(scorer=KeyDiffPress(), calibration="entropy"),
                                              _blocks, budget="head"),
    "hybrid_tova_block8_ent_alpha": _press(lambda: ScoreProposal(scorer=TOVAPress()), _blocks, budget="head"),
}

#: name -> factory of the compression ratio (with the ``_nocorr`` twins).
ENTROPY_HYBRIDS: dict[str, Callable[[float], SamplingPress]] = {
    **_ENTROPY,
    **{f"{name}_nocorr": (lambda ratio, make=make: replace(make(ratio), correct=False)) for name, make in _ENTROPY.items()},
}

#: KVzip's allocations as named presses: name -> factory of the ratio.
KVZIP_ALLOCATIONS: dict[str, Callable[[float], KVzipAllocatedPress]] = {
    f"topk_kvzip_{a}": (lambda ratio, a=a: KVzipAllocatedPress(compression_ratio=ratio, allocation=a))
    for a in ALLOCATIONS}

#: Fast KVzip's gates, under the widest allocation, per head in a ragged cache, or evicted layer by layer: name -> factory of the ratio.
GATES: dict[str, Callable[[float], GatePress]] = {
    "topk_gate_widest": lambda ratio: GatePress(compression_ratio=ratio),
    "topk_gate_ragged": lambda ratio: RaggedGatePress(compression_ratio=ratio),
    "topk_gate_layers": lambda ratio: LayerGatePress(compression_ratio=ratio),
    **{f"topk_gate_layers_recent{pct}": (lambda ratio, pct=pct: LayerGatePress(compression_ratio=ratio, window=pct / 100))
       for pct in (10, 25, 50)},
    "topk_gate_profile_ragged": lambda ratio: ProfileGatePress(compression_ratio=ratio),
    "topk_gate_profile_layers_ragged": lambda ratio: ProfileGatePress(compression_ratio=ratio, scope="layer"),
    **{f"topk_gate_profile_recent{pct}_ragged": (lambda ratio, pct=pct: ProfileGatePress(compression_ratio=ratio,
                                                                                        window=pct / 100))
       for pct in (10, 25)},
    **{f"topk_gate_profile_a{pct}_minh256_ragged": (
        lambda ratio, pct=pct: ProfileGatePress(compression_ratio=ratio, fill_share=1 - pct / 100,
                                                fill=SampledMinVarianceProposal(query_rows=256)))
       for pct in (25, 50, 75)},
}

#: Every named press of this module.
NAMED: dict[str, Callable[[float], SamplingPress | KVzipAllocatedPress | GatePress]] = {
    **KVZIP_ALLOCATIONS, **GATES, **ENTROPY_HYBRIDS}
