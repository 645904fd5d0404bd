"""Fidelity benchmark: how far a compressed KV cache moves the model away from the full cache.

Two measurements, on RULER needle-in-a-haystack examples (chat-formatted as the kvpress pipeline
does it; the continuation is the question followed by the gold answer ``answer[0]``, teacher-forced):

1. End-to-end KL. For every continuation position t, KL(p_full(. | x_<t) || p_press(. | x_<t)),
   averaged over the continuation (``kl``; ``kl_answer`` averages only the positions that predict
   the gold answer tokens). One number per (example, method, ratio, seed); the seeds of a sampling
   method are averaged within an example, and the 95% confidence interval is a Student-t interval
   over the example means (a percentile bootstrap over examples is reported too). A paired table
   compares, per scorer family, top-k / sampled + corrected / sampled uncorrected / Horvitz-Thompson
   on the same examples.
2. Layer-wise attention error. Forward hooks on every ``self_attn`` keep the attention output
   (after ``o_proj``) at the continuation positions, for the full cache and for each compressed
   run; the relative error ||o - o_full||_F / ||o_full||_F is taken per layer. The error is end to
   end: layer l's error includes what earlier layers passed on. Over the seeds of a sampling method
   the squared relative error splits into bias^2 = ||mean_s o_s - o_full||^2 / ||o_full||^2 and
   variance = mean_s ||o_s - mean_s o_s||^2 / ||o_full||^2 (their sum is the mean squared error).
   ``--sweep`` adds the temperature tau in {1, 2, 4, inf} at several ratios for a few methods.

Reusing the full prefill (default). Every press in the registry compresses after a layer's
attention has run on the full cache, so the prefill computation (hidden states, and the inputs of
each attention module) is the same with or without compression; only the cache left behind
differs. The benchmark runs the full prefill once per example while keeping each attention
module's hook arguments, then, per configuration, copies the full cache and calls the press's own
``forward_hook`` with those arguments layer by layer (and ``evict`` for a SamplingPress), which is
exactly what happens inside ``with press(model): model.model(...)``. A SamplingPress's proposal
does not depend on the seed, the temperature, the correction or the weights, so it is computed
once per (example, proposal) and redrawn for each seed. ``--no-reuse-prefill`` reruns the real
compressed prefill for every configuration instead (tests check that both give the same logits).

Results are appended, one JSON line per (example, configuration) with all its seeds, to
``<out>/records.jsonl`` through ``evaluation.store.ResultStore`` (fsynced after each line; a killed
run resumes where it stopped). The report (``report.md``, ``summary.json``, ``kl_bars.png``,
``layer_error.png``, ``bias_variance.png``) is rewritten after every example.

Usage::

    python -m evaluation.bench.fidelity --quick           # 3 examples at 1024 tokens
    python -m evaluation.bench.fidelity                   # 6 examples at 2048 tokens
    python -m evaluation.bench.fidelity --sweep           # + tau / ratio sweep (bias^2 vs variance)
    python -m evaluation.bench.fidelity --report-only     # rebuild the report from records.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

logger = logging.getLogger("evaluation.bench.fidelity")

DEFAULT_PRESSES = (
    "snapkv", "prob_snapkv", "prob_snapkv_nocorr", "prob_snapkv_ht",
    "tova", "prob_tova", "prob_tova_nocorr",
    "topk_min_h", "prob_min_h", "prob_min_h_nocorr", "prob_min_h_ht",
    "knorm", "prob_knorm",
)
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
DEFAULT_OUT = Path("results/bench/fidelity")
SWEEP_PRESSES = ("prob_min_h", "prob_snapkv")
SWEEP_RATIOS = (0.25, 0.5, 0.75, 0.9)
SWEEP_TEMPERATURES = (1.0, 2.0, 4.0, float("inf"))
DATASET = "ruler"

# scorer families of the paired comparison: role -> registry name
FAMILIES = {
    "snapkv": {"top-k": "snapkv", "sampled": "prob_snapkv", "uncorrected": "prob_snapkv_nocorr", "HT": "prob_snapkv_ht"},
    "tova": {"top-k": "tova", "sampled": "prob_tova", "uncorrected": "prob_tova_nocorr"},
    "min_h": {"top-k": "topk_min_h", "sampled": "prob_min_h", "uncorrected": "prob_min_h_nocorr", "HT": "prob_min_h_ht"},
    "knorm": {"top-k": "knorm", "sampled": "prob_knorm", "uncorrected": "prob_knorm_nocorr"},
}
# (A, B): the table reports KL(A) - KL(B) per example; negative = A is closer to the full cache
PAIRS = (("sampled", "top-k"), ("uncorrected", "top-k"), ("HT", "top-k"), ("sampled", "uncorrected"), ("HT", "sampled"))


# =========================================================================== statistics (numpy only)


def _betacf(a: float, b: float, x: float, iterations: int = 500, eps: float = 1e-15) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, iterations + 1):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(x: float, df: float) -> float:
    """CDF of Student's t distribution with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if x == 0:
        return 0.5
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + x * x))
    return 1.0 - tail if x > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Quantile of Student's t distribution (bisection on ``t_cdf``; |error| < 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def mean_ci(values, level: float = 0.95) -> dict:
    """Mean and two-sided Student-t confidence interval of the mean of i.i.d. values.

    Returns {mean, lo, hi, half, n, sd}; with fewer than two finite values lo/hi/half are NaN.
    """
    x = np.asarray([v for v in np.asarray(values, dtype=float).ravel() if np.isfinite(v)], dtype=float)
    n = len(x)
    if n == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "half": float("nan"), "n": 0,
                "sd": float("nan")}
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "half": float("nan"), "n": 1, "sd": float("nan")}
    sd = float(x.std(ddof=1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "half": half, "n": n, "sd": sd}


def bootstrap_ci(values, level: float = 0.95, n_boot: int = 10000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (resampling the values with replacement)."""
    x = np.asarray([v for v in np.asarray(values, dtype=float).ravel() if np.isfinite(v)], dtype=float)
    if len(x) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1.0 - alpha))


def paired_difference(a, b, level: float = 0.95) -> dict:
    """Mean of a - b over paired units with a t interval; ``a_better`` counts units with a < b."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same shape, got {a.shape} and {b.shape}")
    out = mean_ci(a - b, level)
    out["a_better"] = int(np.sum(a < b))
    return out


def bias_variance(outputs, reference) -> dict:
    """Split the relative squared error of seeded estimates into bias^2 and variance.

    outputs (S, ...) one estimate per seed, reference (...). Returns bias2, variance and mse,
    each divided by ||reference||^2; mse = bias2 + variance (variance with 1/S).
    """
    import torch

    outputs = torch.as_tensor(outputs, dtype=torch.float64)
    reference = torch.as_tensor(reference, dtype=torch.float64)
    scale = float(reference.pow(2).sum().clamp_min(1e-300))
    mean = outputs.mean(dim=0)
    bias2 = float((mean - reference).pow(2).sum()) / scale
    variance = float((outputs - mean).pow(2).flatten(1).sum(dim=1).mean()) / scale
    mse = float((outputs - reference).pow(2).flatten(1).sum(dim=1).mean()) / scale
    return {"bias2": bias2, "variance": variance, "mse": mse}


# =========================================================================== model side


def kl_per_position(reference_logits, logits):
    """KL(softmax(reference) || softmax(logits)) per row (in nats, float64, clamped at 0)."""
    import torch

    p = torch.log_softmax(reference_logits.double(), dim=-1)
    q = torch.log_softmax(logits.double(), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1).clamp_min(0.0)


def attention_modules(model) -> list:
    from kvpress_prob.press import language_model

    return [layer.self_attn for layer in language_model(model).layers]


def _reset_corrections(model) -> None:
    from kvpress_prob import correction

    for module in attention_modules(model):
        correction.reset(module)


def full_prefill(model, context_ids, capture: bool = True):
    """Prefill with the full cache. Returns (cache, captured): captured[i] = (kwargs, output) of
    layer i's attention module (without the cache), or None when ``capture`` is False."""
    import torch
    from transformers import DynamicCache

    from kvpress_prob.press import language_model

    _reset_corrections(model)
    captured: dict[int, tuple] = {}

    def hook(module, args, kwargs, output):
        kw = {k: v for k, v in kwargs.items() if k != "past_key_values"}
        captured[module.layer_idx] = (kw, (None, output[1]) + tuple(output[2:]))
        return output

    modules = attention_modules(model)
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules] if capture else []
    cache = DynamicCache()
    try:
        with torch.no_grad():
            language_model(model)(input_ids=context_ids, past_key_values=cache)
    finally:
        for h in handles:
            h.remove()
    return cache, ([captured[i] for i in range(len(modules))] if capture else None)


