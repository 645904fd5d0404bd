"""The realised budget of the probabilistic presses: where the kept entries go, how close the realised
compression ratio is to the target, and what padding each layer to its largest head costs.

For every proposal and RULER example one real prefill runs under the press (r = ``ratio``, global
budget, seed = example index): its ``stats`` are recorded, and the per-layer proposals pi are
captured on their way to the eviction (the press's end-of-prefill hook). The draws for the other
ratios, scopes and seeds are then made with the same function the press calls
(the press's ``sampler``) on the captured pi, so the expensive prefill runs once per
(proposal, example); the captured redraw at the press's own settings is checked to give the press's
kept set exactly (``redraw_matches_press`` in the JSON). Proposals do not depend on the ratio
(the scorer's compression_ratio is not used by its score).

Figures (per draw): kept fraction per layer and KV head = kept / n; realised ratio
1 - sum kept / (L H n); the stored (padded) length of a layer = its largest head's kept count;
padding factor of a layer = H * stored / sum_h kept (1 = no padding); overall padding = stored
entries / kept entries over the model (the press's ``stats['padding']``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers import DynamicCache

from evaluation.bench import common

PROPOSALS = ["prob_snapkv", "prob_min", "prob_min_h", "prob_knorm"]
SCOPES = ("global", "layer", "head")


@torch.no_grad()
def capture_prefill(model, ids: torch.Tensor, name: str, ratio: float, seed: int):
    """One prefill and the press's compression through the engine; returns (press, pi (L, b, H, n)
    float64: the proposals the press drew from)."""
    from evaluation.engine import Prefill
    from kvpress_prob import get_press

    press = get_press(name, ratio, seed=seed)
    prefill = Prefill(model, ids)
    proposals = prefill.proposals_of(press)
    prefill.compress(press)
    pi = torch.stack([proposals[module] for module in sorted(proposals, key=lambda m: m.layer_idx)]).double()
    return press, pi


def draw_figures(pi: torch.Tensor, ratio: float, scope: str, seed: int, press) -> dict:
    """One draw with the press's sampler; kept counts, stored lengths, realised ratio, padding."""
    generator = torch.Generator(device=pi.device).manual_seed(seed)
    result = press.sampler(pi, ratio, scope, generator)
    kept = result.keep[:, 0].sum(-1).double()  # (L, H)
    return figures_from_kept(kept, pi.shape[-1]) | {"keep": result.keep}


def figures_from_kept(kept: torch.Tensor, n: int) -> dict:
    """kept (L, H) counts of one draw -> the budget figures."""
    kept = torch.as_tensor(kept, dtype=torch.float64)
    L, H = kept.shape
    stored = kept.max(dim=1).values.clamp_min(1)  # (L,) padded length per layer
    padding_layer = H * stored / kept.sum(dim=1).clamp_min(1)
    return {
        "kept_fraction": (kept / n).numpy(),  # (L, H)
        "realised_ratio": float(1 - kept.sum() / (L * H * n)),
        "stored_fraction": float(H * stored.sum() / (L * H * n)),
        "kept_total_fraction": float(kept.sum() / (L * H * n)),
        "padding_layer": padding_layer.numpy(),  # (L,)
        "padding_mean_layer": float(padding_layer.mean()),
        "padding_overall": float(H * stored.sum() / kept.sum().clamp_min(1)),
    }


