"""``kvprob recall run`` / ``kvprob recall report``: the recall benchmark's commands (docs/three-regimes.md).

    kvprob recall run --split dev --presses snapkv prob_min_h --ratios 0.5 0.75 --seeds 0 1 2 \\
        --max-windows 12 --out results/recall/dev-1024
    kvprob recall report --results results/recall/dev-1024
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from evaluation.prose.cli import check_presses, sweep_options
from evaluation.recall import CONTEXT, CUE_TOKENS, DATASET, SCORED_TOKENS, SENTENCES, VERSION


def add_parser(sub, add, ratio, positive_int, model_option) -> None:
    """Register ``recall`` with its ``run`` and ``report`` under ``sub`` (as ``evaluation.prose.cli``)."""
    from evaluation.datasets.essays import SPLITS

    p = add("recall", "the recall benchmark: prefill an essay window, cue one of its sentences, score its rest")
    verbs = p.add_subparsers(dest="recall_command", required=True)
    r = verbs.add_parser("run", help="run configurations on the windows of one split (resumable)",
                         description="run configurations on the windows of one split (resumable: rerun to finish)")
    model_option(r)
    r.add_argument("--split", required=True, choices=SPLITS, help="essays of the development or test split")
    r.add_argument("--context", type=positive_int("--context"), default=CONTEXT, help="context tokens per window")
    r.add_argument("--sentences", type=positive_int("--sentences"), default=SENTENCES,
                   help="cued sentences per window (one per equal part of the context)")
    r.add_argument("--cue-tokens", type=positive_int("--cue-tokens"), default=CUE_TOKENS,
                   help="the sentence's first tokens given after the blank line")
    r.add_argument("--scored-tokens", type=positive_int("--scored-tokens"), default=SCORED_TOKENS,
                   help="at most this many of the sentence's next tokens scored")
    r.add_argument("--presses", nargs="+", required=True, metavar="NAME", help="registry names (the full cache is "
                                                                                "always run as the reference)")
    r.add_argument("--ratios", nargs="+", type=ratio, default=[0.5, 0.75], help="compression ratios in [0, 1)")
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the sampling presses")
    r.add_argument("--max-per-essay", type=positive_int("--max-per-essay"), default=None,
                   help="the first windows of each essay only (unset: all)")
    r.add_argument("--max-windows", type=positive_int("--max-windows"), default=None,
                   help="at most this many windows: every essay's first, then every essay's second, ...")
    r.add_argument("--out", required=True, help="results folder (one split and setting per folder)")
    r.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    rep = verbs.add_parser("report", help="tables of a recall results folder (report.md, summary.csv)")
    rep.add_argument("--results", nargs="+", required=True, help="results folders or .jsonl files")
    rep.add_argument("--reference", default=None,
                     help="press to compare every press with (unset: the top-k press with the best accuracy per ratio)")
    rep.add_argument("--out", default=None, help="folder for report.md and summary.csv (unset: the first folder)")


def command_line(args) -> str:
    parts = ["kvprob", "recall", "run", "--split", args.split, "--context", str(args.context)]
    for option, default in (("sentences", SENTENCES), ("cue_tokens", CUE_TOKENS), ("scored_tokens", SCORED_TOKENS)):
        if getattr(args, option) != default:
            parts += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    if args.model:
        parts += ["--model", args.model]
    return shlex.join(parts + sweep_options(args))


def cmd_run(args, load, model_name) -> Path:
    """Run the windows of ``args.split``; ``load(args)`` gives (model, tokenizer), ``model_name(arg)`` the
    records' model name (the kvprob CLI's own)."""
    from evaluation import manifest
    from evaluation.recall.cues import order, windows
    from evaluation.recall.measure import run
    from evaluation.runner import configurations
    from evaluation.store import ResultStore

    check_presses(args.presses)
    out = Path(args.out)
    settings = dict(model=model_name(args.model), dataset=DATASET, data_seed=None, context_length=args.context,
                    query_aware=False, split=args.split, scored_tokens=args.scored_tokens)
    version = {"dataset_version": f"{VERSION}/sentences{args.sentences}/cue{args.cue_tokens}"}
    data_dir = str(args.context)
    manifest.check_folder(out, manifest.identity(**settings) | version, data_dir=data_dir)
    model, tokenizer = load(args)
    identity = manifest.identity(**settings, loaded_model=model, tokenizer=tokenizer) | version
    notes = manifest.check_folder(out, identity, data_dir=data_dir)
    found = order(windows(tokenizer, args.context, args.split, args.sentences, args.cue_tokens, args.scored_tokens,
                          args.max_per_essay), args.max_windows)
    print(f"{args.split}: {len(found)} windows of {len({w.essay for w in found})} essays, "
          f"{sum(len(w.cues) for w in found)} cues", file=sys.stderr)
    store = ResultStore(out / "results.jsonl")
    entry = manifest.run_entry(n_examples=len(found), tasks=None, decode_batch=1, shard=None, device=str(model.device))
    manifest.write(store.path, identity, entry | {"command": command_line(args)}, notes)
    store.path.touch()
    start = time.perf_counter()
    written = run(model, found, configurations(args.presses, args.ratios, args.seeds), store,
                  model_name=model_name(args.model), split=args.split)
    print(f"{written} records written to {store.path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if not args.no_report:
        cmd_report(argparse.Namespace(results=[out], reference=None, out=None))
    return out


def cmd_report(args) -> str:
    from evaluation.recall.tables import write

    path, text = write(args.results, args.out, args.reference)
    print(f"wrote {path}", file=sys.stderr)
    return text
