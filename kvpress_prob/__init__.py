"""kvpress-prob: probabilistic KV cache eviction with decode-time SNIS correction, for KVPress.

Geh, Chen, Israel, Grover, Van den Broeck, "A Probabilistic Interpretation of KV Cache Eviction" (2026).

Layers, bottom up: ``attention_dispatch``, ``correction``, ``cache`` and ``proposals``; ``samplers``; ``presses`` and
``decoding``; ``names``; ``integrations``. The public API is imported here.
"""

from kvpress_prob.decoding.heads import HeadBudgetDecodingPress
from kvpress_prob.decoding.layer_budgets import LayerBudgetDecodingPress
from kvpress_prob.decoding.press import SamplingDecodingPress
from kvpress_prob.models import load_model
from kvpress_prob.names.decoding import DECODING_PRESSES, get_decoding_press
from kvpress_prob.names.registry import (
    BASELINES,
    CATALOGUE,
    PRESSES,
    RECOMMENDED,
    RECOMMENDED_FAST,
    RECOMMENDED_PROSE,
    RECOMMENDED_RETRIEVAL,
    RECOMMENDED_SLOW,
    get_press,
)
from kvpress_prob.presses.sampling import SamplingPress
from kvpress_prob.proposals.attention import H2OProposal, MinVarianceProposal
from kvpress_prob.proposals.base import Proposal, ScoreProposal

__all__ = [
    "BASELINES",
    "CATALOGUE",
    "DECODING_PRESSES",
    "H2OProposal",
    "HeadBudgetDecodingPress",
    "LayerBudgetDecodingPress",
    "MinVarianceProposal",
    "PRESSES",
    "Proposal",
    "RECOMMENDED",
    "RECOMMENDED_FAST",
    "RECOMMENDED_PROSE",
    "RECOMMENDED_RETRIEVAL",
    "RECOMMENDED_SLOW",
    "SamplingDecodingPress",
    "SamplingPress",
    "ScoreProposal",
    "get_decoding_press",
    "get_press",
    "load_model",
]
