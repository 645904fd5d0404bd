"""The allocation bench's runs: one engine prefill per (proposal, example), redraws by the press's sampler."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch


SCOPES = ("global", "layer", "head")


@torch.no_grad()
def capture_prefill(model, ids: torch.Tensor, name: str, ratio: float, seed: int):
    """One prefill and the press's compression through the engine; returns (press, pi (L, b, H, n)
    float64: the proposals the press drew from)."""
    from evaluation.engine import Prefill
    from kvpress_prob import get_press

    press = get_press(name, ratio, seed=seed)
    prefill = Prefill(model, ids, [press])
    proposals = prefill.proposals_of(press)
    prefill.compress(press)
    pi = torch.stack([proposals[module] for module in sorted(proposals, key=lambda m: m.layer_idx)]).double()
    return press, pi


def draw_figures(pi: torch.Tensor, ratio: float, scope: str, seed: int, press) -> dict:
    """One draw with the press's sampler; kept counts, stored lengths, realised ratio, padding."""
    generator = torch.Generator(device=pi.device).manual_seed(seed)  # as SamplingPress.evict seeds it
    result = press.sampler(pi, ratio, scope, generator)
    kept = result.keep[:, 0].sum(-1).double().cpu()  # (L, H)
    return figures_from_kept(kept, pi.shape[-1]) | {"keep": result.keep}


def figures_from_kept(kept: torch.Tensor, n: int) -> dict:
    """kept (L, H) counts of one draw -> the budget figures."""
    kept = torch.as_tensor(kept, dtype=torch.float64).cpu()
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
    from evaluation.tasks.ruler.offline import generate_ruler

    df = generate_ruler(tokenizer, length, n_examples, dataset_seed)
    rows, heat, press_rows = [], {}, []
    for ex, context in enumerate(df.context):
        ids = tokenizer(context, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
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
