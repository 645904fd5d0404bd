"""The speed bench's runs: timed prefills, lockstep decoding, cache bytes and prefill peak memory."""

from __future__ import annotations

import statistics
from typing import NamedTuple

import pandas as pd
import torch
from transformers import DynamicCache

from evaluation.bench import common
from evaluation.engine import Prefill, press_prefill
from evaluation.engine.runner import REFERENCE, Config
from kvpress_prob.cache import cache_held_bytes
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.sampling import language_model

PREFILL_PRESSES = [REFERENCE, "snapkv", "prob_snapkv", "knorm", "prob_knorm", "prob_min", "prob_min_h"]  # the default of --presses
PEAK_PRESSES = [REFERENCE, "snapkv", "prob_snapkv", "prob_min_h"]
DECODE_VARIANTS = {
    "prob_snapkv (corrected)": "prob_snapkv",
    "prob_snapkv_nocorr (same kept set, bias 0)": "prob_snapkv_nocorr",
    "prob_snapkv padded, plain sdpa (timing only)": "prob_snapkv_plain",
    "snapkv (kvpress, plain sdpa)": "snapkv",
    "full cache": REFERENCE,
}


def cache_bytes(cache) -> int:
    """Bytes of keys + values held by a cache: the storage of every tensor each layer holds (a view keeps its
    whole tensor; a ragged layer its flat buffers), ``kvpress_prob.cache.cache_held_bytes``."""
    return cache_held_bytes(cache)[0]


def attention_modules(model) -> list:
    return [layer.self_attn for layer in language_model(model).layers]


def biases_of(model) -> list:
    """The correction bias (or None) of every attention module, to put back with ``set_biases``."""
    return [correction.bias_of(module) for module in attention_modules(model)]


def masks_of(model) -> list:
    """kvpress's head-wise masks (AdaKV's ``masked_key_indices``, or None) of every attention module."""
    return [getattr(module, "masked_key_indices", None) for module in attention_modules(model)]


def set_masks(model, masks: list) -> None:
    for module, mask in zip(attention_modules(model), masks):
        module.masked_key_indices = mask


def set_biases(model, biases: list) -> None:
    for module, bias in zip(attention_modules(model), biases):
        correction.set_bias(module, bias)


def bias_bytes(model) -> int:
    """Bytes of the correction bias held on the attention modules (0 when there is none)."""
    return sum(b.numel() * b.element_size() for b in biases_of(model) if b is not None)


def clear_biases(model) -> None:
    """Remove the correction of every attention module (its cache is then read by plain sdpa)."""
    set_biases(model, [None] * len(attention_modules(model)))


class Timed(NamedTuple):
    cache: DynamicCache
    press: object
    watch: common.Stopwatch
    memory: common.PeakMemory


@torch.no_grad()
def prefill(model, ids: torch.Tensor, name: str, ratio: float, seed: int = 0) -> Timed:
    """One prefill under the press ``name`` (``REFERENCE``: none), timed, with its peak memory."""
    press = Config(name, ratio, seed).build()
    with common.PeakMemory(model.device) as memory, common.Stopwatch(model.device) as watch:
        cache = press_prefill(model, ids, press)
    return Timed(cache, press, watch, memory)


@torch.no_grad()
def engine_peak(model, ids: torch.Tensor, name: str, ratio: float) -> common.PeakMemory:
    """Peak memory of the runner's path for one press: ``engine.Prefill`` (the full prefill, the
    press's proposal or scores computed in its hooks) then ``compress``."""
    with common.PeakMemory(model.device) as memory:
        shared = Prefill(model, ids, [Config(name, ratio, 0).build()])
        cache = shared.compress(Config(name, ratio, 0).build())
    del shared, cache
    clear_biases(model)
    return memory


def _step(model, cache, token: torch.Tensor, position: int):
    model(input_ids=token.view(1, 1), past_key_values=cache,
          position_ids=torch.tensor([[position]], device=token.device))


def _timing(times: list[float], cpu: list[float]) -> dict:
    return {"steps": len(times), "seconds": sum(times), "tok_per_s": len(times) / sum(times),
            "cpu_seconds": sum(cpu), "tok_per_cpu_s": len(cpu) / sum(cpu),
            "median_step_ms": 1e3 * statistics.median(times), "loadavg": (common.loadavg() or [None])[0]}


