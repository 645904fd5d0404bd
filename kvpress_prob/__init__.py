"""kvpress-prob: probabilistic KV cache eviction with decode-time SNIS correction, for KVPress.

Geh, Chen, Israel, Grover, Van den Broeck, "A Probabilistic Interpretation of KV Cache Eviction" (2026).
"""

from kvpress_prob.models import load_model
from kvpress_prob.press import SamplingPress
from kvpress_prob.proposals import H2OProposal, MinVarianceProposal, Proposal, ScoreProposal
from kvpress_prob.registry import PRESSES, get_press

__all__ = [
    "H2OProposal",
    "MinVarianceProposal",
    "PRESSES",
    "Proposal",
    "SamplingPress",
    "ScoreProposal",
    "get_press",
    "load_model",
]
