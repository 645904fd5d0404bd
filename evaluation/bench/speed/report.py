"""The speed bench's summary and outputs: ``speed.md``, ``speed.json``, ``speed.png``."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.bench import common
from evaluation.bench.speed.measure import DECODE_VARIANTS, PREFILL_PRESSES
from evaluation.engine.runner import REFERENCE

TARGETS = {
    "prefill": 1.10,  # prob_snapkv prefill / snapkv prefill <=
    "decode": 0.95,  # corrected tok/s / uncorrected tok/s >=
    "stored": 1.05,  # stored K+V / ((1 - r) full) <= at r = 0.5
    "ratio": 1e-3,  # mean |realised - target| <=
}


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
        "press": mem.press, "r": mem.ratio.map(lambda r: f"{r:g}").where(mem.press != REFERENCE, "0 (full)"), "n": mem.n.astype(str),
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
        *peak_markdown(raw.get("peak", pd.DataFrame())),
        *cuda_markdown(raw),
    ]
    return "\n".join(lines)


def peak_markdown(peak: pd.DataFrame) -> list[str]:
    """The prefill's peak memory above what the process held before it, per press, path and length."""
    if peak.empty:
        return []
    table = peak.assign(MiB=peak.extra_bytes / 2**20, **{"/ full K+V": peak.extra_over_full_kv}).pivot_table(
        index=["press", "path"], columns="n", values=["MiB", "/ full K+V"], sort=False)
    table.columns = [f"{what} n={n}" for what, n in table.columns]
    table.index = [f"{press} ({path})" for press, path in table.index]
    table.index.name = "press (path)"
    return [
        "\n## Peak memory of the prefill\n",
        f"Peak above the memory held before the prefill ({peak.method.iloc[0]}), in MiB and as a multiple of the "
        "full cache's K+V bytes. `press`: the kvpress pipeline's prefill under the press (kvpress presses compress "
        "each layer after its attention; a SamplingPress defers eviction to the last layer, so the whole full cache "
        "is held until then); `engine`: the runner's path, `engine.Prefill` (the full prefill, the press's proposal "
        "or scores computed in its hooks) then `compress`.\n",
        common.markdown_table(table, float_format="{:.2f}"),
    ]


def cuda_prefill_peaks(raw: dict) -> pd.DataFrame | None:
    """``torch.cuda.max_memory_allocated`` of each timed prefill (max over rounds, bytes), None on a CPU."""
    pre = raw["prefill"]
    if "cuda_peak_bytes" not in pre or pre.cuda_peak_bytes.isna().all():
        return None
    return pre.groupby(["press", "n"]).cuda_peak_bytes.max().unstack("n")


def cuda_markdown(raw: dict) -> list[str]:
    peaks = cuda_prefill_peaks(raw)
    if peaks is None:
        return []
    peaks = (peaks / 2**20).rename(columns=lambda c: f"n={c}").rename_axis("press (MiB)")
    return ["\n## CUDA max_memory_allocated of the timed prefills\n", common.markdown_table(peaks, float_format="{:.1f}")]


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
    short = dict(zip(DECODE_VARIANTS, ["corrected", "nocorr", "plain sdpa\n(padded)", "snapkv", "full"]))
    ax2.set_xticklabels([short.get(v, v.replace("_", "_\n", 1)) for v in dec.index], fontsize=7)
    ax2.set(ylabel="tok/s (median)", title="Decode")
    ax2.legend(fontsize=7)
    mem = raw["memory"]
    n_max = mem.n.max()
    sub = mem[(mem.n == n_max) & (mem.press != REFERENCE)].sort_values(["ratio", "press"])
    labels = [f"{p}\nr={r}" for p, r in zip(sub.press, sub.ratio)]
    x = np.arange(len(sub))
    full = mem[(mem.n == n_max) & (mem.press == REFERENCE)].bytes_stored.iloc[0]
    ax3.bar(x - 0.2, sub.bytes_kept / full, 0.4, label="kept")
    ax3.bar(x + 0.2, sub.bytes_stored / full, 0.4, label="stored (padded)")
    ax3.bar(x + 0.2, sub.bytes_bias / full, 0.4, bottom=sub.bytes_stored / full, label="bias", color="k")
    ax3.set_xticks(x)
    ax3.set_xticklabels(labels, fontsize=6)
    ax3.set(ylabel="fraction of full K+V bytes", title=f"Memory at n={n_max}")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    paths.append(common.save_png(fig, out / "speed.png"))
    return paths


def write_outputs(raw: dict, info: dict, settings: dict, out: Path, status: str) -> dict:
    args = argparse.Namespace(**settings)
    summary = summarise(raw, args.ratio)
    common.write_json(out / "speed.json", {
        "status": status, "settings": settings, "machine": info, "targets": TARGETS,
        "checks": summary["checks"], "ratios": summary["ratios"],
        "prefill_median_s": summary["prefill_s"].to_dict(),
        "decode_median_tok_per_cpu_s": summary["decode_tok_cpu_s"].to_dict(), "prefill_median_cpu_s": summary["prefill_cpu_s"].to_dict(),
        "decode_median_tok_s": summary["decode_tok_s"].to_dict(),
        "prefill_cuda_peak_bytes": None if (c := cuda_prefill_peaks(raw)) is None else c.to_dict(),
        "peak": raw.get("peak"), "raw": {k: v for k, v in raw.items() if k != "peak"},
    })
    common.write_markdown(out / "speed.md", f"Status: **{status}**\n\n" + markdown(summary, raw, info, settings)
                          + f"\nElapsed: {info['elapsed_s']:.0f} s.\n")
    plot(summary, raw, out)
    return summary


def markdown_table_checks(summary: dict) -> str:
    return common.markdown_table(summary["checks"].set_index("target"), float_format="{:.4f}")
