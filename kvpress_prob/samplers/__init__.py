"""The sampling designs: each maps proposals and a budget to a kept mask and log-weights."""

from kvpress_prob.samplers.base import Draw, Sampler
from kvpress_prob.samplers.poisson import PoissonSampler
from kvpress_prob.samplers.topk import TopKSampler

__all__ = ["Draw", "PoissonSampler", "Sampler", "TopKSampler"]