def compressed_prefill(model, context_ids, press):
    """The honest path: the prefill under ``with press(model)``, as the kvpress pipeline runs it."""
    import torch
    from transformers import DynamicCache

    from kvpress_prob.press import language_model

    _reset_corrections(model)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        language_model(model)(input_ids=context_ids, past_key_values=cache)
    return cache


def replay_press(model, press, full_cache, captured, proposal_cache: dict | None = None):
    """The cache ``press`` leaves after the prefill, from a full prefill's captured hook arguments.

    Calls the press's own ``forward_hook`` on each attention module with the arguments that module
    saw during the full prefill and a copy of the full cache, then ``evict`` for a SamplingPress:
    what ``with press(model): model.model(...)`` does, without recomputing the model. With
    ``proposal_cache`` (a dict kept per example), a SamplingPress's proposals are computed once per
    distinct proposal and reused (they depend on neither seed, temperature, correction nor weights).
    """
    import torch

    from kvpress_prob import SamplingPress

    modules = attention_modules(model)
    _reset_corrections(model)
    cache = copy.deepcopy(full_cache)

    def run_hooks():
        for module, (kwargs, output) in zip(modules, captured):
            press.forward_hook(module, (), {**kwargs, "past_key_values": cache}, output)

    with torch.no_grad(), press(model):  # post_init_from_model; its hooks never fire (no forward)
        sampling = isinstance(press, SamplingPress)
        if sampling and press.compression_ratio > 0:
            key = repr(press.proposal)
            if proposal_cache is None or key not in proposal_cache:
                proposals = {}
                for module, (kwargs, _) in zip(modules, captured):
                    proposals[module.layer_idx] = press.propose(module, {**kwargs, "past_key_values": cache})
                if proposal_cache is None:
                    proposal_cache = {}
                proposal_cache[key] = proposals
            press.evict(cache, {modules[i]: pi for i, pi in proposal_cache[key].items()})
        elif not sampling:
            run_hooks()
    return cache


def continuation(model, cache, continuation_ids, n_context: int, capture_attention: bool = False):
    """Teacher-forced forward of the continuation on ``cache`` (extended in place).

    Returns (logits (T, V) float32, attention outputs (L, T, hidden) float32 or None).
    """
    import torch

    outputs: dict[int, torch.Tensor] = {}

    def hook(module, args, output):
        outputs[module.layer_idx] = output[0][0].detach().float().clone()

    modules = attention_modules(model)
    handles = [m.register_forward_hook(hook) for m in modules] if capture_attention else []
    t = continuation_ids.shape[1]
    try:
        with torch.no_grad():
            out = model(
                input_ids=continuation_ids,
                past_key_values=cache,
                position_ids=torch.arange(n_context, n_context + t, device=continuation_ids.device)[None],
            )
    finally:
        for h in handles:
            h.remove()
    attention = torch.stack([outputs[i] for i in range(len(modules))]) if capture_attention else None
    return out.logits[0].float(), attention


def relative_error(outputs, reference) -> list[float]:
    """Per-layer ||o - o_ref||_F / ||o_ref||_F for (L, T, hidden) tensors."""
    num = (outputs.double() - reference.double()).flatten(1).norm(dim=1)
    den = reference.double().flatten(1).norm(dim=1).clamp_min(1e-300)
    return (num / den).tolist()


def draws_of(press) -> float | None:
    """m, the number of draws of a SamplingPress's global budget (None otherwise)."""
    m = (getattr(press, "stats", None) or {}).get("m")
    return float(m) if isinstance(m, (int, float)) else None


def realised_ratio(press, cache, n_context: int) -> float:
    """The press's realised ratio (SamplingPress stats), else from the cache's lengths."""
    stats = getattr(press, "stats", None)
    if stats and "realised_ratio" in stats:
        return float(stats["realised_ratio"])
    kept = sum(layer.keys.shape[-2] * layer.keys.shape[1] for layer in cache.layers)
    total = sum(n_context * layer.keys.shape[1] for layer in cache.layers)
    return 1.0 - kept / total


# =========================================================================== configurations