def run(model, tokenizer, proposals, ratios, n_examples, length, seeds, scope_press, ratio, dataset_seed, log=print):
    from evaluation.datasets.ruler import generate_ruler

    df = generate_ruler(tokenizer, length, n_examples, dataset_seed)
    rows, heat, press_rows = [], {}, []
    for ex, context in enumerate(df.context):
        ids = tokenizer(context, add_special_tokens=False, return_tensors="pt").input_ids
        n = ids.shape[1]
        for name in proposals:
            t0 = time.time()
            press, pi = capture_prefill(model, ids, name, ratio, seed=ex)
            stats = press.stats
            own = draw_figures(pi, ratio, press.budget, ex, press)
            matches = bool(torch.equal(own["keep"], press.last_draw.keep))
            press_rows.append({
                "proposal": name, "example": ex, "task": df.task.iloc[ex], "n": n,
                "realised_ratio": stats["realised_ratio"], "padding": stats["padding"],
                "m": stats["m"], "redraw_matches_press": matches,
                "stats_stored_fraction": sum(stats["stored"]) * len(stats["kept"][0]) / (len(stats["kept"]) * len(stats["kept"][0]) * n),
            })
            scopes = SCOPES if name == scope_press else ("global",)
            for r in ratios:
                for scope in scopes:
                    for s in range(seeds):
                        fig = draw_figures(pi, r, scope, 1000 * ex + s, press)
                        rows.append({
                            "proposal": name, "example": ex, "n": n, "target": r, "scope": scope, "seed": s,
                            "realised_ratio": fig["realised_ratio"], "deviation": fig["realised_ratio"] - r,
                            "kept_total_fraction": fig["kept_total_fraction"], "stored_fraction": fig["stored_fraction"],
                            "padding_mean_layer": fig["padding_mean_layer"], "padding_overall": fig["padding_overall"],
                            "padding_layer": fig["padding_layer"].tolist(),
                        })
                        heat.setdefault((name, scope, r), []).append(fig["kept_fraction"])
            log(f"[budget] example {ex} ({df.task.iloc[ex]}, n={n}) {name}: {time.time() - t0:.1f}s, "
                f"realised {stats['realised_ratio']:.4f}, padding {stats['padding']:.3f}, redraw matches: {matches}")
    heat = {k: np.mean(v, axis=0) for k, v in heat.items()}  # (L, H) mean over examples and seeds
    return pd.DataFrame(rows), heat, pd.DataFrame(press_rows)


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    g = rows.groupby(["proposal", "scope", "target"])
    table = pd.DataFrame({
        "draws": g.size(),
        "mean realised": g.realised_ratio.mean(),
        "mean signed dev": g.deviation.mean(),
        "mean abs dev": g.deviation.apply(lambda d: d.abs().mean()),
        "max abs dev": g.deviation.apply(lambda d: d.abs().max()),
        "kept frac": g.kept_total_fraction.mean(),
        "stored frac": g.stored_fraction.mean(),
        "padding (mean over layers)": g.padding_mean_layer.mean(),
        "padding (overall)": g.padding_overall.mean(),
    })
    table["draws"] = table["draws"].astype(str)  # keeps the markdown cell an integer
    return table


def per_layer(rows: pd.DataFrame, heat: dict, ratio: float) -> pd.DataFrame:
    """Kept fraction (mean over heads) and padding factor per layer at ``ratio``, global scope."""
    cols = {}
    for (name, scope, r), h in heat.items():
        if scope == "global" and r == ratio:
            cols[f"{name} kept"] = h.mean(axis=1)
    sub = rows[(rows.scope == "global") & (rows.target == ratio)]
    for name, grp in sub.groupby("proposal"):
        cols[f"{name} padding"] = np.mean(np.stack(grp.padding_layer.map(np.asarray).tolist()), axis=0)
    frame = pd.DataFrame(cols)
    frame.index.name = "layer"
    return frame


