"""Both test splits for the two recommendations and the pool's top-k presses: RULER (data seed 1, 32 examples,
r = 0.5 / 0.75, seeds 0 1 2) mean scores and win scores, prose (n = 1024, 23 windows of 23 test essays) win
scores by KL. Usage: python results/rule/test_two_regimes.py PROSE_TEST_DIR (writes results/rule/test-two-regimes.md)."""

import sys
from pathlib import Path

import pandas as pd

from evaluation.aggregate import win_scores
from evaluation.report import markdown_table

POOL = ["streaming_llm", "tova", "knorm", "keydiff", "expected_attention", "hybrid_keydiff_block8_a90",
        "prob_min_h_priority", "prob_min_h_priority_head"]  # snapkv and h2o: 3 RULER test examples only


def main():
    ruler = pd.concat([pd.read_json(f"results/test/{d}/results.jsonl", lines=True)
                       for d in ("ruler-1024", "hybrid-1024", "ruler-1024-two-regimes")])
    ruler = ruler[ruler.press.isin(POOL + ["full"]) & (ruler.compression_ratio.isin([0.5, 0.75]) | (ruler.press == "full"))]
    prose = pd.read_json(Path(sys.argv[1]) / "results.jsonl", lines=True).assign(score=lambda d: -d["kl"])
    prose = prose[prose.press.isin(POOL + ["full"])]
    means = ruler[ruler.press != "full"].groupby(["press", "compression_ratio"]).score.mean().unstack()
    table = pd.DataFrame({"RULER r=0.5": means[0.5], "RULER r=0.75": means[0.75],
                          "RULER win": win_scores(ruler).set_index("press")["win_score"],
                          "prose win (KL)": win_scores(prose).set_index("press")["win_score"]})
    table["mean of the two wins"] = table[["RULER win", "prose win (KL)"]].mean(axis=1)
    table = table.sort_values("mean of the two wins", ascending=False)
    text = "\n".join(["# Both test splits (no choice was made on them)", "",
                      f"RULER: data seed 1, 32 examples, 1024 tokens; prose: {sys.argv[1]}, one window per test essay. "
                      "Win scores within this pool. Command: `python results/rule/test_two_regimes.py " + sys.argv[1] + "`",
                      "", markdown_table(table, float_format="{:.3f}")])
    Path(__file__).with_name("test-two-regimes.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