def fmt_tau(t: float | None) -> str:
    return "1" if t is None else ("inf" if math.isinf(t) else f"{t:g}")


@dataclass(frozen=True)
class Config:
    """One method setting. ``temperature`` None is the registry default (tau = 1); ``budget`` None
    is the registry's budget scope (global)."""

    press: str
    ratio: float
    temperature: float | None = None
    budget: str | None = None

    def __post_init__(self):
        if self.temperature is not None and float(self.temperature) == 1.0:
            object.__setattr__(self, "temperature", None)
        if self.budget == "global":
            object.__setattr__(self, "budget", None)

    @property
    def label(self) -> str:
        label = self.press if self.temperature is None else f"{self.press}@tau={fmt_tau(self.temperature)}"
        return label if self.budget is None else f"{label}@budget={self.budget}"


def is_sampling(name: str) -> bool:
    from kvpress_prob.registry import is_sampling as _is_sampling

    return _is_sampling(name)


def make_press(config: Config, seed: int):
    from kvpress_prob import SamplingPress, get_press

    overrides = {}
    probe = get_press(config.press, config.ratio)
    if isinstance(probe, SamplingPress):
        overrides["seed"] = seed
        if config.temperature is not None:
            overrides["temperature"] = config.temperature
        if config.budget is not None:
            overrides["budget"] = config.budget
    elif config.temperature is not None or config.budget is not None:
        raise ValueError(f"{config.press} is not a SamplingPress: it has no temperature or budget")
    return get_press(config.press, config.ratio, **overrides)


def seeds_for(config: Config, seeds: list[int]) -> list[int]:
    """Every seed for a sampling method, the first one for a deterministic method."""
    return list(seeds) if is_sampling(config.press) else list(seeds[:1])


def build_configs(presses, ratios, sweep: bool = False, sweep_presses=SWEEP_PRESSES,
                  sweep_ratios=SWEEP_RATIOS, temperatures=SWEEP_TEMPERATURES,
                  scopes=()) -> tuple[list[Config], list[Config]]:
    """(main KL grid, extra sweep configs not already in the grid). ``scopes`` adds every sampling
    press of the grid under each other budget scope (layer, head) to the main grid."""
    from kvpress_prob import PRESSES

    for name in list(presses) + (list(sweep_presses) if sweep else []):
        if name not in PRESSES:
            raise SystemExit(f"unknown press {name!r}; valid names: {', '.join(sorted(PRESSES))}")
        if name == "h2o":
            raise SystemExit("h2o needs eager attention (ObservedAttentionPress); use prob_h2o / prob_h2o_h")
    main = [Config(p, float(r)) for r in ratios for p in presses]
    main += [Config(p, float(r), None, scope) for r in ratios for p in presses if is_sampling(p)
             for scope in scopes if scope != "global"]
    extra: list[Config] = []
    if sweep:
        seen = set(main)
        for p in sweep_presses:
            if not is_sampling(p):
                raise SystemExit(f"--sweep-presses must be sampling presses, got {p!r}")
            for r in sweep_ratios:
                for t in temperatures:
                    c = Config(p, float(r), float(t))
                    if c not in seen:
                        seen.add(c)
                        extra.append(c)
    return main, extra


# =========================================================================== data


def load_examples(tokenizer, context_length: int, n_examples: int, seed: int, tasks) -> pd.DataFrame:
    from evaluation.datasets.ruler import generate_ruler

    return generate_ruler(tokenizer, context_length, n_examples, seed, tasks=list(tasks)).reset_index(drop=True)


def build_inputs(pipe, tokenizer, row) -> tuple:
    """(context_ids (1, n), continuation_ids (1, T), n_question): the chat-formatted context and
    question (with answer prefix) as the kvpress pipeline builds them, then the gold answer."""
    import torch

    encoded = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)
    context_ids = encoded["context_ids"]
    question_ids = encoded["questions_ids"][0]
    answer = row["answer"][0] if isinstance(row["answer"], (list, tuple, np.ndarray)) else str(row["answer"])
    prefix = row["answer_prefix"]
    sep = "" if (not prefix or prefix[-1].isspace()) else " "
    answer_ids = tokenizer.encode(sep + str(answer), add_special_tokens=False, return_tensors="pt")
    continuation_ids = torch.cat([question_ids, answer_ids.to(question_ids.dtype)], dim=1)
    return context_ids, continuation_ids, question_ids.shape[1]


# =========================================================================== one example


def evaluate_config(model, config: Config, seeds: list[int], context_ids, continuation_ids, n_question: int,
                    reference: dict, full_cache=None, captured=None, proposal_cache=None,
                    layerwise: bool = True) -> dict:
    """All seeds of one configuration on one example: KL, answer KL, top-1 agreement, answer NLL,
    realised ratio, per-layer relative error, and bias^2 / variance over the seeds."""
    import torch

    n = context_ids.shape[1]
    t = continuation_ids.shape[1]
    answer_rows = slice(n_question - 1, t - 1)  # rows predicting the gold answer tokens
    answer_tokens = continuation_ids[0, n_question:]
    out = {k: [] for k in ("kl", "kl_answer", "top1", "nll_answer", "realised_ratio", "layer_err", "seconds")}
    attention_runs = []
    for seed in seeds:
        start = time.perf_counter()
        press = make_press(config, seed)
        if captured is not None:
            cache = replay_press(model, press, full_cache, captured, proposal_cache)
        else:
            cache = compressed_prefill(model, context_ids, press)
        ratio = realised_ratio(press, cache, n)
        out["m"] = draws_of(press)
        logits, attention = continuation(model, cache, continuation_ids, n, capture_attention=layerwise)
        kl = kl_per_position(reference["logits"], logits)
        logp = torch.log_softmax(logits[answer_rows].double(), dim=-1)
        out["kl"].append(float(kl.mean()))
        out["kl_answer"].append(float(kl[answer_rows].mean()))
        out["top1"].append(float((logits.argmax(-1) == reference["logits"].argmax(-1)).double().mean()))
        out["nll_answer"].append(float(-logp.gather(-1, answer_tokens[:, None]).sum()))
        out["realised_ratio"].append(ratio)
        if layerwise:
            out["layer_err"].append(relative_error(attention, reference["attention"]))
            attention_runs.append(attention)
        out["seconds"].append(time.perf_counter() - start)
        del cache
    if layerwise:
        stacked = torch.stack(attention_runs)  # (S, L, T, hidden)
        split = [bias_variance(stacked[:, layer], reference["attention"][layer]) for layer in range(stacked.shape[1])]
        out["bias2"] = [s["bias2"] for s in split]
        out["variance"] = [s["variance"] for s in split]
    return out


