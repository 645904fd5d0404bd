"""kvpress-prob: probabilistic KV cache eviction with decode-time SNIS correction, for KVPress.

Geh, Chen, Israel, Grover, Van den Broeck, "A Probabilistic Interpretation of KV Cache Eviction" (2026).
"""

from kvpress_prob.decoding import DECODING_PRESSES, SamplingDecodingPress, get_decoding_press
from kvpress_prob.layer_budgets import LayerBudgetDecodingPress
from kvpress_prob.models import load_model
from kvpress_prob.press import SamplingPress
from kvpress_prob.proposals import H2OProposal, MinVarianceProposal, Proposal, ScoreProposal
from kvpress_prob.registry import PRESSES, get_press

__all__ = [
    "LayerBudgetDecodingPress",
    "DECODING_PRESSES",
    "H2OProposal",
    "MinVarianceProposal",
    "PRESSES",
    "Proposal",
    "SamplingDecodingPress",
    "SamplingPress",
    "ScoreProposal",
    "get_decoding_press",
    "get_press",
    "load_model",
]
