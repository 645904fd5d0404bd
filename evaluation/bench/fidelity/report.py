"""The fidelity report: ``report.md`` and ``summary.json`` (with the plots) rebuilt from the records."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.bench.fidelity import DEFAULT_PRESSES
from evaluation.bench.fidelity.plots import plot_bias_variance, plot_kl_bars, plot_layer_error
from evaluation.bench.fidelity.tables import kl_summary, layer_table, load_records, order, paired_table, scope_table
from evaluation.report.tables import markdown_table
from evaluation.store.results import write_atomic

logger = logging.getLogger("evaluation.bench.fidelity")


def ci_cell(mean: float, lo: float, hi: float, fmt: str = "{:.4f}") -> str:
    if not np.isfinite(mean):
        return "–"
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return fmt.format(mean)
    return f"{fmt.format(mean)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def p_cell(p: float) -> str:
    return "–" if not np.isfinite(p) else f"{p:.3f}"


def header(df: pd.DataFrame) -> list[str]:
    return ["# Fidelity benchmark: KL to the full cache\n",
          f"{df['example_id'].nunique()} examples ({', '.join(sorted(df['task'].unique()))}), "
          f"context {int(df['n_context'].min())}–{int(df['n_context'].max())} tokens, "
          f"continuation = question + gold answer ({df['n_question'].iloc[0]}–{df['n_question'].max()} + "
          f"{df['n_answer'].min()}–{df['n_answer'].max()} tokens), model {df['model'].iloc[0]}. "
          "KL(full || compressed) in nats per continuation token; the mean over seeds within an example, then "
          "over examples; [lo, hi] is the 95% Student-t interval over examples (bootstrap interval in "
          "summary.json). `answer KL` averages only the positions predicting the answer tokens; "
          "`top-1` is the share of positions where the argmax matches the full cache; `ΔNLL` is the change of "
          "the gold answer's negative log-likelihood (nats, summed over its tokens).\n"]


def kl_section(main: pd.DataFrame) -> list[str]:
    """One KL table per ratio (temperature 1, main grid)."""
    md = []
    for ratio in sorted(main["ratio"].unique()):
        part = main[main["ratio"] == ratio]
        table = pd.DataFrame({
            "KL [95% CI]": [ci_cell(m, lo, hi) for m, lo, hi in zip(part["kl"], part["kl_lo"], part["kl_hi"])],
            "answer KL [95% CI]": [ci_cell(m, lo, hi) for m, lo, hi in
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
    return md


def paired_section(paired: pd.DataFrame) -> list[str]:
    md = ["## Paired comparisons per scorer family\n"]
    md.append("KL(A) − KL(B) on the same examples (seed means); negative: A is closer to the full cache. "
              "[lo, hi]: 95% t-interval over examples; `p`: two-sided paired t-test; `A better`: examples where KL(A) < KL(B).\n")
    table = pd.DataFrame({
        "family": paired["family"], "ratio": paired["ratio"].map(lambda v: f"{v:g}"),
        "A − B": [f"{a} − {b}" for a, b in zip(paired["A"], paired["B"])],
        "KL A": paired["kl_A"].map(lambda v: f"{v:.4f}"), "KL B": paired["kl_B"].map(lambda v: f"{v:.4f}"),
        "difference [95% CI]": [ci_cell(m, lo, hi, "{:+.4f}") for m, lo, hi in
                                zip(paired["diff"], paired["lo"], paired["hi"])],
        "p (paired t)": paired["p_value"].map(p_cell),
        "A better": [f"{w}/{n}" for w, n in zip(paired["A_better"], paired["n"])],
    })
    md.append(markdown_table(table, index=False))
    return md


def scope_section(scopes: pd.DataFrame) -> list[str]:
    md = ["## Budget scope: global, per layer, per head\n"]
    md.append("The same proposal and m rule with the budget solved over all layers (global, the default), per "
              "layer, or per KV head; kvpress top-k keeps the same ratio in every layer and head. KL with 95% "
              "t-CI; `vs global` / `vs top-k`: paired KL difference on the same examples (negative: this scope is "
              "closer to the full cache), with the count of examples where it is better.\n")

    def cell(row, name):
        if not np.isfinite(row.get(f"vs_{name}", np.nan)):
            return "–"
        return f"{ci_cell(row[f'vs_{name}'], row[f'vs_{name}_lo'], row[f'vs_{name}_hi'], '{:+.4f}')} " \
               f"({row[f'vs_{name}_better']})"

    table = pd.DataFrame({
        "method": scopes["method"], "ratio": scopes["ratio"].map(lambda v: f"{v:g}"), "scope": scopes["scope"],
        "KL [95% CI]": [ci_cell(m, lo, hi) for m, lo, hi in zip(scopes["kl_mean"], scopes["kl_lo"], scopes["kl_hi"])],
        "vs global": [cell(r, "global") for r in scopes.to_dict(orient="records")],
        "top-k press": scopes["top_k_press"].fillna("–"),
        "vs top-k": [cell(r, "top-k") for r in scopes.to_dict(orient="records")],
        "realised ratio": scopes["realised_ratio"].map(lambda v: f"{v:.4f}"),
    })
    md.append(markdown_table(table, index=False))
    return md


def layer_section(layers: pd.DataFrame, order_: list) -> list[str]:
    md = ["## Layer-wise attention error\n"]
    md.append("Relative L2 error ||o − o_full|| / ||o_full|| of each layer's attention output over the "
              "continuation positions (end to end: it includes the error passed on by earlier layers), mean "
              "over seeds and examples. bias² and variance (relative squared error, split over the seeds, "
              "mean over layers) are 0 / – for deterministic methods (one seed: all error is bias). The plug-in bias² "
              "‖mean_s o_s − o‖² also contains Var/S of the seed mean; `bias² debiased` = bias² − variance/(S−1) "
              "removes it in expectation.\n")
    lt = layers[layers["main"]]
    lt = lt.assign(_o=lt["press"].map({p: i for i, p in enumerate(order_)})).sort_values(["ratio", "_o"])
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
    return md


def sweep_section(summary: pd.DataFrame, layers: pd.DataFrame) -> list[str]:
    """The temperature sweep: every configuration of a method run at some temperature T != 1."""
    sweep = summary[summary["press"].isin(
        summary.loc[summary["temperature"] != 1.0, "method"].unique().tolist()) | (summary["temperature"] != 1.0)]
    md = ["## Temperature T of the correction\n"]
    md.append("T = 1: full correction; T = inf: plain renormalisation over the kept entries (no correction). "
              "KL with 95% t-CI; bias² / variance of the attention output (mean over layers).\n")
    sw = sweep.merge(layers[["press", "ratio", "bias2_mean", "bias2_debiased", "var_mean"]], on=["press", "ratio"],
                     how="left") if not layers.empty else sweep.assign(bias2_mean=np.nan, bias2_debiased=np.nan,
                                                                      var_mean=np.nan)
    sw = sw.sort_values(["method", "ratio", "temperature"])
    table = pd.DataFrame({
        "method": sw["method"], "ratio": sw["ratio"].map(lambda v: f"{v:g}"),
        "T": sw["temperature"].map(lambda v: "inf" if math.isinf(v) else f"{v:g}"),
        "KL [95% CI]": [ci_cell(m, lo, hi) for m, lo, hi in zip(sw["kl"], sw["kl_lo"], sw["kl_hi"])],
        "bias²": sw["bias2_mean"].map(lambda v: f"{v:.5f}" if np.isfinite(v) else "–"),
        "bias² debiased": sw["bias2_debiased"].map(lambda v: f"{v:.5f}" if np.isfinite(v) else "–"),
        "variance": sw["var_mean"].map(lambda v: f"{v:.5f}" if np.isfinite(v) else "–"),
        "realised ratio": sw["realised_ratio"].map(lambda v: f"{v:.4f}"),
        "n": sw["n_examples"],
    })
    md.append(markdown_table(table, index=False))
    return md


def write_report(out_dir: Path) -> dict:
    """Rebuild report.md, summary.json and the plots from records.jsonl; returns the paths."""
    out_dir = Path(out_dir)
    df = load_records(out_dir)
    if df.empty:
        logger.warning("no records in %s", out_dir)
        return {}
    summary = kl_summary(df)
    labels = order(summary["press"], list(DEFAULT_PRESSES))
    summary = summary.assign(_o=summary["press"].map({p: i for i, p in enumerate(labels)}))
    summary = summary.sort_values(["ratio", "_o"]).drop(columns="_o").reset_index(drop=True)
    main = summary[(summary["temperature"] == 1.0) & summary["main"]]
    paired, scopes, layers = paired_table(df), scope_table(df), layer_table(df)
    paths, md = {}, header(df) + kl_section(main)
    if not main.empty:
        paths["kl_bars"] = plot_kl_bars(main, out_dir / "kl_bars.png", labels)
        md.append("![KL bars](kl_bars.png)\n")
    if not paired.empty:
        md += paired_section(paired)
    if not scopes.empty:
        md += scope_section(scopes)
    if not layers.empty:
        md += layer_section(layers, labels)
        if p := plot_layer_error(layers, out_dir / "layer_error.png", labels):
            paths["layer_error"] = p
            md.append("![layer error](layer_error.png)\n")
    if (summary["temperature"] != 1.0).any():
        md += sweep_section(summary, layers)
    if not layers.empty and (p := plot_bias_variance(layers, out_dir / "bias_variance.png")):
        paths["bias_variance"] = p
        md.append("![bias and variance](bias_variance.png)\n")
    paths["report_md"] = write_atomic(out_dir / "report.md", "\n".join(md))
    payload = {name: frame.to_dict(orient="records") for name, frame in
               (("kl", summary), ("paired", paired), ("scopes", scopes), ("layers", layers))}
    payload["n_records"] = len(df)
    paths["summary_json"] = write_atomic(out_dir / "summary.json",
                                         json.dumps(payload, indent=1, default=_json_safe, allow_nan=True))
    return paths


def _json_safe(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(type(obj).__name__)