@torch.no_grad()
def decode(model, cache, n: int, tokens: torch.Tensor, warmup: int) -> dict:
    """Decoding of a fixed token sequence (on the model's device); times every step after ``warmup``."""
    times, cpu = [], []
    for i, token in enumerate(tokens):
        with common.Stopwatch(model.device) as watch:
            _step(model, cache, token, n + i)
        if i >= warmup:
            times.append(watch.wall)
            cpu.append(watch.cpu)
    return _timing(times, cpu)


@torch.no_grad()
def decode_interleaved(model, variants: dict, n: int, tokens: torch.Tensor, warmup: int) -> dict:
    """Decode every variant in lockstep: step i of each variant (in an order rotated every step),
    then step i + 1, ... so that load from other processes, which drifts over time, hits every
    variant alike. ``variants``: name -> (cache, biases); a variant's biases are put on the attention
    modules before each of its steps (the correction state is per module, not per cache), and so are its
    kvpress masks when it has them (name -> (cache, biases, masks): AdaKV's masked cache).
    Returns name -> timing figures over the steps after ``warmup`` (with ``cuda_peak_bytes``, the
    largest ``max_memory_allocated`` of its steps, on CUDA)."""
    names = list(variants)
    times, cpu = {v: [] for v in names}, {v: [] for v in names}
    peak = {v: None for v in names}
    for i, token in enumerate(tokens):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            cache, biases, *masks = variants[name]
            set_biases(model, biases)
            set_masks(model, masks[0] if masks else [None] * len(biases))
            with common.Stopwatch(model.device) as watch:
                _step(model, cache, token, n + i)
            if i >= warmup:
                times[name].append(watch.wall)
                cpu[name].append(watch.cpu)
                if watch.cuda_peak_bytes is not None:
                    peak[name] = max(peak[name] or 0, watch.cuda_peak_bytes)
    clear_biases(model)
    set_masks(model, [None] * len(attention_modules(model)))
    return {name: _timing(times[name], cpu[name]) | {"cuda_peak_bytes": peak[name]} for name in names}


def memory_row(model, cache, press, name: str, ratio: float, n: int, full_bytes: int) -> dict:
    held = cache_bytes(cache)
    row = {"press": name, "ratio": ratio, "n": n, "bytes_full": full_bytes, "bytes_stored": held}
    if press is not None and getattr(press, "stats", None):
        stats = press.stats
        row.update(
            bytes_kept=stats["bytes_kept"],
            bytes_bias=bias_bytes(model),
            realised_ratio=stats["realised_ratio"],
            stats_bytes_stored=stats["bytes_stored"],
            stats_bytes_bias=stats["bytes_bias"],
            stats_bytes_full=stats["bytes_full"],
        )
    else:
        row.update(bytes_kept=held, bytes_bias=0, realised_ratio=1.0 - held / full_bytes)
    row["stored_over_budget"] = held / ((1.0 - ratio) * full_bytes)
    row["kept_over_budget"] = row["bytes_kept"] / ((1.0 - ratio) * full_bytes)
    row["padding"] = held / max(1, row["bytes_kept"])
    row["bias_over_stored"] = row["bytes_bias"] / held
    return row


def draw_row(n: int, rep: int, name: str, ratio: float, press) -> dict:
    return {"n": n, "repeat": rep, "press": name, "ratio": ratio,
            "realised_ratio": press.stats["realised_ratio"], "padding": press.stats["padding"]}


def peak_row(n: int, name: str, path: str, memory: common.PeakMemory, full_bytes: int) -> dict:
    return {"n": n, "press": name, "path": path, "method": memory.method, "start_bytes": memory.start_bytes,
            "peak_bytes": memory.peak_bytes, "extra_bytes": memory.extra_bytes, "full_kv_bytes": full_bytes,
            "extra_over_full_kv": memory.extra_bytes / full_bytes}