# =========================================================================== runner


def record_key(example_id: str, config: Config) -> tuple:
    return str(example_id), config.label, round(float(config.ratio), 6)


def run(args) -> Path:
    import torch

    from evaluation.store import ResultStore
    from kvpress import KVPressTextGenerationPipeline
    from kvpress_prob import load_model

    out_dir = Path(args.out)
    store = ResultStore(out_dir / "records.jsonl")
    m_store = ResultStore(out_dir / "m.jsonl")  # m backfilled for records written without it
    known_m = {(r["example_id"], r["press"], float(r["compression_ratio"]))
               for r in store.records() + m_store.records()
               if r.get("m") is not None and r.get("data_dir") == data_dir_of(args)}
    done = {record_key(r["example_id"], Config(r["method"], r["compression_ratio"], _tau(r.get("temperature")),
                                               r.get("budget")))
            for r in store.records() if r.get("data_dir") == data_dir_of(args)}
    main_configs, sweep_configs = build_configs(
        args.presses, args.ratios, args.sweep, args.sweep_presses, args.sweep_ratios, args.temperatures, args.scopes)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    model_name = getattr(model.config, "_name_or_path", "model") if args.model else "SmolLM2-135M-Instruct"
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    frame = load_examples(tokenizer, args.context_length, args.n_examples, args.dataset_seed, args.tasks)
    logger.info("model and %d examples ready in %.1fs", len(frame), time.perf_counter() - t0)
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    phases = [("main", main_configs)] + ([("sweep", sweep_configs)] if sweep_configs else [])
    for phase, configs in phases:
        for _, row in frame.iterrows():
            todo = [c for c in configs if record_key(row["example_id"], c) not in done]
            # m of sampling configurations recorded before m was (seed 0 suffices: m depends only on pi)
            missing_m = [c for c in main_configs + sweep_configs if phase == "main" and is_sampling(c.press)
                         and (row["example_id"], c.label, c.ratio) not in known_m
                         and record_key(row["example_id"], c) in done]
            if not todo and not missing_m:
                continue
            if deadline is not None and time.time() > deadline:
                logger.warning("--max-minutes reached: stopping (rerun the same command to resume)")
                write_report(out_dir)
                return out_dir
            start = time.perf_counter()
            context_ids, continuation_ids, n_question = build_inputs(pipe, tokenizer, row)
            n = context_ids.shape[1]
            full_cache, captured = full_prefill(model, context_ids, capture=args.reuse_prefill)
            logits, attention = continuation(model, copy.deepcopy(full_cache), continuation_ids, n,
                                             capture_attention=args.layerwise)
            reference = {"logits": logits, "attention": attention}
            answer_rows = slice(n_question - 1, continuation_ids.shape[1] - 1)
            ref_nll = float(-torch.log_softmax(logits[answer_rows].double(), -1)
                            .gather(-1, continuation_ids[0, n_question:, None]).sum())
            t_full = time.perf_counter() - start
            logger.info("[%s] %s: n=%d, continuation %d (answer %d), full prefill + continuation %.1fs, %d configs",
                        phase, row["example_id"], n, continuation_ids.shape[1],
                        continuation_ids.shape[1] - n_question, t_full, len(todo))
            proposal_cache: dict = {}
            for config in missing_m:
                press = make_press(config, 0)
                replay_press(model, press, full_cache, captured, proposal_cache)
                m_store.append([{"data_dir": data_dir_of(args), "example_id": row["example_id"], "press": config.label,
                                 "compression_ratio": float(config.ratio), "m": draws_of(press)}])
            for config in todo:
                seeds = seeds_for(config, args.seeds)
                res = evaluate_config(model, config, seeds, context_ids, continuation_ids, n_question, reference,
                                      full_cache, captured if args.reuse_prefill else None, proposal_cache,
                                      args.layerwise)
                record = {
                    "model": model_name, "dataset": DATASET, "data_dir": data_dir_of(args), "task": row["task"],
                    "example_id": row["example_id"], "press": config.label,
                    "compression_ratio": float(config.ratio), "seed": None, "phase": phase,
                    "method": config.press, "temperature": fmt_tau(config.temperature), "seeds": seeds,
                    "budget": config.budget or "global",
                    "sampling": is_sampling(config.press), "n_context": n,
                    "n_question": n_question, "n_answer": int(continuation_ids.shape[1] - n_question),
                    "ref_nll_answer": ref_nll, "ref_seconds": t_full, "reuse_prefill": bool(args.reuse_prefill),
                    **res,
                }
                store.append([record])
                done.add(record_key(row["example_id"], config))
                logger.info("  %-24s r=%.2f KL %.4f (seeds %s) realised %.3f  %.1fs", config.label, config.ratio,
                            float(np.mean(res["kl"])), len(seeds), float(np.mean(res["realised_ratio"])),
                            sum(res["seconds"]))
            del full_cache, captured
            write_report(out_dir)
    write_report(out_dir)
    return out_dir


def _tau(value) -> float | None:
    if value in (None, "1", 1, 1.0):
        return None
    return float(value)


def data_dir_of(args) -> str:
    return f"fidelity-ctx{args.context_length}-dseed{args.dataset_seed}"


# =========================================================================== report


def load_records(out_dir: Path) -> pd.DataFrame:
    from evaluation.store import ResultStore

    records = ResultStore(Path(out_dir) / "records.jsonl", readonly=True).records()
    if not records:
        return pd.DataFrame()
    df = pd.DataFrame.from_records(records)
    if "m" not in df:
        df["m"] = np.nan
    backfill = ResultStore(Path(out_dir) / "m.jsonl", readonly=True).records() \
        if (Path(out_dir) / "m.jsonl").exists() else []
    if backfill:
        known = {(r["data_dir"], r["example_id"], r["press"], float(r["compression_ratio"])): r["m"]
                 for r in backfill}
        keys = zip(df["data_dir"], df["example_id"], df["press"], df["compression_ratio"].astype(float))
        df["m"] = [m if m is not None and np.isfinite(m) else known.get(k, np.nan)
                   for m, k in zip(df["m"].astype(float), keys)]
    df["m"] = df["m"].astype(float)
    for col in ("kl", "kl_answer", "top1", "nll_answer", "realised_ratio"):
        df[f"{col}_mean"] = df[col].map(lambda v: float(np.mean(v)))
    df["nll_delta_mean"] = df["nll_answer_mean"] - df["ref_nll_answer"]
    df["tau"] = df["temperature"].map(lambda v: float(v))
    df["main"] = df["phase"].fillna("main").eq("main") if "phase" in df else True
    return df


