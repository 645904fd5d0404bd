"""The fidelity measurement: configurations, teacher-forced KL and attention error, the run loop.

A configuration is the runner's ``evaluation.engine.runner.Config`` (press, compression ratio, seed,
overrides); the overrides carry a temperature other than 1 and a budget scope other than global,
so the label of a configuration is the runner's (``prob_min_h[temperature=inf]``). Each example is
prefilled once (``engine.Prefill``), every configuration and seed compresses a copy of it
(``Prefill.compress``, proposals shared by every ratio and seed) and scores the continuation
(``engine.teacher_forced``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch

from evaluation.bench.fidelity import DEFAULT_PRESSES
from evaluation.engine import Prefill, cache_summary, teacher_forced
from evaluation.engine.runner import Config
from evaluation.metrics.continuation import kl_per_position  # noqa: F401  (also this module's name for it)
from evaluation.store.results import ResultStore
from kvpress_prob.names.registry import PRESSES

logger = logging.getLogger("evaluation.bench.fidelity")

DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
SWEEP_PRESSES = ("prob_min_h", "prob_snapkv")
SWEEP_RATIOS = (0.25, 0.5, 0.75, 0.9)
SWEEP_TEMPERATURES = (1.0, 2.0, 4.0, float("inf"))
DATASET = "ruler"

__all__ = ["DEFAULT_PRESSES", "setting", "build_configs", "evaluate_config", "run"]


# =========================================================================== configurations


def setting(press: str, ratio: float, temperature: float | None = None, budget: str | None = None) -> Config:
    """The configuration of ``press`` at ``ratio`` (seed 0); a temperature of 1 and the global budget
    are the registry's defaults and give no override, so every label names one setting."""
    overrides = []
    if temperature is not None and float(temperature) != 1.0:
        overrides.append(("temperature", float(temperature)))
    if budget not in (None, "global"):
        overrides.append(("budget", str(budget)))
    return Config(press, float(ratio), 0, tuple(overrides))


def temperature_of(config: Config) -> float:
    return float(dict(config.overrides).get("temperature", 1.0))


def budget_of(config: Config) -> str:
    return str(dict(config.overrides).get("budget", "global"))


def fmt_temperature(temperature: float) -> str:
    return "inf" if math.isinf(temperature) else f"{temperature:g}"


def seeds_for(config: Config, seeds: list[int]) -> list[int]:
    """Every seed for a sampling configuration, the first one for a deterministic one."""
    return list(seeds) if config.samples else list(seeds[:1])


def record_setting(record: dict) -> Config:
    """The configuration a stored record was measured with (records written before the runner's
    labels were used named the same setting ``press@tau=...@budget=...``)."""
    temperature = record.get("temperature")
    return setting(record["method"], record["compression_ratio"],
                   None if temperature in (None, "1") else float(temperature),
                   record.get("budget"))


def record_key(example_id: str, config: Config) -> tuple:
    return str(example_id), config.label, round(config.compression_ratio, 6)


def build_configs(presses, ratios, sweep: bool = False, sweep_presses=SWEEP_PRESSES, sweep_ratios=SWEEP_RATIOS,
                  temperatures=SWEEP_TEMPERATURES, scopes=()) -> tuple[list[Config], list[Config]]:
    """(main KL grid, extra sweep configurations not already in the grid). ``scopes`` adds every
    sampling press of the grid under each other budget scope (layer, head) to the main grid."""
    for name in list(presses) + (list(sweep_presses) if sweep else []):
        if name not in PRESSES:
            raise SystemExit(f"unknown press {name!r}; valid names: {', '.join(sorted(PRESSES))}")
    main = [setting(p, r) for r in ratios for p in presses]
    main += [setting(p, r, budget=scope) for r in ratios for p in presses if setting(p, r).samples
             for scope in scopes if scope != "global"]
    extra: list[Config] = []
    if sweep:
        seen = set(main)
        for p in sweep_presses:
            if not setting(p, 0.5).samples:
                raise SystemExit(f"--sweep-presses must be sampling presses, got {p!r}")
            for r in sweep_ratios:
                for t in temperatures:
                    c = setting(p, r, t)
                    if c not in seen:
                        seen.add(c)
                        extra.append(c)
    return main, extra


