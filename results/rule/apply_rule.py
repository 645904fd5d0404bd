"""Applies docs/recommendation-rule.md to the two development splits: per-regime win scores over the pool,
the combined score, the three picks. Usage: python results/rule/apply_rule.py RULER_DIR... -- PROSE_DIR...
(writes results/rule/dev-rule.md)."""

import sys
from pathlib import Path

import pandas as pd

from evaluation.aggregate import win_scores
from evaluation.report import markdown_table
from kvpress_prob.names.registry import is_sampling

RATIOS = (0.5, 0.75)


def frame(dirs):
    return pd.concat([pd.read_json(Path(d) / "results.jsonl", lines=True) for d in dirs], ignore_index=True)


def main():
    split = sys.argv.index("--")
    ruler, prose = frame(sys.argv[1:split]), frame(sys.argv[split + 1:])
    ruler = ruler[ruler.compression_ratio.isin(RATIOS) | (ruler.press == "full")]
    prose = prose[prose.compression_ratio.isin(RATIOS) | (prose.press == "full")].assign(score=lambda d: -d["kl"])
    pool = sorted((set(ruler.press) & set(prose.press)) - {"full"})
    w_r = win_scores(ruler[ruler.press.isin(pool)]).set_index("press")["win_score"].rename("ruler_win")
    w_p = win_scores(prose[prose.press.isin(pool)]).set_index("press")["win_score"].rename("prose_win")
    table = pd.concat([w_r, w_p], axis=1)
    table["combined"] = table.mean(axis=1)
    table["samples"] = [is_sampling(p) for p in table.index]
    held = prose[prose.press != "full"].assign(held=lambda d: d.kv_bytes / prose[prose.press == "full"].kv_bytes.mean())
    table["prose_held_r05"] = held[held.compression_ratio == 0.5].groupby("press")["held"].mean()
    table = table.sort_values("combined", ascending=False)
    cand = table[table.samples]
    picks = {"RECOMMENDED": cand.combined.idxmax(), "RECOMMENDED_RETRIEVAL": cand.ruler_win.idxmax(),
             "RECOMMENDED_PROSE": cand.prose_win.idxmax()}
    lines = ["# The rule of docs/recommendation-rule.md on the development splits", "",
             f"RULER dev: {', '.join(sys.argv[1:split])}; prose dev: {', '.join(sys.argv[split + 1:])}.",
             f"Pool: {len(pool)} presses run on both ({len(cand)} candidates that sample). Ratios {RATIOS}.",
             "held: bytes held at r = 0.5 on prose (keys, values, bias, padding) over the full cache's.", "",
             "Command: `python results/rule/apply_rule.py " + " ".join(sys.argv[1:]) + "`", "",
             *[f"- **{k}** = `{v}` (RULER win {table.ruler_win[v]:.3f}, prose win {table.prose_win[v]:.3f}, "
               f"combined {table.combined[v]:.3f})" for k, v in picks.items()], "",
             markdown_table(table, float_format="{:.3f}")]
    rec = picks["RECOMMENDED"]
    lagging = all(table.loc[rec, col] < table.loc[picks[k], col] - 0.10
                  for k, col in (("RECOMMENDED_RETRIEVAL", "ruler_win"), ("RECOMMENDED_PROSE", "prose_win")))
    if rec not in (picks["RECOMMENDED_RETRIEVAL"], picks["RECOMMENDED_PROSE"]) and lagging:
        lines += ["", "No single press leads both regimes (step 3): RECOMMENDED trails each leader by more than 0.10."]
    out = Path(__file__).with_name("dev-rule.md")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))


if __name__ == "__main__":
    main()
