"""Sampled pi_min-h against the exact one: proposal error and needle survival, per number of rows s.

For each example, one full-cache prefill (``engine.Prefill``) serves:
- the total-variation distance 0.5 * sum_i |pi_s(i) - pi(i)| between the sampled proposal
  (``SampledMinVarianceProposal(query_rows=s, row_seed=k)``) and the exact pi_min-h, per layer and
  KV head (``tv.jsonl``);
- needle survival (``decompose.survival``: the fraction of (layer, KV head) pairs holding every
  token of a needle's value) of ``prob_min_h`` and of the same press with the sampled proposal, at
  each ratio and press seed (``survival.jsonl``).
Records are appended per example, so a killed run resumes where it stopped. ``report.md``: per s,
the mean TV and the paired survival difference (per example, averaged over ratios and seeds).

``python -m experiments.sampled_rows --out results/archive/dev/sampled-rows-1024``; with
``--paired <results folders>``: the test split's paired score table instead.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
from kvpress import KVPressTextGenerationPipeline

from evaluation.engine import Prefill
from evaluation.metrics.survival import kept_positions, survival
from evaluation.report.stats import paired_table
from evaluation.store.results import write_atomic
from evaluation.tasks.ruler.needles import needle_positions
from experiments.decompose.run import add_split_arguments, load_split
from kvpress_prob.proposals.attention import SampledMinVarianceProposal
from kvpress_prob.names.registry import get_press

EXACT = "prob_min_h"


def sampled_press(s: int, ratio: float, seed: int, row_seed: int = 0):
    """``prob_min_h`` with the sampled proposal of s rows."""
    return get_press(EXACT, ratio, seed=seed, proposal=SampledMinVarianceProposal(query_rows=s, row_seed=row_seed))


@torch.no_grad()
def total_variation(prefill: Prefill, exact, sampled) -> torch.Tensor:
    """(L, H_kv) total-variation distance between two presses' proposals on one prefill."""
    a, b = prefill.proposals_of(exact), prefill.proposals_of(sampled)
    return torch.stack([0.5 * (a[m][0] - b[m][0]).abs().sum(-1) for m in sorted(a, key=lambda m: m.layer_idx)])


def measure(model, tokenizer, frame, args, out: Path, log=print) -> None:
    tv_path, survival_path = out / "tv.jsonl", out / "survival.jsonl"
    done = {json.loads(line)["example_id"] for line in tv_path.read_text().splitlines()} if tv_path.exists() else set()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    for _, row in frame.iterrows():
        if row["example_id"] in done:
            continue
        start = time.perf_counter()
        inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)
        context_ids = inputs["context_ids"].to(model.device)
        prefill = Prefill(model, context_ids)
        tv_records, survival_records = [], []
        for s in args.rows:
            for row_seed in args.row_seeds:
                tv = total_variation(prefill, get_press(EXACT, 0.5), sampled_press(s, 0.5, 0, row_seed))
                tv_records.append({"example_id": row["example_id"], "task": row["task"], "n": context_ids.shape[1],
                                   "rows": s, "row_seed": row_seed, "tv": tv.tolist()})
        if row["task"].startswith("niah"):
            needles = needle_positions(tokenizer, context_ids, list(row["answer"]))
            for ratio in args.ratios:
                for seed in args.seeds:
                    presses = {0: get_press(EXACT, ratio, seed=seed)}  # rows 0: the exact proposal
                    presses |= {s: sampled_press(s, ratio, seed) for s in args.rows}
                    for s, press in presses.items():
                        cache = prefill.compress(press)
                        survival_records.append({"example_id": row["example_id"], "task": row["task"], "rows": s,
                                                 "compression_ratio": ratio, "seed": seed,
                                                 **survival(kept_positions(prefill, cache, press), needles)})
        with survival_path.open("a") as f:  # survival first: an example is done once its TV is written
            f.writelines(json.dumps(r) + "\n" for r in survival_records)
        with tv_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in tv_records)
        log(f"[sampled-rows] {row['example_id']} ({row['task']}, n = {context_ids.shape[1]}): "
            f"{time.perf_counter() - start:.0f} s")


