"""Decomposition: walk from a kvpress top-k press to the full probabilistic press one change at a time.

For each proposal family and ratio (docs/method.md, "Decomposition"):

  (a) topk      kvpress's own top-k press;
  (b) head      the same scores as a proposal, top-k with kvpress's count per head
                (``sampler="topk", budget="head"``): must keep kvpress's set;
  (c) layer     top-k under the paper's allocation with one scale per layer;
      global    ... and with one scale for the model (the allocation);
  (d) sampled   the paper's Poisson draws under the global budget, no correction (the sampler);
  (e) corrected the same draws with the SNIS correction (the correction).

Scores come from the runner (decoded answers, stored per (example, configuration) under the step's
label, resumable and shardable). Needle survival needs no decoding: for each NIAH example and step,
the fraction of (layer, KV head) pairs in which every token of a needle's value survived, per
layer, read off the compressed cache (``survival.jsonl``). Tables and plots: ``experiments.decompose.report``.

``python -m experiments.decompose --out results/archive/decompose/dev-1024 [--survival-only]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvpress import KVPressTextGenerationPipeline

from evaluation.engine import Prefill
from evaluation.engine.runner import Config, run
from evaluation.metrics.survival import kept_positions, survival
from evaluation.store.results import ResultStore, shard, write_atomic
from evaluation.tasks.ruler.needles import needle_positions
from experiments.decompose import report as decompose_report
from experiments.decompose.steps import DEV_TASKS, FAMILIES, all_configs

# ------------------------------------------------------------------------------ needle survival


def measure_survival(model, tokenizer, frame, configs, out: Path, shard_spec: str | None, log=print) -> int:
    """Append one survival record per (NIAH example, configuration) to ``out/survival.jsonl``."""
    path = out / ("survival.jsonl" if not shard_spec else f"survival-{shard_spec.replace('/', 'of')}.jsonl")
    done = set()
    if path.exists():
        done = {(r["example_id"], r["press"], r["compression_ratio"], r["seed"])
                for r in map(json.loads, path.read_text().splitlines())}
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    rows = [row for _, row in frame.iterrows() if row["task"].startswith("niah")]
    written = 0
    for row in shard(rows, shard_spec, key=lambda r: r["example_id"]):
        todo = [(f, s, c) for f, s, c in configs
                if (row["example_id"], c.label, c.compression_ratio, c.seed) not in done]
        if not todo:
            continue
        inputs = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], max_context_length=10**9)
        context_ids = inputs["context_ids"].to(model.device)
        needles = needle_positions(tokenizer, context_ids, list(row["answer"]))
        prefill = Prefill(model, context_ids, [cfg.build() for _, _, cfg in todo])
        start = time.perf_counter()
        with path.open("a") as f:
            for family, step, cfg in todo:
                press = cfg.build()
                cache = prefill.compress(press)
                record = {"example_id": row["example_id"], "task": row["task"], "family": family, "step": step,
                          "press": cfg.label, "compression_ratio": cfg.compression_ratio, "seed": cfg.seed,
                          "needle_tokens": sum(map(len, needles)),
                          **survival(kept_positions(prefill, cache, press), needles)}
                f.write(json.dumps(record) + "\n")
                written += 1
            f.flush()
        log(f"[survival] {row['example_id']}: {len(todo)} configurations in {time.perf_counter() - start:.0f} s")
    return written


# ------------------------------------------------------------------------------ CLI


def add_split_arguments(p: argparse.ArgumentParser) -> None:
    """--model and the RULER examples (--context-length, --data-seed, --n-examples, --tasks): the
    development split by default."""
    p.add_argument("--model", default=None, help="HF id or local path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--data-seed", type=int, default=0, help="RULER data seed (0: the development split)")
    p.add_argument("--n-examples", type=int, default=8, help="examples, spread over --tasks")
    p.add_argument("--tasks", nargs="+", default=DEV_TASKS)


def load_split(args: argparse.Namespace, out: Path):
    """Write ``out/settings.json`` (the arguments), load the model and generate the examples of
    ``add_split_arguments``: (model, tokenizer, frame)."""
    from evaluation.tasks.ruler.offline import generate_ruler
    from kvpress_prob.models import load_model

    write_atomic(out / "settings.json", json.dumps(vars(args), indent=2))
    model, tokenizer = load_model(args.model)
    return model, tokenizer, generate_ruler(tokenizer, args.context_length, args.n_examples, args.data_seed, args.tasks)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.decompose", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="results/archive/decompose/dev-1024", help="output folder")
    add_split_arguments(p)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--extra", nargs="*", default=[], help="other registry presses measured alongside the steps")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.25, 0.5, 0.75])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--shard", default=None, help="i/n: only shard i of n (by example)")
    p.add_argument("--decode-batch", type=int, default=43)
    p.add_argument("--survival-only", action="store_true", help="needle survival only (no decoding)")
    p.add_argument("--scores-only", action="store_true", help="decoded scores only")
    p.add_argument("--report", action="store_true", help="only write the report from what is in --out")
    p.add_argument("--quick", action="store_true", help="2 examples, tova and knorm, r = 0.5, 2 seeds")
    return p


def main(argv: list[str] | None = None) -> None:
    from kvpress_prob.models import EMBEDDED_NAME

    args = parser().parse_args(argv)
    if args.quick:
        args.n_examples, args.families, args.ratios, args.seeds = 2, ["tova", "knorm"], [0.5], [0, 1]
        args.tasks = ["niah_single_1", "niah_multikey_2"]
    out = Path(args.out)
    if args.report and not out.is_dir():
        raise FileNotFoundError(f"--report: no results to report, {out} does not exist")
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        model, tokenizer, frame = load_split(args, out)
        configs = all_configs(args.families, args.ratios, args.seeds, args.extra)
        if not args.scores_only:
            measure_survival(model, tokenizer, frame, configs, out, args.shard)
        if not args.survival_only:
            unique = list(dict.fromkeys(cfg for _, _, cfg in configs))
            name = "results.jsonl" if not args.shard else f"shard-{args.shard.replace('/', 'of')}.jsonl"
            run(model, tokenizer, frame, [Config("full", 0.0, 0), *unique], ResultStore(out / name),
                model_name=args.model or EMBEDDED_NAME, dataset="ruler", data_dir=str(args.context_length),
                shard_spec=args.shard, decode_batch=args.decode_batch)
    decompose_report.write(out, args.families, args.ratios, args.seeds, args.extra)
