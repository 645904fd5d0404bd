"""One plot: each design's RULER score against its prose KL over the regime's best press (and recall as the
marker's colour), from a maximin table (results/rule/<split>-maximin.csv) and the RULER / prose means.

    python results/rule/plot_frontier.py test   # writes results/rule/test-frontier.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

split = sys.argv[1] if len(sys.argv) > 1 else "dev"
here = Path(__file__).parent
table = pd.read_csv(here / f"{split}-maximin.csv", index_col="press")
fig, ax = plt.subplots(figsize=(8, 6))
points = ax.scatter(1 / table["q_prose"], 100 * table["q_ruler"], c=table["q_recall"], cmap="viridis", s=40,
                    edgecolors=["black" if c else "none" for c in table["candidate"]])
for press, row in table.iterrows():
    ax.annotate(press, (1 / row["q_prose"], 100 * row["q_ruler"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
ax.set_xscale("log")
ax.set_xlabel("prose: KL / the best press's KL (mean over ratios of its inverse q; lower is better)")
ax.set_ylabel("RULER: score as % of the best press's (higher is better)")
fig.colorbar(points, label="recall q: best KL / KL on the cued sentences")
ax.set_title(f"Three regimes, {split} split (black edge: equal-memory candidate)")
fig.tight_layout()
fig.savefig(here / f"{split}-frontier.png", dpi=130)
print(here / f"{split}-frontier.png")
