"""kvprob: generate datasets, run sweeps, merge shards, report, reproduce the paper's presets.

    kvprob generate --dataset ruler --context-length 4096
    kvprob run --dataset ruler --context-length 1024 --presses snapkv prob_min_h --ratios 0.5 --out results/x
    kvprob merge --out results/x/results.jsonl results/x/shard-*.jsonl
    kvprob report --results results/x
    kvprob reproduce --preset cpu-quick
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from evaluation.datasets import load_dataset_frame
from evaluation.datasets.ruler import OFFLINE_TASKS
from kvpress_prob.registry import PRESSES

PAPER_METHODS = ["streaming_llm", "snapkv", "tova", "h2o", "knorm", "prob_min", "prob_min_h", "prob_h2o", "prob_h2o_h"]
PRESETS = {
    "paper-ruler": dict(dataset="ruler", context_length=4096, n_examples=130, presses=PAPER_METHODS,
                        ratios=[0.1, 0.25, 0.5, 0.75, 0.9], seeds=[0, 1, 2]),
    "paper-longbench": dict(dataset="longbench", context_length=3000, n_examples=None, presses=PAPER_METHODS,
                            ratios=[0.1, 0.25, 0.5, 0.75, 0.9], seeds=[0, 1, 2]),
    "cpu-quick": dict(dataset="ruler", context_length=1024, n_examples=11,
                      presses=["snapkv", "tova", "prob_snapkv", "prob_min_h"],
                      ratios=[0.5, 0.75], seeds=[0]),
}


def _model_name(model_arg: str | None) -> str:
    from kvpress_prob.models import EMBEDDED_NAME

    return model_arg or EMBEDDED_NAME


def _load(args):
    from kvpress_prob.models import load_model

    return load_model(args.model)


def _frame(args, tokenizer):
    tasks = args.tasks or None
    if tasks:
        unknown = set(tasks) - set(OFFLINE_TASKS) - {"qa_1", "qa_2", "hotpotqa", "qasper", "triviaqa"}
        if unknown:
            sys.exit(f"unknown task(s) {sorted(unknown)}; valid: {', '.join(OFFLINE_TASKS)}, qa_1, qa_2, "
                     "hotpotqa, qasper, triviaqa")
    kwargs = dict(context_length=args.context_length, seed=args.data_seed, tasks=tasks)
    if args.n_examples:
        kwargs["n_examples"] = args.n_examples
    if args.dataset == "longbench":
        kwargs = dict(tasks=tasks, max_context_tokens=args.context_length)
    return load_dataset_frame(args.dataset, tokenizer, **kwargs)


def cmd_generate(args) -> None:
    from transformers import AutoTokenizer

    from kvpress_prob.models import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(args.model or embedded_model_path())
    df = _frame(args, tokenizer)
    print(df.groupby("task").size().to_string())
    print(f"{len(df)} examples, context tokens {df.context_tokens.min()}-{df.context_tokens.max()}")


def cmd_run(args) -> Path:
    from evaluation.runner import configurations, run
    from evaluation.store import ResultStore

    unknown = [p for p in args.presses if p not in PRESSES]
    if unknown:
        sys.exit(f"unknown press(es) {unknown}; valid: {', '.join(sorted(PRESSES))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = configurations(args.presses, args.ratios, args.seeds)
    model, tokenizer = _load(args)
    df = _frame(args, tokenizer)
    name = "results.jsonl" if not args.shard else f"shard-{args.shard.replace('/', 'of')}.jsonl"
    store = ResultStore(out / name)
    data_dir = str(args.context_length) if args.dataset.startswith("ruler") else "lt3000"
    start = time.perf_counter()
    written = run(model, tokenizer, df, configs, store, model_name=_model_name(args.model), dataset=args.dataset,
                  data_dir=data_dir, query_aware=args.query_aware, shard_spec=args.shard,
                  decode_batch=args.decode_batch)
    print(f"{written} results written to {store.path} in {time.perf_counter() - start:.0f} s")
    return out


def cmd_merge(args) -> None:
    from evaluation.store import merge

    print(f"{merge([Path(p) for p in args.shards], Path(args.out))} records in {args.out}")


def cmd_report(args) -> dict:
    from evaluation.report import write_report
    from evaluation.store import load_results, write_kvpress_folder

    root = Path(args.results)
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    df = load_results(*files)
    out = Path(args.out) if args.out else (root if root.is_dir() else root.parent) / "report"
    paths = write_report(df, out, args.title)
    if args.kvpress_folders:
        for (dataset, data_dir, model, press, ratio), group in df.groupby(
            ["dataset", "data_dir", "model", "press", "compression_ratio"]
        ):
            write_kvpress_folder(out / "kvpress", group, dataset, data_dir, model, press, ratio)
    print(paths["summary_markdown"])
    print(f"\nTables and plots: {out}")
    return paths


def cmd_reproduce(args) -> None:
    preset = dict(PRESETS[args.preset])
    for field in ("context_length", "n_examples"):
        if getattr(args, field) is not None:
            preset[field] = getattr(args, field)
    out = args.out or f"results/{args.preset}" + (
        f"-{preset['context_length']}" if args.preset == "paper-ruler" else "")
    run_args = argparse.Namespace(
        model=args.model, dataset=preset["dataset"], context_length=preset["context_length"],
        n_examples=preset["n_examples"], tasks=None, data_seed=0, presses=preset["presses"],
        ratios=preset["ratios"], seeds=preset["seeds"], out=out, shard=args.shard, query_aware=args.query_aware,
        decode_batch=args.decode_batch,
    )
    start = time.perf_counter()
    cmd_run(run_args)
    if not args.shard:
        cmd_report(argparse.Namespace(results=out, out=None, title=f"{args.preset} on {_model_name(args.model)}",
                                      kvpress_folders=True))
    print(f"wall time {time.perf_counter() - start:.0f} s")


def cmd_bench(args, rest) -> None:
    from evaluation.bench.__main__ import main as bench_main

    bench_main(rest)


def _data_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF id or local path (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default="ruler", choices=["ruler", "ruler-hub", "longbench"],
                   help="ruler = offline generator; ruler-hub, longbench need the Hugging Face hub")
    p.add_argument("--context-length", type=int, default=4096,
                   help="RULER context tokens (longbench: the maximum context tokens, default 3000 in presets)")
    p.add_argument("--n-examples", type=int, default=None, help="RULER examples (default 130: RULER-130)")
    p.add_argument("--tasks", nargs="*", default=None, help=f"subset of tasks (RULER offline: {' '.join(OFFLINE_TASKS)})")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the generated dataset")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvprob", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate (and cache) a dataset, print its task counts")
    _data_options(g)

    r = sub.add_parser("run", help="run a sweep (resumable: rerun the same command to finish it)")
    _data_options(r)
    r.add_argument("--presses", nargs="+", required=True, help="registry names (see kvprob run --presses x)")
    r.add_argument("--ratios", nargs="+", type=float, default=[0.5], help="compression ratios in [0, 1)")
    r.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds of the sampling presses")
    r.add_argument("--out", required=True, help="results folder")
    r.add_argument("--shard", default=None, help="i/n: run only shard i of n (by example), e.g. for a job array")
    r.add_argument("--query-aware", action="store_true", help="append the question to the compressed context")
    r.add_argument("--decode-batch", type=int, default=16, help="configurations decoded side by side per example (1: kvpress's own decoding loop; "
                   "larger is faster, the answers equal up to float rounding; memory grows with it)")

    m = sub.add_parser("merge", help="join shard files")
    m.add_argument("--out", required=True)
    m.add_argument("shards", nargs="+")

    rep = sub.add_parser("report", help="tables (CSV, Markdown) and plots of a results folder")
    rep.add_argument("--results", required=True, help="results folder or .jsonl file")
    rep.add_argument("--out", default=None, help="default: <results>/report")
    rep.add_argument("--title", default="kvpress-prob results")
    rep.add_argument("--kvpress-folders", action="store_true", help="also write KVPress-compatible folders")

    rp = sub.add_parser("reproduce", help="run a preset end to end and report it")
    rp.add_argument("--preset", required=True, choices=sorted(PRESETS))
    rp.add_argument("--model", default=None, help="HF id or local path (default: embedded)")
    rp.add_argument("--context-length", type=int, default=None, help="override the preset's context length")
    rp.add_argument("--n-examples", type=int, default=None, help="override the preset's example count")
    rp.add_argument("--out", default=None, help="default: results/<preset>[-<length>]")
    rp.add_argument("--shard", default=None, help="i/n: one shard (merge and report afterwards)")
    rp.add_argument("--query-aware", action="store_true", help="append the question to the compressed context")
    rp.add_argument("--decode-batch", type=int, default=16, help="configurations decoded side by side per example (1: kvpress's own decoding loop; "
                   "larger is faster, the answers equal up to float rounding; memory grows with it)")

    sub.add_parser("bench", help="measurements: kvprob bench {speed,budget,oracle,fidelity} --help", add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return cmd_bench(None, argv[1:])
    args = parser().parse_args(argv)
    {"generate": cmd_generate, "run": cmd_run, "merge": cmd_merge, "report": cmd_report,
     "reproduce": cmd_reproduce}[args.command](args)


if __name__ == "__main__":
    main()
