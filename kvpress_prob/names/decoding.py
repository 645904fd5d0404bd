"""The decoding presses by name: ``DECODING_PRESSES`` and ``get_decoding_press(name, target_size, compression_interval)``."""

from __future__ import annotations

import copy

from kvpress import KeyDiffPress, KnormPress, StreamingLLMPress, TOVAPress
from kvpress.presses.scorer_press import ScorerPress

from kvpress_prob.decoding.heads import HeadBudgetDecodingPress
from kvpress_prob.decoding.layer_budgets import LayerBudgetDecodingPress
from kvpress_prob.decoding.press import SamplingDecodingPress
from kvpress_prob.samplers import Sampler, TopKSampler
from kvpress_prob.samplers.block import BlockSampler
from kvpress_prob.samplers.priority import PrioritySampler
from kvpress_prob.samplers.stratified import StratifiedSampler
from kvpress_prob.samplers.threshold import ThresholdSampler


def _press(proposal: str, sampler: Sampler, base_press: ScorerPress | None = None, cls=None, **fixed):
    def factory(target_size: int, compression_interval: int, **overrides) -> SamplingDecodingPress:
        kwargs = dict(proposal=proposal, sampler=sampler, base_press=base_press, **fixed)
        kwargs.update(overrides)
        kwargs.setdefault("hidden_states_buffer_size", compression_interval)
        kwargs["sampler"] = copy.deepcopy(kwargs["sampler"])  # every press its own instances
        kwargs["base_press"] = copy.deepcopy(kwargs["base_press"])
        press = cls or SamplingDecodingPress  # or a subclass (LayerBudgetDecodingPress, HeadBudgetDecodingPress)
        return press(target_size=target_size, compression_interval=compression_interval, **kwargs)

    return factory


def _nocorr(factory):
    def uncorrected(target_size: int, compression_interval: int, **overrides) -> SamplingDecodingPress:
        return factory(target_size, compression_interval, correct=False, **overrides)

    return uncorrected


_TOPK = TopKSampler()
_PRIORITY = PrioritySampler()

#: name -> factory(target_size, compression_interval, **overrides): the decoding presses.
#: decode_*: top-k designs (deterministic, no weights); prob_decode_*: sampled, corrected; *_nocorr: same draws uncorrected.
DECODING_PRESSES = {
    "decode_streaming_llm": _press("scorer", _TOPK, StreamingLLMPress(n_sink=4)),
    "decode_knorm_topk": _press("scorer", _TOPK, KnormPress()),
    "decode_tova_topk": _press("scorer", _TOPK, TOVAPress()),
    "decode_keydiff_topk": _press("scorer", _TOPK, KeyDiffPress()),
    "decode_attn_topk": _press("attention", _TOPK),
    "decode_h2o_topk": _press("h2o", _TOPK),
    "decode_min_variance_topk": _press("min_variance", _TOPK),
    "prob_decode_attn_priority": _press("attention", _PRIORITY),
    "prob_decode_h2o_priority": _press("h2o", _PRIORITY),
    "prob_decode_min_variance_priority": _press("min_variance", _PRIORITY),
    "prob_decode_tova_priority": _press("scorer", _PRIORITY, TOVAPress()),
    "prob_decode_attn_threshold": _press("attention", ThresholdSampler()),
    "prob_decode_attn_stratified": _press("attention", StratifiedSampler(alpha=0.5)),
    "prob_decode_attn_block4": _press("attention", BlockSampler(size=4, inner=PrioritySampler())),
    "prob_decode_attn_vase": _press("attention", _PRIORITY, protect_values=8),
    # the harmonic prior over the buffered queries, and variance control of the compounded weights
    "prob_decode_min_variance_h_priority": _press("min_variance", _PRIORITY, harmonic=True),
    "prob_decode_min_variance_priority_t2": _press("min_variance", _PRIORITY, temperature=2.0),
    "prob_decode_min_variance_priority_cap16": _press("min_variance", _PRIORITY, max_weight=16.0),
    "prob_decode_min_variance_priority_renorm": _press("min_variance", _PRIORITY, renormalise=True),
    "prob_decode_min_variance_priority_floor20": _press("min_variance", _PRIORITY, floor=0.2),
}
DECODING_PRESSES.update({f"{name}_nocorr": _nocorr(factory) for name, factory in list(DECODING_PRESSES.items())
                         if name.startswith("prob_decode_")})

# per-layer budgets at the same total, behind the chosen design (and its uncorrected twin)
_LAYERS = "prob_decode_min_variance_priority_floor20_layers"
DECODING_PRESSES[_LAYERS] = _press("min_variance", _PRIORITY, cls=LayerBudgetDecodingPress, floor=0.2)
DECODING_PRESSES[f"{_LAYERS}_nocorr"] = _nocorr(DECODING_PRESSES[_LAYERS])

# per-head budgets (AdaKV's allocation each round), evicted for real into a ragged cache: the chosen design, its
# uncorrected twin, and AdaKV's top over the buffered queries' attention
_HEADS = "prob_decode_min_variance_priority_floor20_heads"
DECODING_PRESSES[_HEADS] = _press("min_variance", _PRIORITY, cls=HeadBudgetDecodingPress, floor=0.2)
DECODING_PRESSES[f"{_HEADS}_nocorr"] = _nocorr(DECODING_PRESSES[_HEADS])
DECODING_PRESSES["decode_attn_topk_heads"] = _press("attention", _TOPK, cls=HeadBudgetDecodingPress)


def get_decoding_press(name: str, target_size: int, compression_interval: int, **overrides) -> SamplingDecodingPress:
    """The decoding press ``name`` of ``DECODING_PRESSES`` at this budget and interval."""
    if name not in DECODING_PRESSES:
        raise KeyError(f"unknown decoding press {name!r}; known: {sorted(DECODING_PRESSES)}")
    return DECODING_PRESSES[name](target_size, compression_interval, **overrides)