def _order(labels, preferred) -> list:
    labels = list(dict.fromkeys(labels))
    first = [p for p in preferred if p in labels]
    return first + sorted(x for x in labels if x not in first)


def kl_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (method label, ratio): mean KL over examples (seed-averaged), t and bootstrap CIs, etc."""
    rows = []
    for (label, ratio), g in df.groupby(["press", "compression_ratio"], sort=False):
        ci = mean_ci(g["kl_mean"])
        blo, bhi = bootstrap_ci(g["kl_mean"])
        ca = mean_ci(g["kl_answer_mean"])
        seed_sd = g["kl"].map(lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"))
        rows.append({
            "press": label, "method": g["method"].iloc[0], "tau": g["tau"].iloc[0], "ratio": ratio,
            "main": bool(g["main"].any()), "kl": ci["mean"], "kl_lo": ci["lo"], "kl_hi": ci["hi"], "kl_boot_lo": blo, "kl_boot_hi": bhi,
            "kl_answer": ca["mean"], "kl_answer_lo": ca["lo"], "kl_answer_hi": ca["hi"],
            "top1": float(g["top1_mean"].mean()), "nll_delta": float(g["nll_delta_mean"].mean()),
            "realised_ratio": float(g["realised_ratio_mean"].mean()),
            "seed_sd": float(np.nanmean(seed_sd)) if seed_sd.notna().any() else float("nan"),
            "n_examples": ci["n"], "n_seeds": int(g["seeds"].map(len).max()),
            "seconds_per_run": float(np.mean([s for v in g["seconds"] for s in v])),
        })
    return pd.DataFrame(rows)


def paired_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per family and ratio: KL(A) - KL(B) per example (seed means), mean with t CI."""
    main = df[(df["tau"] == 1.0) & df["main"]]
    by = {(p, r): g.set_index("example_id")["kl_mean"] for (p, r), g in main.groupby(["press", "compression_ratio"])}
    rows = []
    for family, roles in FAMILIES.items():
        for ratio in sorted(main["compression_ratio"].unique()):
            for a, b in PAIRS:
                if a not in roles or b not in roles:
                    continue
                sa, sb = by.get((roles[a], ratio)), by.get((roles[b], ratio))
                if sa is None or sb is None:
                    continue
                common = sa.index.intersection(sb.index)
                if len(common) == 0:
                    continue
                d = paired_difference(sa[common].to_numpy(), sb[common].to_numpy())
                rows.append({"family": family, "ratio": ratio, "A": roles[a], "B": roles[b],
                             "comparison": f"{a} − {b}", "diff": d["mean"], "lo": d["lo"], "hi": d["hi"],
                             "A_better": d["a_better"], "n": d["n"],
                             "kl_A": float(sa[common].mean()), "kl_B": float(sb[common].mean())})
    return pd.DataFrame(rows)


def scope_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per sampling method run under several budget scopes, per ratio and scope: KL, the paired
    difference to the global scope and to the family's kvpress top-k press (equal ratio per layer)."""
    main = df[(df["tau"] == 1.0) & df["main"]]
    if "budget" not in main or main["budget"].fillna("global").eq("global").all():
        return pd.DataFrame()
    main = main.assign(budget=main["budget"].fillna("global"))
    top_k = {name: roles["top-k"] for roles in FAMILIES.values() for role, name in roles.items() if role != "top-k"}
    by = {(p, r): g.set_index("example_id")["kl_mean"] for (p, r), g in main.groupby(["press", "compression_ratio"])}
    rows = []
    for method in main.loc[main["budget"] != "global", "method"].unique():
        for ratio in sorted(main["compression_ratio"].unique()):
            base, topk = by.get((method, ratio)), by.get((top_k.get(method), ratio))
            for (label, budget), g in main[(main["method"] == method) & (main["compression_ratio"] == ratio)].groupby(
                    ["press", "budget"], sort=False):
                kl = by[(label, ratio)]
                row = {"method": method, "ratio": ratio, "scope": budget, **{f"kl_{k}": v for k, v in
                                                                           mean_ci(kl).items()}}
                for name, other in (("global", base), ("top-k", topk)):
                    if other is None or (name == "global" and budget == "global"):
                        continue
                    common = kl.index.intersection(other.index)
                    d = paired_difference(kl[common].to_numpy(), other[common].to_numpy())
                    row.update({f"vs_{name}": d["mean"], f"vs_{name}_lo": d["lo"], f"vs_{name}_hi": d["hi"],
                                f"vs_{name}_better": f"{d['a_better']}/{d['n']}"})
                row["top_k_press"] = top_k.get(method)
                row["realised_ratio"] = float(g["realised_ratio_mean"].mean())
                rows.append(row)
    return pd.DataFrame(rows)


