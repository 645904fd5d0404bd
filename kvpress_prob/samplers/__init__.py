"""Sampling designs of ``SamplingPress``: each maps proposals and a budget to a kept mask and
log-weights. A new design is one ``Sampler`` subclass in one module here plus one registry line."""

from kvpress_prob.samplers.base import Draw, Sampler
from kvpress_prob.samplers.poisson import PoissonSampler
from kvpress_prob.samplers.topk import TopKSampler

__all__ = ["Draw", "PoissonSampler", "Sampler", "TopKSampler"]
