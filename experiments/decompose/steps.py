"""The steps of the decomposition (``decompose.py`` runs them, ``decompose_report.py`` tabulates them):
the proposal families, the step names and the configurations of each step."""

from __future__ import annotations

from evaluation.engine.runner import Config
from kvpress_prob.names.registry import is_sampling

#: family -> (kvpress top-k press, probabilistic press with the same scores); None: no kvpress press
FAMILIES = {
    "tova": ("tova", "prob_tova"),
    "knorm": ("knorm", "prob_knorm"),
    "snapkv": ("snapkv", "prob_snapkv"),
    "streaming_llm": ("streaming_llm", "prob_streaming_llm"),
    "expected_attention": ("expected_attention", "prob_expected_attention"),
    "h2o": ("h2o", "prob_h2o"),
    "min_h": (None, "prob_min_h"),
}
STEPS = ("topk", "head", "layer", "global", "sampled", "corrected")
DEV_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2", "niah_multikey_3",
             "niah_multivalue", "niah_multiquery", "fwe"]


def step_configs(family: str, ratio: float, seeds: list[int]) -> dict[str, list[Config]]:
    """The configurations of each step of one family at one ratio (sampled steps: one per seed)."""
    topk, prob = FAMILIES[family]
    steps = {
        "head": [Config(prob, ratio, 0, (("sampler", "topk"), ("budget", "head")))],
        "layer": [Config(prob, ratio, 0, (("sampler", "topk"), ("budget", "layer")))],
        "global": [Config(prob, ratio, 0, (("sampler", "topk"),))],
        "sampled": [Config(prob, ratio, s, (("correct", False),)) for s in seeds],
        "corrected": [Config(prob, ratio, s) for s in seeds],
    }
    if topk is not None:
        steps = {"topk": [Config(topk, ratio, 0)], **steps}
    return steps


def all_configs(families, ratios, seeds, extra=()) -> list[tuple[str, str, Config]]:
    """(family, step, configuration) for every family, ratio and step; each ``extra`` registry
    press (another design, measured alongside) is a family "design" whose step is its name."""
    steps = [(family, step, cfg) for family in families for ratio in ratios
             for step, cfgs in step_configs(family, ratio, seeds).items() for cfg in cfgs]
    designs = [("design", name, Config(name, ratio, seed)) for name in extra for ratio in ratios
               for seed in (seeds if is_sampling(name) else seeds[:1])]
    return steps + designs