def run(model, tokenizer, lengths: list[int], repeats: int, ratio: float, memory_ratios: list[float],
        decode_steps: int, warmup_steps: int, presses: list[str], log=print, checkpoint=None) -> dict:
    """Run every measurement; ``checkpoint(raw, progress)`` (optional) is called with the frames so far
    after every completed round and after each length's memory runs, so a long run leaves results
    behind even if it is stopped."""
    prefill_rows, decode_rows, memory_rows, draw_rows, peak_rows = [], [], [], [], []
    # presses beyond the default ones (e.g. <scorer>_adaptive against adakv_<scorer>): each is also decoded
    # as its own variant, and its memory is measured at every ratio
    extra = [name for name in presses if name not in PREFILL_PRESSES and name not in DECODE_VARIANTS.values()]

    def frames() -> dict:
        return {"prefill": pd.DataFrame(prefill_rows), "decode": pd.DataFrame(decode_rows),
                "memory": pd.DataFrame(memory_rows), "draws": pd.DataFrame(draw_rows), "peak": pd.DataFrame(peak_rows)}

    device = model.device
    decode_tokens_seed = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = common.context_ids(tokenizer, n, device=device)
        tokens = torch.randint(100, 10000, (warmup_steps + decode_steps,), generator=decode_tokens_seed).to(device)
        warm = prefill(model, ids, REFERENCE, ratio)  # untimed warm-up prefill and decode at this length
        full_bytes = cache_bytes(warm.cache)  # before decoding appends tokens
        decode(model, warm.cache, n, tokens[: warmup_steps + 2], warmup_steps)
        log(f"[speed] n={n}: warm-up prefill {warm.watch.wall:.1f}s, full K+V {full_bytes / 2**20:.1f} MiB")
        del warm
        for rep in range(repeats):
            keep_for_decode, kept_sets = {}, {}
            for name in presses + ["prob_snapkv_nocorr"]:
                cache, press, watch, memory = prefill(model, ids, name, ratio, seed=rep)
                prefill_rows.append({"n": n, "repeat": rep, "press": name, "seconds": watch.wall,
                                     "cpu_seconds": watch.cpu, "cuda_peak_bytes": watch.cuda_peak_bytes,
                                     "loadavg": (common.loadavg() or [None])[0]})
                if rep == 0 and name in PEAK_PRESSES:
                    peak_rows.append(peak_row(n, name, "press", memory, full_bytes))
                if press is not None and getattr(press, "stats", None):
                    draw_rows.append(draw_row(n, rep, name, ratio, press))
                    kept_sets[name] = press.last_draw.keep
                if rep == 0 and name in (REFERENCE, "snapkv", "prob_snapkv", *extra):
                    memory_rows.append(memory_row(model, cache, press, name, ratio, n, full_bytes))
                for variant, source in DECODE_VARIANTS.items():
                    if source == name:
                        keep_for_decode[variant] = (cache, biases_of(model))
                if name in extra:
                    keep_for_decode[name] = (cache, biases_of(model), masks_of(model))
                if name == "prob_snapkv_nocorr":
                    # the same padded cache with the bias removed: plain sdpa on exactly the stored size
                    plain = DynamicCache()
                    for layer_idx, layer in enumerate(cache.layers):
                        plain.update(layer.keys.clone(), layer.values.clone(), layer_idx)
                    keep_for_decode["prob_snapkv padded, plain sdpa (timing only)"] = (plain, [None] * len(cache.layers))
                    if "prob_snapkv" in kept_sets:
                        draw_rows[-1]["same_kept_as_corrected"] = bool(torch.equal(kept_sets[name], kept_sets["prob_snapkv"]))
                clear_biases(model)
                del cache, press
                log(f"[speed] n={n} rep={rep} {name}: prefill {watch.wall:.2f}s")
            variants = {v: keep_for_decode[v] for v in [*DECODE_VARIANTS, *extra] if v in keep_for_decode}
            results = decode_interleaved(model, variants, n, tokens, warmup_steps)
            for variant, result in results.items():
                decode_rows.append({"n": n, "repeat": rep, "variant": variant, **result})
            del variants, keep_for_decode
            log(f"[speed] n={n} rep={rep}: decode " + ", ".join(f"{v.split(' ')[0]} {r['tok_per_s']:.2f}" for v, r in results.items()))
            if checkpoint is not None:
                checkpoint(frames(), f"n={n}: {rep + 1}/{repeats} rounds")
        for name in [p for p in PEAK_PRESSES if p in presses]:
            peak_rows.append(peak_row(n, name, "engine", engine_peak(model, ids, name, ratio), full_bytes))
        log(f"[speed] n={n}: peak memory " + ", ".join(
            f"{r['press']}/{r['path']} +{r['extra_bytes'] / 2**20:.0f} MiB" for r in peak_rows if r["n"] == n))
        for r in memory_ratios:
            if r == ratio:
                continue
            for name in ("snapkv", "prob_snapkv", *extra):
                cache, press, _, _ = prefill(model, ids, name, r, seed=0)
                memory_rows.append(memory_row(model, cache, press, name, r, n, full_bytes))
                if press is not None and getattr(press, "stats", None):
                    draw_rows.append(draw_row(n, 0, name, r, press))
                clear_biases(model)
                del cache, press
        log(f"[speed] n={n}: memory done")
        if checkpoint is not None:
            checkpoint(frames(), f"n={n}: done (memory ratios included)")
    return frames()
