"""Speed and memory of probabilistic eviction vs kvpress top-k and the full cache.

For each context length (a RULER context cut to exactly that many tokens), ``repeats`` rounds; in
each round every press is run once, in the same order (round-robin, so that slow drift or other
load on the machine hits every press alike), and the median over rounds is reported:

- prefill: wall time of ``with press(model): model.model(input_ids, past_key_values=cache)``,
  eviction included (for SamplingPress it runs in a hook when the decoder forward ends);
- decode: ``decode_steps`` single-token steps ``model(input_ids=tok, past_key_values=cache,
  position_ids=n + i)`` after ``warmup_steps`` untimed ones, the variants interleaved step by step
  (each variant's SNIS bias is put back on the attention modules before its step), on (a) the corrected prob_snapkv
  cache, (b) the same kept set uncorrected (prob_snapkv_nocorr, same seed: bias 0, still the
  corrected code path), (c) the same padded cache with the bias removed, i.e. plain sdpa
  (timing only: padding is attended, the output is meaningless), (d) kvpress snapkv's cache of
  (1 - r) n entries (plain sdpa), (e) the full cache;
- memory: bytes of keys + values held in the cache (sum of numel * element_size over layers),
  for the full cache, kvpress snapkv and prob_snapkv (kept entries, stored = padded, bias
  metadata), at r = ``ratio`` and at the ``memory_ratios``.

The SamplingPress seed is the round index, so the realised ratios average over draws.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers import DynamicCache

from evaluation.bench import common

PREFILL_PRESSES = ["none", "snapkv", "prob_snapkv", "knorm", "prob_knorm", "prob_min", "prob_min_h"]
DECODE_VARIANTS = {
    "prob_snapkv (corrected)": "prob_snapkv",
    "prob_snapkv_nocorr (same kept set, bias 0)": "prob_snapkv_nocorr",
    "prob_snapkv padded, plain sdpa (timing only)": "prob_snapkv_plain",
    "snapkv (kvpress, plain sdpa)": "snapkv",
    "full cache": "none",
}
TARGETS = {
    "prefill": 1.10,  # prob_snapkv prefill / snapkv prefill <=
    "decode": 0.95,  # corrected tok/s / uncorrected tok/s >=
    "stored": 1.05,  # stored K+V / ((1 - r) full) <= at r = 0.5
    "ratio": 1e-3,  # mean |realised - target| <=
}


# --------------------------------------------------------------------------- measurement


def cache_bytes(cache) -> int:
    """Bytes of keys + values held by a DynamicCache: sum of numel * element_size over layers."""
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def attention_modules(model) -> list:
    from kvpress_prob.press import language_model

    return [layer.self_attn for layer in language_model(model).layers]


def bias_bytes(model) -> int:
    """Bytes of the SNIS bias held on the attention modules (0 when there is none)."""
    from kvpress_prob import correction

    total = 0
    for module in attention_modules(model):
        bias = correction.bias_of(module)
        if bias is not None:
            total += bias.numel() * bias.element_size()
    return total


def make_press(name: str, ratio: float, seed: int):
    from kvpress_prob import get_press

    if name == "none":
        return None
    if name.startswith("prob_"):
        return get_press(name, ratio, seed=seed)
    return get_press(name, ratio)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, name: str, ratio: float, seed: int = 0):
    """Run one prefill; returns (cache, press or None, Stopwatch)."""
    press = make_press(name, ratio, seed)
    cache = DynamicCache()
    with common.Stopwatch() as watch:
        if press is None:
            model.model(input_ids=ids, past_key_values=cache)
        else:
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
    return cache, press, watch


def strip_bias(model) -> list[int]:
    """Remove the SNIS bias of every attention module (the cache is then read by plain sdpa);
    returns the stored length of each layer."""
    from kvpress_prob import correction

    lengths = []
    for module in attention_modules(model):
        bias = correction.bias_of(module)
        lengths.append(None if bias is None else bias.shape[-1])
        correction.reset(module)
    return lengths


@torch.no_grad()
def decode(model, cache, n: int, tokens: torch.Tensor, warmup: int) -> dict:
    """Greedy-free decoding of a fixed token sequence; times every step after ``warmup``."""
    times, cpu = [], []
    for i, token in enumerate(tokens.tolist()):
        start, cpu0 = time.perf_counter(), time.process_time()
        model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[n + i]]))
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu0)
    total = sum(times)
    return {
        "steps": len(times),
        "seconds": total,
        "tok_per_s": len(times) / total,
        "cpu_seconds": sum(cpu),
        "tok_per_cpu_s": len(cpu) / sum(cpu),
        "median_step_ms": 1e3 * statistics.median(times),
        "loadavg": (common.loadavg() or [None])[0],
    }


def snapshot_bias(model) -> list:
    """The SNIS bias tensor (or None) of every attention module, to restore with ``set_bias``."""
    from kvpress_prob import correction

    return [correction.bias_of(module) for module in attention_modules(model)]


def set_bias(model, biases: list) -> None:
    from kvpress_prob import correction

    for module, bias in zip(attention_modules(model), biases):
        correction.set_bias(module, bias)


@torch.no_grad()
def decode_interleaved(model, variants: dict, n: int, tokens: torch.Tensor, warmup: int) -> dict:
    """Decode every variant in lockstep: step i of each variant (in an order rotated every step),
    then step i + 1, ... so that load from other processes, which drifts over time, hits every
    variant alike. ``variants``: name -> (cache, biases); a variant's biases are put on the attention
    modules before each of its steps (the correction state is per module, not per cache).
    Returns name -> timing figures over the steps after ``warmup``."""
    names = list(variants)
    times = {v: [] for v in names}
    cpu = {v: [] for v in names}
    for i, token in enumerate(tokens.tolist()):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            cache, biases = variants[name]
            set_bias(model, biases)
            start, cpu0 = time.perf_counter(), time.process_time()
            model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[n + i]]))
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu0)
    set_bias(model, [None] * len(attention_modules(model)))
    load = (common.loadavg() or [None])[0]
    return {
        name: {"steps": len(times[name]), "seconds": sum(times[name]), "tok_per_s": len(times[name]) / sum(times[name]),
               "cpu_seconds": sum(cpu[name]), "tok_per_cpu_s": len(cpu[name]) / sum(cpu[name]),
               "median_step_ms": 1e3 * statistics.median(times[name]), "loadavg": load}
        for name in names
    }


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


def run(
    model,
    tokenizer,
    lengths: list[int],
    repeats: int,
    ratio: float,
    memory_ratios: list[float],
    decode_steps: int,
    warmup_steps: int,
    presses: list[str],
    log=print,
    checkpoint=None,
) -> dict:
    """Run every measurement; ``checkpoint(raw, progress)`` (optional) is called with the frames so far
    after every completed round and after each length's memory runs, so a long run leaves results
    behind even if it is stopped."""
    prefill_rows, decode_rows, memory_rows, draw_rows = [], [], [], []

    def frames() -> dict:
        return {"prefill": pd.DataFrame(prefill_rows), "decode": pd.DataFrame(decode_rows),
                "memory": pd.DataFrame(memory_rows), "draws": pd.DataFrame(draw_rows)}

    decode_tokens_seed = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = common.context_ids(tokenizer, n)
        tokens = torch.randint(100, 10000, (warmup_steps + decode_steps,), generator=decode_tokens_seed)
        # warm-up: one untimed prefill and decode at this length
        cache, _, watch = prefill(model, ids, "none", ratio)
        full_bytes = cache_bytes(cache)  # before decoding appends tokens
        decode(model, cache, n, tokens[: warmup_steps + 2], warmup_steps)
        del cache
        log(f"[speed] n={n}: warm-up prefill {watch.wall:.1f}s, full K+V {full_bytes / 2**20:.1f} MiB")
        for rep in range(repeats):
            keep_for_decode, kept_sets = {}, {}
            for name in presses + ["prob_snapkv_nocorr"]:
                cache, press, watch = prefill(model, ids, name, ratio, seed=rep)
                prefill_rows.append(
                    {"n": n, "repeat": rep, "press": name, "seconds": watch.wall, "cpu_seconds": watch.cpu,
                     "loadavg": (common.loadavg() or [None])[0]}
                )
                if press is not None and getattr(press, "stats", None):
                    draw_rows.append(
                        {"n": n, "repeat": rep, "press": name, "ratio": ratio,
                         "realised_ratio": press.stats["realised_ratio"], "padding": press.stats["padding"]}
                    )
                    kept_sets[name] = press.last_draw.keep
                if rep == 0 and name in ("none", "snapkv", "prob_snapkv"):
                    memory_rows.append(memory_row(model, cache, press, name, ratio, n, full_bytes))
                for variant, source in DECODE_VARIANTS.items():
                    if source == name:
                        keep_for_decode[variant] = (cache, snapshot_bias(model))
                if name == "prob_snapkv_nocorr":
                    # the same padded cache with the bias removed: plain sdpa on exactly the stored size
                    plain = DynamicCache()
                    for layer_idx, layer in enumerate(cache.layers):
                        plain.update(layer.keys.clone(), layer.values.clone(), layer_idx)
                    keep_for_decode["prob_snapkv padded, plain sdpa (timing only)"] = (plain, [None] * len(cache.layers))
                    if "prob_snapkv" in kept_sets:
                        draw_rows[-1]["same_kept_as_corrected"] = bool(torch.equal(kept_sets[name], kept_sets["prob_snapkv"]))
                strip_bias(model)
                del cache, press
                log(f"[speed] n={n} rep={rep} {name}: prefill {watch.wall:.2f}s")
            variants = {v: keep_for_decode[v] for v in DECODE_VARIANTS if v in keep_for_decode}
            results = decode_interleaved(model, variants, n, tokens, warmup_steps)
            for variant, result in results.items():
                decode_rows.append({"n": n, "repeat": rep, "variant": variant, **result})
            del variants, keep_for_decode
            log(f"[speed] n={n} rep={rep}: decode " + ", ".join(f"{v.split(' ')[0]} {r['tok_per_s']:.2f}" for v, r in results.items()))
            if checkpoint is not None:
                checkpoint(frames(), f"n={n}: {rep + 1}/{repeats} rounds")
        for r in memory_ratios:
            if r == ratio:
                continue
            for name in ("snapkv", "prob_snapkv"):
                cache, press, _ = prefill(model, ids, name, r, seed=0)
                memory_rows.append(memory_row(model, cache, press, name, r, n, full_bytes))
                if press is not None and getattr(press, "stats", None):
                    draw_rows.append(
                        {"n": n, "repeat": 0, "press": name, "ratio": r,
                         "realised_ratio": press.stats["realised_ratio"], "padding": press.stats["padding"]}
                    )
                strip_bias(model)
                del cache, press
        log(f"[speed] n={n}: memory done")
        if checkpoint is not None:
            checkpoint(frames(), f"n={n}: done (memory ratios included)")
    return frames()


# --------------------------------------------------------------------------- summary


def summarise(raw: dict, ratio: float) -> dict:
    pre = raw["prefill"].groupby(["press", "n"]).seconds.median().unstack("n")
    pre_cpu = raw["prefill"].groupby(["press", "n"]).cpu_seconds.median().unstack("n")
    dec = raw["decode"].groupby(["variant", "n"]).tok_per_s.median().unstack("n")
    dec_ms = raw["decode"].groupby(["variant", "n"]).median_step_ms.median().unstack("n")
    dec_cpu = raw["decode"].groupby(["variant", "n"]).tok_per_cpu_s.median().unstack("n")
    mem = raw["memory"]
    draws = raw["draws"]
    lengths = sorted(pre.columns)
    checks = []
    for n in lengths:
        value = pre.loc["prob_snapkv", n] / pre.loc["snapkv", n]
        checks.append({"target": "prefill prob_snapkv / snapkv <= 1.10", "n": n, "value": value,
                       "met": bool(value <= TARGETS["prefill"])})
    for n in lengths:
        value = dec.loc["prob_snapkv (corrected)", n] / dec.loc["prob_snapkv_nocorr (same kept set, bias 0)", n]
        checks.append({"target": "decode tok/s corrected / uncorrected (same size) >= 0.95", "n": n, "value": value,
                       "met": bool(value >= TARGETS["decode"])})
    for n in lengths:
        row = mem[(mem.press == "prob_snapkv") & (mem.ratio == ratio) & (mem.n == n)].iloc[0]
        value = row.stored_over_budget
        checks.append({"target": f"stored K+V / ((1-r) full) <= 1.05 at r={ratio}", "n": n, "value": value,
                       "met": bool(value <= TARGETS["stored"])})
    for n in lengths:
        checks.append({"target": "(info, CPU time) prefill prob_snapkv / snapkv", "n": n,
                       "value": pre_cpu.loc["prob_snapkv", n] / pre_cpu.loc["snapkv", n], "met": None})
    for n in lengths:
        checks.append({"target": "(info, CPU time) decode corrected / uncorrected", "n": n,
                       "value": dec_cpu.loc["prob_snapkv (corrected)", n]
                       / dec_cpu.loc["prob_snapkv_nocorr (same kept set, bias 0)", n], "met": None})
    prob = draws[draws.press.str.startswith("prob_")].copy()
    prob["deviation"] = prob.realised_ratio - prob.ratio
    mad = prob.deviation.abs().mean()
    checks.append({"target": "mean |realised - target ratio| <= 1e-3", "n": "all", "value": mad,
                   "met": bool(mad <= TARGETS["ratio"])})
    checks.append({"target": "(info) mean signed realised - target ratio", "n": "all",
                   "value": prob.deviation.mean(), "met": None})
    ratios = {
        "prefill_prob_snapkv_over_snapkv": (pre.loc["prob_snapkv"] / pre.loc["snapkv"]).to_dict(),
        "decode_corrected_over_uncorrected": (
            dec.loc["prob_snapkv (corrected)"] / dec.loc["prob_snapkv_nocorr (same kept set, bias 0)"]
        ).to_dict(),
        "decode_corrected_over_plain_sdpa_same_size": (
            dec.loc["prob_snapkv (corrected)"] / dec.loc["prob_snapkv padded, plain sdpa (timing only)"]
        ).to_dict(),
        "decode_corrected_over_snapkv": (dec.loc["prob_snapkv (corrected)"] / dec.loc["snapkv (kvpress, plain sdpa)"]).to_dict(),
        "stored_over_budget": mem[(mem.press == "prob_snapkv")].set_index(["ratio", "n"]).stored_over_budget.to_dict(),
    }
    return {"prefill_s": pre, "prefill_cpu_s": pre_cpu, "decode_tok_s": dec, "decode_step_ms": dec_ms,
            "decode_tok_cpu_s": dec_cpu,
            "checks": pd.DataFrame(checks), "ratios": ratios, "realised": prob}


def _order(frame: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    return frame.reindex([o for o in order if o in frame.index] + [o for o in frame.index if o not in order])


def markdown(summary: dict, raw: dict, info: dict, args: dict) -> str:
    pre = _order(summary["prefill_s"], PREFILL_PRESSES + ["prob_snapkv_nocorr"])
    pre.columns = [f"n={c}" for c in pre.columns]
    pre.index.name = "press"
    rel = pre.div(pre.loc["snapkv"], axis=1).rename_axis("press (relative to snapkv)")
    cpu = _order(summary["prefill_cpu_s"], PREFILL_PRESSES + ["prob_snapkv_nocorr"])
    cpu.columns = [f"n={c}" for c in cpu.columns]
    cpu = cpu.rename_axis("press (process CPU s)")
    dec = _order(summary["decode_tok_s"], list(DECODE_VARIANTS))
    dec.columns = [f"n={c}" for c in dec.columns]
    dec.index.name = "decode variant (tok/s)"
    ms = _order(summary["decode_step_ms"], list(DECODE_VARIANTS))
    ms.columns = [f"n={c}" for c in ms.columns]
    ms.index.name = "decode variant (median ms / step)"
    mem = raw["memory"].copy()
    mib = 2.0**20
    memtab = pd.DataFrame({
        "press": mem.press, "r": mem.ratio.map(lambda r: f"{r:g}").where(mem.press != "none", "0 (full)"), "n": mem.n.astype(str),
        "full MiB": mem.bytes_full / mib, "kept MiB": mem.bytes_kept / mib, "stored MiB": mem.bytes_stored / mib,
        "bias KiB": mem.bytes_bias / 1024, "stored/((1-r) full)": mem.stored_over_budget,
        "kept/((1-r) full)": mem.kept_over_budget, "padding": mem.padding, "bias/stored": mem.bias_over_stored,
    }).sort_values(["n", "r", "press"]).set_index("press")
    checks = summary["checks"].copy()
    checks["met"] = checks.met.map({True: "MET", False: "MISSED", None: "–"})
    checks = checks.set_index("target")
    lines = [
        "# Speed and memory benchmark\n",
        f"Model: {args['model'] or 'embedded SmolLM2-135M-Instruct'}; compression ratio r = {args['ratio']}; "
        f"lengths {args['lengths']}; medians over {args['repeats']} round-robin repeats; decode: "
        f"{args['decode_steps']} timed steps after {args['warmup_steps']} untimed ones. Rounds completed per length: "
        f"{raw['prefill'].groupby('n').repeat.nunique().to_dict()}.\n",
        "## Machine\n",
        common.machine_markdown(info),
        f"\ntorch threads: {info['torch_threads']} ({'default of torch' if args['threads'] is None else 'set by --threads'}). "
        "Times are wall-clock; the machine may be shared with other jobs (load average above), "
        "so the round-robin order and medians matter more than absolute values. Process CPU time medians are in the JSON.\n",
        "## Design targets\n",
        common.markdown_table(checks[["n", "value", "met"]], float_format="{:.4f}"),
        "\n" + _verdict(summary["checks"]) + "\n",
        "## Prefill (median seconds, eviction included)\n",
        common.markdown_table(pre, float_format="{:.2f}"),
        "\n",
        common.markdown_table(rel, float_format="{:.2f}"),
        "\nProcess CPU time (all threads; less sensitive to other load, but includes OpenMP spin-waiting):\n",
        common.markdown_table(cpu, float_format="{:.2f}"),
        "\n## Decode\n",
        common.markdown_table(dec, float_format="{:.1f}"),
        "\n",
        common.markdown_table(ms, float_format="{:.1f}"),
        "\n",
        common.markdown_table(_order(summary["decode_tok_cpu_s"], list(DECODE_VARIANTS)).rename(
            columns=lambda c: f"n={c}").rename_axis("decode variant (tok per process CPU s)"), float_format="{:.1f}"),
        "\n(c) removes the bias of the same padded cache, so it runs transformers' plain sdpa on exactly the "
        "stored size: the gap between (b) and (c) is the overhead of the corrected code path itself; "
        "the gap between (c) and snapkv is the padding.\n",
        "\n## Memory (keys + values held in the cache)\n",
        common.markdown_table(memtab, float_format="{:.3f}"),
        "\n'kept' counts only the entries that were drawn; 'stored' is the padded cache actually held "
        "(each layer padded to its largest head); bias is the float per stored entry the correction carries. "
        "For snapkv, stored = kept and there is no bias.\n",
    ]
    return "\n".join(lines)


def _verdict(checks: pd.DataFrame) -> str:
    real = checks[checks.met.notna()]
    met = real[real.met.astype(bool)]
    missed = real[~real.met.astype(bool)]
    parts = [f"**{len(met)} of {len(real)} checks met.**"]
    if len(missed):
        parts.append("Missed: " + "; ".join(f"{t} at n={n} ({v:.4f})" for t, n, v in zip(missed.target, missed.n, missed.value)) + ".")
    else:
        parts.append("None missed.")
    return " ".join(parts)


def plot(summary: dict, raw: dict, out: Path) -> list[Path]:
    from matplotlib.figure import Figure

    paths = []
    fig = Figure(figsize=(12, 4))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    pre = summary["prefill_s"]
    for press in pre.index:
        ax1.plot(pre.columns, pre.loc[press], marker="o", label=press)
    ax1.set(xlabel="context length", ylabel="prefill s (median)", title="Prefill", xscale="log", yscale="log")
    ax1.legend(fontsize=7)
    dec = _order(summary["decode_tok_s"], list(DECODE_VARIANTS))
    width = 0.8 / max(1, len(dec.columns))
    x = np.arange(len(dec.index))
    for j, n in enumerate(dec.columns):
        ax2.bar(x + j * width, dec[n], width, label=f"n={n}")
    ax2.set_xticks(x + width * (len(dec.columns) - 1) / 2)
    ax2.set_xticklabels(["corrected", "nocorr", "plain sdpa\n(padded)", "snapkv", "full"], fontsize=7)
    ax2.set(ylabel="tok/s (median)", title="Decode")
    ax2.legend(fontsize=7)
    mem = raw["memory"]
    n_max = mem.n.max()
    sub = mem[(mem.n == n_max) & (mem.press != "none")].sort_values(["ratio", "press"])
    labels = [f"{p}\nr={r}" for p, r in zip(sub.press, sub.ratio)]
    x = np.arange(len(sub))
    full = mem[(mem.n == n_max) & (mem.press == "none")].bytes_stored.iloc[0]
    ax3.bar(x - 0.2, sub.bytes_kept / full, 0.4, label="kept")
    ax3.bar(x + 0.2, sub.bytes_stored / full, 0.4, label="stored (padded)")
    ax3.bar(x + 0.2, sub.bytes_bias / full, 0.4, bottom=sub.bytes_stored / full, label="bias", color="k")
    ax3.set_xticks(x)
    ax3.set_xticklabels(labels, fontsize=6)
    ax3.set(ylabel="fraction of full K+V bytes", title=f"Memory at n={n_max}")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    paths.append(common.save_figure(fig, out / "speed.png"))
    return paths


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="context lengths (default 2048 4096 8192; --quick: 2048 4096)")
    parser.add_argument("--repeats", type=int, default=None, help="round-robin repeats, medians reported (default 3; --quick: 2)")
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio of the timed runs (default 0.5)")
    parser.add_argument("--memory-ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                        help="compression ratios of the memory table (default 0.25 0.5 0.75)")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (default 32)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before timing (default 2)")
    parser.add_argument("--presses", nargs="+", default=PREFILL_PRESSES,
                        help=f"presses whose prefill is timed ('none' = no press); default {' '.join(PREFILL_PRESSES)}")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")


def main(args: argparse.Namespace) -> dict:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lengths = args.lengths or ([2048, 4096] if args.quick else [2048, 4096, 8192])
    repeats = args.repeats or (2 if args.quick else 3)
    presses = list(args.presses)
    for required in ("none", "snapkv", "prob_snapkv"):
        if required not in presses:
            presses.insert(0, required)
    out = Path(args.out) / "speed"
    start = time.time()
    info = common.machine_info()
    model, tokenizer = common.load(args.model)
    settings = {"model": args.model, "ratio": args.ratio, "lengths": lengths, "repeats": repeats,
                "decode_steps": args.decode_steps, "warmup_steps": args.warmup_steps, "threads": args.threads,
                "quick": args.quick, "memory_ratios": args.memory_ratios}

    def checkpoint(raw, progress):
        info["loadavg_end"] = common.loadavg()
        info["elapsed_s"] = time.time() - start
        write_outputs(raw, info, settings, out, f"PARTIAL ({progress}; the run was still going)")
        print(f"[speed] checkpoint written: {progress}", flush=True)

    raw = run(model, tokenizer, lengths, repeats, args.ratio, sorted(set(args.memory_ratios) | {args.ratio}),
              args.decode_steps, args.warmup_steps, presses, checkpoint=checkpoint)
    info["loadavg_end"] = common.loadavg()
    info["elapsed_s"] = time.time() - start
    summary = write_outputs(raw, info, settings, out, "complete")
    print(markdown_table_checks(summary))
    print(f"[speed] wrote {out}/speed.json, speed.md, speed.png in {info['elapsed_s']:.0f} s")
    return summary


def write_outputs(raw: dict, info: dict, settings: dict, out: Path, status: str) -> dict:
    args = argparse.Namespace(**settings)
    summary = summarise(raw, args.ratio)
    common.write_json(out / "speed.json", {
        "status": status, "settings": settings, "machine": info, "targets": TARGETS,
        "checks": summary["checks"], "ratios": summary["ratios"],
        "prefill_median_s": summary["prefill_s"].to_dict(),
        "decode_median_tok_per_cpu_s": summary["decode_tok_cpu_s"].to_dict(), "prefill_median_cpu_s": summary["prefill_cpu_s"].to_dict(),
        "decode_median_tok_s": summary["decode_tok_s"].to_dict(),
        "raw": {k: v for k, v in raw.items()},
    })
    common.write_markdown(out / "speed.md", f"Status: **{status}**\n\n" + markdown(summary, raw, info, settings)
                          + f"\nElapsed: {info['elapsed_s']:.0f} s.\n")
    plot(summary, raw, out)
    return summary


def markdown_table_checks(summary: dict) -> str:
    return common.markdown_table(summary["checks"].set_index("target"), float_format="{:.4f}")