def report(out: Path) -> str:
    """Per s: TV to the exact proposal (mean, 90th percentile, worst layer) and paired survival."""
    tv = pd.DataFrame([json.loads(line) for line in (out / "tv.jsonl").read_text().splitlines()])
    sv = pd.DataFrame([json.loads(line) for line in (out / "survival.jsonl").read_text().splitlines()])
    sv = sv.dropna(subset=["survival"])
    lines = [
        "# Sampled pi_min-h vs the exact one (development split)", "",
        f"Examples: {tv.example_id.nunique()} (TV), {sv.example_id.nunique()} NIAH (survival); "
        f"n = {tv.n.min()}-{tv.n.max()} tokens. TV = 0.5 sum_i |pi_s(i) - pi(i)| per (layer, KV head), "
        f"row seeds {sorted(map(int, tv.row_seed.unique()))}. Survival: fraction of (layer, KV head) pairs holding a "
        f"needle's whole value, averaged per example over r = {sorted(map(float, sv.compression_ratio.unique()))} and press "
        "seeds; the sampled press uses row_seed 0. Difference: sampled - exact, paired by example, "
        "95 % t-interval.", "",
        "| s | mean TV | 90th pct TV | worst layer (mean TV) | survival exact | survival sampled | difference [95 % CI] |",
        "| ---: | ---: | ---: | :--- | ---: | ---: | :--- |",
    ]
    for s in sorted(tv.rows.unique()):
        values = torch.tensor(list(tv[tv.rows == s].tv), dtype=torch.float64)  # (records, L, H)
        flat = values.flatten()
        per_layer = values.mean(dim=(0, 2))
        worst = int(per_layer.argmax())
        pair = paired_table(sv, "survival", "rows", s, 0, unit="example_id").iloc[0]
        lines.append(f"| {s} | {flat.mean():.4f} | {flat.quantile(0.9):.4f} | {worst} ({per_layer[worst]:.4f}) | "
                     f"{pair['mean_b']:.4f} | {pair['mean_a']:.4f} | {pair['mean']:+.4f} "
                     f"[{pair['lo']:+.4f}, {pair['hi']:+.4f}] |")
    lines += ["", "Mean TV per layer (rows: s; columns: layers 0..L-1):", ""]
    for s in sorted(tv.rows.unique()):
        values = torch.tensor(list(tv[tv.rows == s].tv), dtype=torch.float64)
        lines.append(f"- s = {s}: " + " ".join(f"{v:.3f}" for v in values.mean(dim=(0, 2)).tolist()))
    text = "\n".join(lines) + "\n"
    write_atomic(out / "report.md", text)
    return text


def paired_scores(results: pd.DataFrame, sampled: str = "prob_min_h_s256") -> str:
    """Scores of ``sampled`` minus ``prob_min_h`` at each ratio, paired on the examples both completed
    (seeds averaged within an example first), with 95 % t-intervals, from the runner's records."""
    from evaluation.report.aggregate import prepare
    from evaluation.report.compare import shared_examples

    df = shared_examples(prepare(results), [EXACT, sampled])
    table = paired_table(df, "score", "press", sampled, EXACT, by=["compression_ratio"])
    pooled = paired_table(df, "score", "press", sampled, EXACT).iloc[0]
    tasks = df.groupby("task")["example_id"].nunique()
    lines = [f"# {sampled} - {EXACT}, paired on examples", "",
             f"{df.example_id.nunique()} examples ({', '.join(f'{t} {k}' for t, k in tasks.items())}); seeds "
             f"{sorted(map(int, df[df.press == sampled].seed.unique()))}, averaged within an example; full cache "
             f"{df[df.press == 'full'].score.mean():.1f}.", "",
             f"| r | {EXACT} | {sampled} | difference [95 % t-interval] | examples where {sampled} is lower | p |",
             "| ---: | ---: | ---: | :--- | ---: | ---: |"]
    for _, row in table.sort_values("compression_ratio").iterrows():
        lines.append(f"| {row.compression_ratio:g} | {row.mean_b:.1f} | {row.mean_a:.1f} | {row['mean']:+.1f} "
                     f"[{row.lo:+.1f}, {row.hi:+.1f}] | {row.a_better}/{row.n} | {row.p_value:.2f} |")
    lines.append(f"| all (example means over the ratios) | {pooled.mean_b:.1f} | {pooled.mean_a:.1f} | "
                 f"{pooled['mean']:+.1f} [{pooled.lo:+.1f}, {pooled.hi:+.1f}] | {pooled.a_better}/{pooled.n} | "
                 f"{pooled.p_value:.2f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.sampled_rows", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="results/archive/dev/sampled-rows-1024", help="output folder")
    add_split_arguments(p)
    p.add_argument("--rows", nargs="+", type=int, default=[16, 32, 64, 128, 256], help="values of s (query rows)")
    p.add_argument("--row-seeds", nargs="+", type=int, default=[0, 1, 2], help="row seeds of the TV measurement")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.25, 0.5, 0.75, 0.9])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="press seeds of the survival measurement")
    p.add_argument("--report", action="store_true", help="only write the report from what is in --out")
    p.add_argument("--paired", nargs="+", default=None, metavar="RESULTS",
                   help="instead: the paired score table of prob_min_h_s256 - prob_min_h from runner results folders")
    p.add_argument("--paired-out", default=None, help="markdown file for --paired's table (unset: print only)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.paired:
        from evaluation.store.results import load_results

        text = paired_scores(load_results(*[f for folder in args.paired for f in sorted(Path(folder).glob("*.jsonl"))]))
        if args.paired_out:
            write_atomic(Path(args.paired_out), text)
        print(text)
        return
    if min(args.rows) < 1:
        raise SystemExit(f"--rows must be >= 1, got {args.rows}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        model, tokenizer, frame = load_split(args, out)
        measure(model, tokenizer, frame, args, out)
    print(report(out))


if __name__ == "__main__":
    main()