def layer_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (label, ratio): per-layer relative error (mean over seeds, then examples), bias^2, variance."""
    rows = []
    have = df[df["layer_err"].map(lambda v: isinstance(v, list) and len(v) > 0)]
    for (label, ratio), g in have.groupby(["press", "compression_ratio"], sort=False):
        err = np.mean([np.mean(np.asarray(v), axis=0) for v in g["layer_err"]], axis=0)
        mse = np.mean([np.mean(np.asarray(v) ** 2, axis=0) for v in g["layer_err"]], axis=0)
        bias2 = np.mean([np.asarray(v) for v in g["bias2"]], axis=0)
        var = np.mean([np.asarray(v) for v in g["variance"]], axis=0)
        rows.append({"press": label, "method": g["method"].iloc[0], "tau": g["tau"].iloc[0], "ratio": ratio,
                     "main": bool(g["main"].any()), "err_layers": err.tolist(), "bias2_layers": bias2.tolist(), "var_layers": var.tolist(),
                     "err_mean": float(err.mean()), "err_first": float(err[0]), "err_last": float(err[-1]),
                     "mse_mean": float(mse.mean()), "bias2_mean": float(bias2.mean()), "var_mean": float(var.mean()),
                     "bias2_debiased": debiased_bias2(float(bias2.mean()), float(var.mean()), int(g["seeds"].map(len).min())),
                     "n_seeds": int(g["seeds"].map(len).max()), "n_examples": len(g),
                     "m_mean": float(g["m"].mean()) if g["m"].notna().all() else float("nan")})
    return pd.DataFrame(rows)


def debiased_bias2(bias2: float, variance: float, n_seeds: int) -> float:
    """The plug-in bias^2 over S seeds, ||mean_s o_s - o||^2, overestimates the true bias^2 by
    Var / S in expectation; with variance = (1/S) sum_s ||o_s - mean||^2 (E = (S-1)/S Var), the
    unbiased estimate is bias2 - variance / (S - 1). NaN with one seed."""
    return bias2 - variance / (n_seeds - 1) if n_seeds > 1 else float("nan")


def _ci_cell(mean: float, lo: float, hi: float, fmt: str = "{:.4f}") -> str:
    if not np.isfinite(mean):
        return "–"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return fmt.format(mean)
    return f"{fmt.format(mean)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def plot_kl_bars(summary: pd.DataFrame, path: Path, order: list) -> Path:
    from matplotlib.figure import Figure

    from evaluation.report import _save_png

    ratios = sorted(summary["ratio"].unique())
    labels = [p for p in order if p in set(summary["press"])]
    fig = Figure(figsize=(max(7.0, 0.55 * len(labels) * max(1, len(ratios)) + 2), 4.8))
    ax = fig.subplots()
    width = 0.8 / max(1, len(ratios))
    for k, ratio in enumerate(ratios):
        part = summary[summary["ratio"] == ratio].set_index("press").reindex(labels)
        x = np.arange(len(labels)) + (k - (len(ratios) - 1) / 2) * width
        mean = part["kl"].to_numpy(dtype=float)
        lo = np.where(np.isfinite(part["kl_lo"]), mean - np.maximum(part["kl_lo"].to_numpy(dtype=float), 0.0), 0.0)
        hi = np.where(np.isfinite(part["kl_hi"]), part["kl_hi"].to_numpy(dtype=float) - mean, 0.0)
        ax.bar(x, mean, width=width, yerr=np.vstack([np.maximum(lo, 0), np.maximum(hi, 0)]), capsize=3,
               label=f"ratio {ratio:g}")
    ax.set_xticks(np.arange(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("KL(full || compressed), nats / token")
    positive = summary["kl"][summary["kl"] > 0]
    if len(positive) and positive.max() / max(positive.min(), 1e-12) > 50:
        ax.set_yscale("log")
    ax.set_title("End-to-end KL to the full cache (mean over examples, 95% t-CI clipped at 0)", fontsize=10)
    if len(ratios) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save_png(fig, path)


def plot_layer_error(layers: pd.DataFrame, path: Path, order: list) -> Path | None:
    from matplotlib.figure import Figure

    from evaluation.report import _save_png

    main = layers[(layers["tau"] == 1.0) & layers["main"]]
    if main.empty:
        return None
    ratios = sorted(main["ratio"].unique())
    fig = Figure(figsize=(6.0 * len(ratios), 4.6))
    axes = np.atleast_1d(fig.subplots(1, len(ratios), squeeze=False)[0])
    styles = {"top-k": "-", "sampled": "--", "uncorrected": ":", "HT": "-."}
    role_of = {name: (fam, role) for fam, roles in FAMILIES.items() for role, name in roles.items()}
    colours = {fam: f"C{i}" for i, fam in enumerate(FAMILIES)}
    for ax, ratio in zip(axes, ratios):
        part = main[main["ratio"] == ratio].set_index("press")
        for k, label in enumerate(p for p in order if p in part.index):
            fam, role = role_of.get(label, (None, None))
            ax.plot(part.loc[label, "err_layers"], styles.get(role, "-"),
                    color=colours.get(fam, f"C{(k + 4) % 10}"), label=label, linewidth=1.3)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("relative L2 error of the attention output")
        ax.set_title(f"ratio {ratio:g}")
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("Layer-wise attention error on the continuation (end to end, mean over examples)")
    fig.tight_layout()
    return _save_png(fig, path)


def loglog_slope(x, y) -> float:
    """Least-squares slope of log y on log x over the points with x, y > 0 (NaN with fewer than 3)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    return float(np.polyfit(np.log(x[ok]), np.log(y[ok]), 1)[0]) if ok.sum() >= 3 else float("nan")


def plot_bias_variance(layers: pd.DataFrame, path: Path) -> Path | None:
    """bias² (debiased) and variance of the attention output vs m, the number of draws (log-log,
    with the fitted slope: SNIS theory gives -2 for bias² and -1 for variance as m grows); vs the
    compression ratio when m is unknown."""
    from matplotlib.figure import Figure

    from evaluation.report import _save_png

    samp = layers[layers["n_seeds"] > 1]
    methods = [m for m in dict.fromkeys(samp["method"]) if samp[samp["method"] == m]["ratio"].nunique() > 1
               or samp[samp["method"] == m]["tau"].nunique() > 1]
    if not methods:
        return None
    fig = Figure(figsize=(5.5 * len(methods), 4.4))
    axes = np.atleast_1d(fig.subplots(1, len(methods), squeeze=False)[0])
    for ax, method in zip(axes, methods):
        part = samp[samp["method"] == method]
        by_m = "m_mean" in part and part["m_mean"].notna().all()
        for k, tau in enumerate(sorted(part["tau"].unique())):
            g = part[part["tau"] == tau].sort_values("m_mean" if by_m else "ratio")
            x = g["m_mean"] if by_m else g["ratio"]
            name = "inf" if math.isinf(tau) else f"{tau:g}"
            bias2 = g["bias2_debiased"].where(g["bias2_debiased"] > 0)
            b_label, v_label = f"bias² τ={name}", f"variance τ={name}"
            if by_m:
                b_label += f" (slope {loglog_slope(x, bias2):+.2f})"
                v_label += f" (slope {loglog_slope(x, g['var_mean']):+.2f})"
            ax.plot(x, bias2, "-o", color=f"C{k}", label=b_label, markersize=4)
            ax.plot(x, g["var_mean"], "--s", color=f"C{k}", label=v_label, markersize=4)
        ax.set_yscale("log")
        if by_m:
            ax.set_xscale("log")
        ax.set_xlabel("m, draws of the global budget (mean over examples)" if by_m else "compression ratio")
        ax.set_ylabel("relative squared error (mean over layers)")
        ax.set_title(method)
        ax.legend(fontsize=6, ncol=1)
    fig.suptitle("Debiased bias² and variance of the attention output over seeds")
    fig.tight_layout()
    return _save_png(fig, path)