def plot(heat: dict, proposals, ratio: float, scope_press: str, out: Path, layers: pd.DataFrame) -> list[Path]:
    from matplotlib.figure import Figure

    paths = []
    panels = [(p, "global") for p in proposals] + [(scope_press, s) for s in SCOPES if s != "global"]
    panels = [p for p in panels if (p[0], p[1], ratio) in heat]
    vmax = max(float(heat[(p, s, ratio)].max()) for p, s in panels)
    fig = Figure(figsize=(2.4 * len(panels) + 1, 6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for i, (ax, (p, s)) in enumerate(zip(axes, panels)):
        h = heat[(p, s, ratio)]
        im = ax.imshow(h, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, origin="lower")
        ax.set(title=f"{p}\n{s} (mean {h.mean():.3f})", xlabel="KV head", ylabel="layer" if i == 0 else None)
        ax.title.set_fontsize(8)
        ax.set_xticks(range(h.shape[1]))
    fig.colorbar(im, ax=list(axes), label=f"kept fraction at r={ratio}")
    paths.append(common.save_figure(fig, out / "kept_heatmap.png"))

    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    names = list(dict.fromkeys(col.rsplit(" ", 1)[0] for col in layers.columns))
    colour = {name: f"C{i}" for i, name in enumerate(names)}  # one colour per proposal in both panels
    for col in layers.columns:
        ax = ax1 if col.endswith("kept") else ax2
        name = col.rsplit(" ", 1)[0]
        ax.plot(layers.index, layers[col], marker=".", label=name, color=colour[name])
    ax1.axhline(1 - ratio, color="k", lw=0.8, ls="--")
    ax1.set(xlabel="layer", ylabel="kept fraction (mean over heads)", title=f"Kept per layer, r={ratio}, global")
    ax2.set(xlabel="layer", ylabel="H * stored / kept", title="Padding factor per layer")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    paths.append(common.save_figure(fig, out / "per_layer.png"))
    return paths


def replot(out: Path) -> list[Path]:
    """Redraw the figures from ``<out>/budget.json`` (no model run)."""
    import json

    data = json.loads((out / "budget.json").read_text())
    settings = data["settings"]
    heat = {}
    for key, h in data["heatmaps"].items():
        p, s, r = key.split("|")
        heat[(p, s, float(r))] = np.asarray(h)
    layers = pd.DataFrame(data["per_layer"]).drop(columns="index", errors="ignore").set_index("layer")
    return plot(heat, settings["proposals"], settings["ratio"], settings["scope_press"], out, layers)


def markdown(table, layers, press_rows, info, settings) -> str:
    t = table.reset_index()
    glob = t[t.scope == "global"].drop(columns="scope").set_index("proposal")
    scopes = t[t.proposal == settings["scope_press"]].drop(columns="proposal").set_index("scope")
    lay = layers.copy()
    lay_summary = pd.DataFrame({
        "kept: min layer": lay[[c for c in lay if c.endswith("kept")]].min(),
        "kept: max layer": lay[[c for c in lay if c.endswith("kept")]].max(),
        "layer 0 kept": lay[[c for c in lay if c.endswith("kept")]].iloc[0],
        "last layer kept": lay[[c for c in lay if c.endswith("kept")]].iloc[-1],
    })
    lay_summary.index = [i.removesuffix(" kept") for i in lay_summary.index]
    lay_summary.index.name = "proposal"
    pr = press_rows.groupby("proposal").agg(
        examples=("example", "size"), realised=("realised_ratio", "mean"), padding=("padding", "mean"),
        redraw_matches=("redraw_matches_press", "all"))
    return "\n".join([
        "# Budget benchmark\n",
        f"Model: {settings['model'] or 'embedded SmolLM2-135M-Instruct'}; {settings['examples']} RULER examples at "
        f"{settings['length']} tokens; targets r in {settings['ratios']}; {settings['seeds']} draws per example "
        f"and setting (one real prefill per proposal and example; draws redone on the captured proposals with "
        f"`kvpress_prob.sampling.draw`, see the module docstring).\n",
        common.machine_markdown(info),
        "## Realised vs target ratio, padding (global budget)\n",
        common.markdown_table(glob, float_format="{:.4f}"),
        "\n'dev' = realised - target compression ratio per draw; 'kept frac' and 'stored frac' are fractions of "
        "the full cache (L * H * n entries); padding = stored / kept.\n",
        f"## Scopes of {settings['scope_press']}\n",
        common.markdown_table(scopes, float_format="{:.4f}"),
        f"\n## Where the budget goes (r = {settings['ratio']}, global)\n",
        common.markdown_table(lay_summary, float_format="{:.3f}"),
        "\nPer layer (kept fraction averaged over heads, examples and draws; padding factor H*stored/kept):\n",
        common.markdown_table(lay, float_format="{:.3f}"),
        "\n## The real prefills (press.stats)\n",
        common.markdown_table(pr, float_format="{:.4f}"),
        "\nPlots: `kept_heatmap.png` (layer x KV head kept fraction per proposal, and the layer/head scopes of "
        f"{settings['scope_press']}), `per_layer.png`.\n",
    ])


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
