"""The allocation bench's options and entry point (``python -m evaluation.bench budget``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

PROPOSALS = ["prob_snapkv", "prob_min", "prob_min_h", "prob_knorm"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proposals", nargs="+", default=PROPOSALS, help=f"probabilistic presses to compare (default {' '.join(PROPOSALS)})")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75], help="target compression ratios (default 0.25 0.5 0.75)")
    parser.add_argument("--ratio", type=float, default=0.5,
                        help="ratio of the real prefill, the heatmaps and the per-layer table (default 0.5)")
    parser.add_argument("--examples", type=int, default=None, help="RULER examples (default 12; --quick: 4)")
    parser.add_argument("--length", type=int, default=None, help="context tokens (default 2048; --quick: 1024)")
    parser.add_argument("--seeds", type=int, default=5, help="draws per example and setting (default 5)")
    parser.add_argument("--scope-press", default="prob_min_h", help="press whose global/layer/head scopes are compared (default prob_min_h)")
    parser.add_argument("--dataset-seed", type=int, default=0, help="seed of the RULER examples (default 0)")


def main(args: argparse.Namespace) -> dict:
    from evaluation.bench import common
    from evaluation.bench.allocation.measure import run
    from evaluation.bench.allocation.report import markdown, per_layer, plot, summarise

    start = time.time()
    examples = args.examples or (4 if args.quick else 12)
    length = args.length or (1024 if args.quick else 2048)
    ratios = sorted(set(args.ratios) | {args.ratio})
    proposals = list(args.proposals) + ([args.scope_press] if args.scope_press not in args.proposals else [])
    out = Path(args.out) / "budget"
    info = common.machine_info()
    model, tokenizer = common.load(args.model)
    rows, heat, press_rows = run(model, tokenizer, proposals, ratios, examples, length, args.seeds,
                                 args.scope_press, args.ratio, args.dataset_seed)
    info["loadavg_end"] = common.loadavg()
    info["elapsed_s"] = time.time() - start
    table = summarise(rows)
    layers = per_layer(rows, heat, args.ratio)
    settings = {"model": args.model, "examples": examples, "length": length, "ratios": ratios, "ratio": args.ratio,
                "seeds": args.seeds, "scope_press": args.scope_press, "proposals": proposals, "quick": args.quick,
                "dataset_seed": args.dataset_seed}
    common.write_json(out / "budget.json", {
        "settings": settings, "machine": info,
        "summary": table.reset_index(), "per_layer": layers.reset_index(),
        "heatmaps": {f"{p}|{s}|{r}": h for (p, s, r), h in heat.items()},
        "press_stats": press_rows, "draws": rows.drop(columns="padding_layer"),
    })
    common.write_markdown(out / "budget.md", markdown(table, layers, press_rows, info, settings)
                          + f"\nElapsed: {info['elapsed_s']:.0f} s.\n")
    plot(heat, proposals, args.ratio, args.scope_press, out, layers)
    print(common.markdown_table(table, float_format="{:.4f}"))
    print(f"[budget] wrote {out}/budget.json, budget.md, kept_heatmap.png, per_layer.png in {info['elapsed_s']:.0f} s")
    return {"summary": table, "per_layer": layers}
