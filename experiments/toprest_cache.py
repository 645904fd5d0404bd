"""What the two-top-sets press (``cross_kvzip_block1_a<pct>_toprest_widest``) keeps beside KVzip's own top, per layer.

For the first development prose windows and each ratio, the kept mask of every layer and head is read from
``SamplingPress.evict`` (``experiments.round2_cache.kept_masks``) with the proposal pair the press saw (row 0
KVzip's pi, row 1 pi_min-h). Per layer, over heads and windows:
- ``width``: the entries each head keeps (widest's width);
- ``shared``: the share of them that KVzip's own top ``width`` (``topk_kvzip_widest``'s set) also keeps;
- ``recent``: among pi_min-h's fill (kept, outside KVzip's top), the share in the last 10 % of the context,
  and ``recent_kvzip`` the same share among the entries of KVzip's top that the fill displaced;
- ``fill_mass``: pi_min-h's mass on the fill, against ``displaced_mass``, its mass on the displaced entries.

    PYTHONPATH=$PWD python -m experiments.toprest_cache --windows 3 --ratios 0.75 0.9 --out results/archive/dev/toprest-cache
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from evaluation.tasks.prose.essays import windows
from experiments.round2_cache import kept_masks
from kvpress_prob import get_press, load_model


def layer_stats(masks) -> list[dict]:
    """Per layer: width, shared, recent, recent_kvzip, fill_mass, displaced_mass (means over heads)."""
    out = []
    for layer in sorted(masks):
        keep, pi = masks[layer]  # (H, n), (H, 2, n)
        H, n = keep.shape
        width = int(keep[0].sum())
        kvzip_top = torch.zeros_like(keep).scatter_(-1, pi[:, 0].topk(width, dim=-1).indices, True)
        fill, displaced = keep & ~kvzip_top, kvzip_top & ~keep
        late = torch.arange(n) >= int(0.9 * n)

        def share(mask, where):
            counts = mask.sum(-1).clamp(min=1)
            return float(((mask & where).sum(-1) / counts).mean())

        out.append({"layer": layer, "width": width, "shared": float((keep & kvzip_top).sum(-1).float().mean() / width),
                    "recent": share(fill, late), "recent_kvzip": share(displaced, late),
                    "fill_mass": float((pi[:, 1] * fill).sum(-1).mean()),
                    "displaced_mass": float((pi[:, 1] * displaced).sum(-1).mean())})
    return out


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--press", default="cross_kvzip_block1_a75_toprest_widest")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--ratios", nargs="+", type=float, default=[0.75, 0.9])
    p.add_argument("--out", default="results/archive/dev/toprest-cache")
    args = p.parse_args(argv)
    model, tokenizer = load_model()
    found = windows(tokenizer, 1024, 256, "dev", max_per_essay=1)[: args.windows]
    rows = []
    for window in found:
        ids = window.ids[:, :1024]
        for ratio in args.ratios:
            for stats in layer_stats(kept_masks(model, ids, get_press(args.press, ratio))):
                rows.append({"window": window.window_id, "ratio": ratio, **stats})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [f"# What `{args.press}` keeps beside KVzip's own top (dev prose, {len(found)} windows)", "",
             f"Command: `python -m experiments.toprest_cache --press {args.press} --windows {args.windows} --ratios "
             f"{' '.join(map(str, args.ratios))} --out {args.out}`", "",
             "| ratio | layers | mean width | shared with KVzip's top | fill in last 10 % | displaced in last 10 % "
             "| pi_min-h mass: fill / displaced |", "|---|---|---|---|---|---|---|"]
    for ratio in args.ratios:
        r = [x for x in rows if x["ratio"] == ratio]
        m = {k: np.mean([x[k] for x in r]) for k in ("width", "shared", "recent", "recent_kvzip", "fill_mass",
                                                      "displaced_mass")}
        lines.append(f"| {ratio:g} | {len({x['layer'] for x in r})} | {m['width']:.1f} | {m['shared']:.3f} | "
                     f"{m['recent']:.3f} | {m['recent_kvzip']:.3f} | {m['fill_mass']:.3f} / {m['displaced_mass']:.3f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main()