def write_report(out_dir: Path) -> dict:
    """Rebuild report.md, summary.json and the plots from records.jsonl; returns the paths."""
    from evaluation.report import markdown_table
    from evaluation.store import write_atomic

    out_dir = Path(out_dir)
    df = load_records(out_dir)
    if df.empty:
        logger.warning("no records in %s", out_dir)
        return {}
    preferred = list(DEFAULT_PRESSES)
    summary = kl_summary(df)
    summary = summary.assign(_o=summary["press"].map({p: i for i, p in enumerate(_order(summary["press"], preferred))}))
    summary = summary.sort_values(["ratio", "_o"]).drop(columns="_o").reset_index(drop=True)
    order = _order(summary["press"], preferred)
    main = summary[(summary["tau"] == 1.0) & summary["main"]]
    paired = paired_table(df)
    layers = layer_table(df)
    paths = {}
    md = [f"# Fidelity benchmark: KL to the full cache\n",
          f"{df['example_id'].nunique()} examples ({', '.join(sorted(df['task'].unique()))}), "
          f"context {int(df['n_context'].min())}–{int(df['n_context'].max())} tokens, "
          f"continuation = question + gold answer ({df['n_question'].iloc[0]}–{df['n_question'].max()} + "
          f"{df['n_answer'].min()}–{df['n_answer'].max()} tokens), model {df['model'].iloc[0]}. "
          "KL(full || compressed) in nats per continuation token; the mean over seeds within an example, then "
          "over examples; [lo, hi] is the 95% Student-t interval over examples (bootstrap interval in "
          "summary.json). `answer KL` averages only the positions predicting the answer tokens; "
          "`top-1` is the share of positions where the argmax matches the full cache; `ΔNLL` is the change of "
          "the gold answer's negative log-likelihood (nats, summed over its tokens).\n"]
    for ratio in sorted(main["ratio"].unique()):
        part = main[main["ratio"] == ratio]
        table = pd.DataFrame({
            "KL [95% CI]": [_ci_cell(m, lo, hi) for m, lo, hi in zip(part["kl"], part["kl_lo"], part["kl_hi"])],
            "answer KL [95% CI]": [_ci_cell(m, lo, hi) for m, lo, hi in
                                   zip(part["kl_answer"], part["kl_answer_lo"], part["kl_answer_hi"])],
            "top-1": [f"{v:.3f}" for v in part["top1"]],
            "ΔNLL": [f"{v:+.3f}" for v in part["nll_delta"]],
            "realised ratio": [f"{v:.4f}" for v in part["realised_ratio"]],
            "seed sd": ["–" if not np.isfinite(v) else f"{v:.4f}" for v in part["seed_sd"]],
            "examples × seeds": [f"{a}×{b}" for a, b in zip(part["n_examples"], part["n_seeds"])],
            "s / run": [f"{v:.1f}" for v in part["seconds_per_run"]],
        }, index=pd.Index(part["press"], name="method"))
        md.append(f"## Compression ratio {ratio:g}\n")
        md.append(markdown_table(table))
    if not main.empty:
        paths["kl_bars"] = plot_kl_bars(main, out_dir / "kl_bars.png", order)
        md.append("![KL bars](kl_bars.png)\n")
    if not paired.empty:
        md.append("## Paired comparisons per scorer family\n")
        md.append("KL(A) − KL(B) on the same examples (seed means); negative: A is closer to the full cache. "
                  "[lo, hi]: 95% t-interval over examples; `A better`: examples where KL(A) < KL(B).\n")
        table = pd.DataFrame({
            "family": paired["family"], "ratio": paired["ratio"].map(lambda v: f"{v:g}"),
            "A − B": [f"{a} − {b}" for a, b in zip(paired["A"], paired["B"])],
            "KL A": paired["kl_A"].map(lambda v: f"{v:.4f}"), "KL B": paired["kl_B"].map(lambda v: f"{v:.4f}"),
            "difference [95% CI]": [_ci_cell(m, lo, hi, "{:+.4f}") for m, lo, hi in
                                    zip(paired["diff"], paired["lo"], paired["hi"])],
            "A better": [f"{w}/{n}" for w, n in zip(paired["A_better"], paired["n"])],
        })
        md.append(markdown_table(table, index=False))
    scopes = scope_table(df)
    if not scopes.empty:
        md.append("## Budget scope: global, per layer, per head\n")
        md.append("The same proposal and m rule with the budget solved over all layers (global, the default), per "
                  "layer, or per KV head; kvpress top-k keeps the same ratio in every layer and head. KL with 95% "
                  "t-CI; `vs global` / `vs top-k`: paired KL difference on the same examples (negative: this scope is "
                  "closer to the full cache), with the count of examples where it is better.\n")

        def cell(row, name):
            if not np.isfinite(row.get(f"vs_{name}", np.nan)):
                return "–"
            return f"{_ci_cell(row[f'vs_{name}'], row[f'vs_{name}_lo'], row[f'vs_{name}_hi'], '{:+.4f}')} " \
                   f"({row[f'vs_{name}_better']})"

        table = pd.DataFrame({
            "method": scopes["method"], "ratio": scopes["ratio"].map(lambda v: f"{v:g}"), "scope": scopes["scope"],
            "KL [95% CI]": [_ci_cell(m, lo, hi) for m, lo, hi in zip(scopes["kl_mean"], scopes["kl_lo"], scopes["kl_hi"])],
            "vs global": [cell(r, "global") for r in scopes.to_dict(orient="records")],
            "top-k press": scopes["top_k_press"].fillna("–"),
            "vs top-k": [cell(r, "top-k") for r in scopes.to_dict(orient="records")],
            "realised ratio": scopes["realised_ratio"].map(lambda v: f"{v:.4f}"),
        })
        md.append(markdown_table(table, index=False))
    if not layers.empty:
        md.append("## Layer-wise attention error\n")
        md.append("Relative L2 error ||o − o_full|| / ||o_full|| of each layer's attention output over the "
                  "continuation positions (end to end: it includes the error passed on by earlier layers), mean "
                  "over seeds and examples. bias² and variance (relative squared error, split over the seeds, "
                  "mean over layers) are 0 / – for deterministic methods (one seed: all error is bias). The plug-in bias² "
                  "‖mean_s o_s − o‖² also contains Var/S of the seed mean; `bias² debiased` = bias² − variance/(S−1) "
                  "removes it in expectation.\n")
        lt = layers[layers["main"]]
        lt = lt.assign(_o=lt["press"].map({p: i for i, p in enumerate(order)})).sort_values(["ratio", "_o"])
        table = pd.DataFrame({
            "ratio": lt["ratio"].map(lambda v: f"{v:g}"), "method": lt["press"],
            "mean rel. error": lt["err_mean"].map(lambda v: f"{v:.4f}"),
            "layer 0": lt["err_first"].map(lambda v: f"{v:.4f}"),
            "last layer": lt["err_last"].map(lambda v: f"{v:.4f}"),
            "MSE": lt["mse_mean"].map(lambda v: f"{v:.5f}"),
            "bias²": lt["bias2_mean"].map(lambda v: f"{v:.5f}"),
            "bias² debiased": lt["bias2_debiased"].map(lambda v: f"{v:.5f}" if np.isfinite(v) else "–"),
            "variance": [f"{v:.5f}" if s > 1 else "–" for v, s in zip(lt["var_mean"], lt["n_seeds"])],
            "seeds": lt["n_seeds"],
        })
        md.append(markdown_table(table, index=False))
        p = plot_layer_error(layers, out_dir / "layer_error.png", order)
        if p:
            paths["layer_error"] = p
            md.append("![layer error](layer_error.png)\n")
    sweep = summary[summary["press"].isin(
        summary.loc[summary["tau"] != 1.0, "method"].unique().tolist()) | (summary["tau"] != 1.0)]
    if (summary["tau"] != 1.0).any():
        md.append("## Temperature τ of the correction\n")
        md.append("τ = 1: full correction; τ = inf: plain renormalisation over the kept entries (no correction). "
                  "KL with 95% t-CI; bias² / variance of the attention output (mean over layers).\n")
        sw = sweep.merge(layers[["press", "ratio", "bias2_mean", "bias2_debiased", "var_mean"]], on=["press", "ratio"],
                         how="left") if not layers.empty else sweep.assign(bias2_mean=np.nan, bias2_debiased=np.nan,
                                                                          var_mean=np.nan)
        sw = sw.sort_values(["method", "ratio", "tau"])
        table = pd.DataFrame({
            "method": sw["method"], "ratio": sw["ratio"].map(lambda v: f"{v:g}"),
            "τ": sw["tau"].map(lambda v: "inf" if math.isinf(v) else f"{v:g}"),
            "KL [95% CI]": [_ci_cell(m, lo, hi) for m, lo, hi in zip(sw["kl"], sw["kl_lo"], sw["kl_hi"])],
            "bias²": sw["bias2_mean"].map(lambda v: f"{v:.5f}" if np.isfinite(v) else "–"),
            "bias² debiased": sw["bias2_debiased"].map(lambda v: f"{v:.5f}" if np.isfinite(v) else "–"),
            "variance": sw["var_mean"].map(lambda v: f"{v:.5f}" if np.isfinite(v) else "–"),
            "realised ratio": sw["realised_ratio"].map(lambda v: f"{v:.4f}"),
            "n": sw["n_examples"],
        })
        md.append(markdown_table(table, index=False))
    if not layers.empty:
        p = plot_bias_variance(layers, out_dir / "bias_variance.png")
        if p:
            paths["bias_variance"] = p
            md.append("![bias and variance](bias_variance.png)\n")
    paths["report_md"] = write_atomic(out_dir / "report.md", "\n".join(md))
    payload = {
        "kl": summary.to_dict(orient="records"),
        "paired": paired.to_dict(orient="records"),
        "scopes": scopes.to_dict(orient="records"),
        "layers": layers.to_dict(orient="records"),
        "n_records": len(df),
    }
    paths["summary_json"] = write_atomic(out_dir / "summary.json",
                                         json.dumps(payload, indent=1, default=_json_safe, allow_nan=True))
    return paths