# =========================================================================== inputs


def load_examples(tokenizer, context_length: int, n_examples: int, seed: int, tasks) -> pd.DataFrame:
    from evaluation.tasks.ruler.offline import generate_ruler

    return generate_ruler(tokenizer, context_length, n_examples, seed, tasks=list(tasks)).reset_index(drop=True)


def build_inputs(pipe, tokenizer, row, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(context_ids (1, n), continuation_ids (1, T), n_question), on ``device``: the chat-formatted
    context and question (with answer prefix) as the kvpress pipeline builds them, then the gold answer."""
    encoded = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)
    question_ids = encoded["questions_ids"][0]
    answer = row["answer"][0] if isinstance(row["answer"], (list, tuple, np.ndarray)) else str(row["answer"])
    prefix = row["answer_prefix"]
    sep = "" if (not prefix or prefix[-1].isspace()) else " "
    answer_ids = tokenizer.encode(sep + str(answer), add_special_tokens=False, return_tensors="pt")
    continuation_ids = torch.cat([question_ids, answer_ids.to(question_ids.dtype)], dim=1)
    return encoded["context_ids"].to(device), continuation_ids.to(device), question_ids.shape[1]


# =========================================================================== figures of one run


def relative_error(outputs: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per-layer ||o - o_ref||_F / ||o_ref||_F for (L, T, hidden) tensors."""
    num = (outputs.double() - reference.double()).flatten(1).norm(dim=1)
    den = reference.double().flatten(1).norm(dim=1).clamp_min(1e-300)
    return (num / den).tolist()


def bias_variance(outputs, reference) -> dict:
    """Split the relative squared error of seeded estimates into bias^2 and variance.

    outputs (S, ...) one estimate per seed, reference (...). Returns bias2, variance and mse,
    each divided by ||reference||^2; mse = bias2 + variance (variance with 1/S).
    """
    outputs = torch.as_tensor(outputs, dtype=torch.float64)
    reference = torch.as_tensor(reference, dtype=torch.float64)
    scale = float(reference.pow(2).sum().clamp_min(1e-300))
    mean = outputs.mean(dim=0)
    bias2 = float((mean - reference).pow(2).sum()) / scale
    variance = float((outputs - mean).pow(2).flatten(1).sum(dim=1).mean()) / scale
    mse = float((outputs - reference).pow(2).flatten(1).sum(dim=1).mean()) / scale
    return {"bias2": bias2, "variance": variance, "mse": mse}


def draws_of(press) -> float | None:
    """m, the number of draws of a SamplingPress's budget when one m serves every head (None otherwise)."""
    m = (getattr(press, "stats", None) or {}).get("m")
    return float(m) if isinstance(m, (int, float)) else None


# =========================================================================== one example


def reference_of(model, prefill: Prefill, continuation_ids: torch.Tensor, n_question: int,
                 layerwise: bool = True) -> dict:
    """The full cache's logits, attention outputs and gold-answer NLL on the continuation."""
    n = prefill.context_ids.shape[1]
    logits, attention = teacher_forced(model, prefill.compress(None), continuation_ids, n, capture_attention=layerwise)
    answer_rows = slice(n_question - 1, continuation_ids.shape[1] - 1)
    nll = float(-torch.log_softmax(logits[answer_rows].double(), -1).gather(-1, continuation_ids[0, n_question:, None]).sum())
    return {"logits": logits, "attention": attention, "nll_answer": nll}


def evaluate_config(model, prefill: Prefill, config: Config, seeds: list[int], continuation_ids: torch.Tensor,
                    n_question: int, reference: dict, layerwise: bool = True) -> dict:
    """All seeds of one configuration on one example: KL, answer KL, top-1 agreement, answer NLL,
    realised ratio, m, per-layer relative error, and bias^2 / variance over the seeds."""
    n, t = prefill.context_ids.shape[1], continuation_ids.shape[1]
    answer_rows = slice(n_question - 1, t - 1)  # rows predicting the gold answer tokens
    answer_tokens = continuation_ids[0, n_question:]
    out = {k: [] for k in ("kl", "kl_answer", "top1", "nll_answer", "realised_ratio", "layer_err", "seconds")}
    out["m"], attention_runs = None, []
    for seed in seeds:
        start = time.perf_counter()
        press = replace(config, seed=seed).build()
        cache = prefill.compress(press)
        realised, _ = cache_summary(cache, press, n)
        out["m"] = draws_of(press)
        logits, attention = teacher_forced(model, cache, continuation_ids, n, capture_attention=layerwise)
        kl = kl_per_position(reference["logits"], logits)
        logp = torch.log_softmax(logits[answer_rows].double(), dim=-1)
        out["kl"].append(float(kl.mean()))
        out["kl_answer"].append(float(kl[answer_rows].mean()))
        out["top1"].append(float((logits.argmax(-1) == reference["logits"].argmax(-1)).double().mean()))
        out["nll_answer"].append(float(-logp.gather(-1, answer_tokens[:, None]).sum()))
        out["realised_ratio"].append(float(realised))
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


# =========================================================================== the run


def data_dir_of(context_length: int, dataset_seed: int) -> str:
    return f"fidelity-ctx{context_length}-dseed{dataset_seed}"


def run(args, on_example: Callable[[Path], object] | None = None) -> Path:
    """Every configuration of ``args`` on every example not yet in ``<args.out>/records.jsonl``;
    ``on_example(out_dir)`` runs after each example (the CLI rewrites the report there)."""
    from kvpress import KVPressTextGenerationPipeline

    from kvpress_prob import load_model

    out_dir = Path(args.out)
    store = ResultStore(out_dir / "records.jsonl")
    data_dir = data_dir_of(args.context_length, args.dataset_seed)
    done = {record_key(r["example_id"], record_setting(r)) for r in store.records() if r.get("data_dir") == data_dir}
    main_configs, sweep_configs = build_configs(
        args.presses, args.ratios, args.sweep, args.sweep_presses, args.sweep_ratios, args.temperatures, args.scopes)
    if args.threads:
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
            if not todo:
                continue
            if deadline is not None and time.time() > deadline:
                logger.warning("--max-minutes reached: stopping (rerun the same command to resume)")
                return out_dir
            start = time.perf_counter()
            context_ids, continuation_ids, n_question = build_inputs(pipe, tokenizer, row, model.device)
            n = context_ids.shape[1]
            prefill = Prefill(model, context_ids, [config.build() for config in todo])
            reference = reference_of(model, prefill, continuation_ids, n_question, args.layerwise)
            t_full = time.perf_counter() - start
            logger.info("[%s] %s: n=%d, continuation %d (answer %d), full prefill + continuation %.1fs, %d configs",
                        phase, row["example_id"], n, continuation_ids.shape[1],
                        continuation_ids.shape[1] - n_question, t_full, len(todo))
            for config in todo:
                seeds = seeds_for(config, args.seeds)
                res = evaluate_config(model, prefill, config, seeds, continuation_ids, n_question, reference,
                                      args.layerwise)
                store.append([{
                    "model": model_name, "dataset": DATASET, "data_dir": data_dir, "task": row["task"],
                    "example_id": row["example_id"], "press": config.label,
                    "compression_ratio": config.compression_ratio, "seed": None, "phase": phase,
                    "method": config.press, "temperature": fmt_temperature(temperature_of(config)), "seeds": seeds,
                    "budget": budget_of(config), "sampling": config.samples, "n_context": n,
                    "n_question": n_question, "n_answer": int(continuation_ids.shape[1] - n_question),
                    "ref_nll_answer": reference["nll_answer"], "ref_seconds": t_full, **res,
                }])
                done.add(record_key(row["example_id"], config))
                logger.info("  %-28s r=%.2f KL %.4f (seeds %s) realised %.3f  %.1fs", config.label,
                            config.compression_ratio, float(np.mean(res["kl"])), len(seeds),
                            float(np.mean(res["realised_ratio"])), sum(res["seconds"]))
            del prefill
            if on_example is not None:
                on_example(out_dir)
    return out_dir