def _json_safe(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(type(obj).__name__)


# =========================================================================== CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evaluation.bench.fidelity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 examples at 1024 tokens, output under <out>/quick")
    p.add_argument("--presses", nargs="+", default=list(DEFAULT_PRESSES))
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="seeds of the sampling methods (deterministic methods run the first one only)")
    p.add_argument("--n-examples", type=int, default=None, help="default 6 (3 with --quick)")
    p.add_argument("--context-length", type=int, default=None, help="default 2048 (1024 with --quick)")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--model", default=None, help="HF id or path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT} ({DEFAULT_OUT}/quick with --quick)")
    p.add_argument("--no-layerwise", dest="layerwise", action="store_false",
                   help="skip the per-layer attention outputs (KL only)")
    p.add_argument("--sweep", action="store_true",
                   help="also run the temperature / ratio sweep of --sweep-presses (bias² vs variance)")
    p.add_argument("--sweep-presses", nargs="+", default=list(SWEEP_PRESSES))
    p.add_argument("--sweep-ratios", nargs="+", type=float, default=list(SWEEP_RATIOS))
    p.add_argument("--temperatures", nargs="+", type=float, default=list(SWEEP_TEMPERATURES),
                   help="tau values of the sweep ('inf' = no correction)")
    p.add_argument("--scopes", nargs="+", default=[], choices=["global", "layer", "head"],
                   help="also run every sampling press under these budget scopes (scope table vs kvpress top-k)")
    p.add_argument("--no-reuse-prefill", dest="reuse_prefill", action="store_false",
                   help="rerun the compressed prefill for every configuration instead of replaying the press "
                        "hooks on the full prefill")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new example after this many minutes (rerun to resume)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report-only", action="store_true", help="rebuild the report from records.jsonl")
    return p


def resolve(args) -> argparse.Namespace:
    if args.n_examples is None:
        args.n_examples = 3 if args.quick else 6
    if args.context_length is None:
        args.context_length = 1024 if args.quick else 2048
    if args.out is None:
        args.out = DEFAULT_OUT / "quick" if args.quick else DEFAULT_OUT
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve(parser().parse_args(argv))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logger.setLevel(logging.INFO)
    if args.report_only:
        paths = write_report(args.out)
    else:
        run(args)
        paths = write_report(args.out)
    if "report_md" in paths:
        print(Path(paths["report_md"]).read_text())
        print("written:", ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
