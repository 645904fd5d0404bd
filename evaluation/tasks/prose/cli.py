"""``kvprob prose run`` / ``kvprob prose report``: the prose benchmark's commands (docs/research/README.md).

    kvprob prose run --split dev --context 1024 --presses snapkv prob_min_h --ratios 0.5 0.75 \\
        --seeds 0 1 2 --max-per-essay 2 --out runs/prose-dev-1024
    kvprob prose report --results runs/prose-dev-1024
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from evaluation.tasks.prose import CONTEXTS, DATASET, SCORED_TOKENS


def add_parser(sub, add, ratio, positive_int, model_option) -> None:
    """Register ``prose`` with its ``run`` and ``report`` under ``sub`` (the kvprob subparsers); ``add``
    makes a subparser, ``ratio`` / ``positive_int`` parse option values, ``model_option`` adds --model."""
    from evaluation.tasks.prose.essays import SPLITS

    p = add("prose", "the prose benchmark: prefill an essay window, score the next tokens teacher-forced (KL, ΔNLL)")
    r = add_verbs(p, "prose", model_option, "the top-k press with the lowest mean KL at each ratio")
    r.add_argument("--split", required=True, choices=SPLITS, help="essays of the development or the test split "
                                                                   "(docs/protocol.md, Prose split)")
    r.add_argument("--context", type=positive_int("--context"), required=True,
                   help=f"context tokens n prefilled per window (the protocol's: {' and '.join(map(str, CONTEXTS))})")
    r.add_argument("--scored-tokens", type=positive_int("--scored-tokens"), default=SCORED_TOKENS,
                   help="continuation tokens T scored teacher-forced")
    sweep_arguments(r, ratio, positive_int)
    r.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")


def add_verbs(p, name: str, model_option, reference: str):
    """The ``run`` and ``report`` verbs of the essay benchmark ``name`` (prose, recall) under its parser
    ``p``. Returns ``run``'s parser, with --model, for the benchmark's options and ``sweep_arguments``;
    ``report`` takes --results, --reference (unset: ``reference``) and --out."""
    verbs = p.add_subparsers(dest=f"{name}_command", required=True)
    r = verbs.add_parser("run", help="run configurations on the windows of one split (resumable)",
                         description="run configurations on the windows of one split (resumable: rerun to finish)")
    model_option(r)
    rep = verbs.add_parser("report", help=f"tables of a {name} results folder (report.md, summary.csv)",
                           description=f"tables of a {name} results folder: paired over windows, win scores over essays")
    rep.add_argument("--results", nargs="+", required=True,
                     help="results folders or .jsonl files (one split, one setting)")
    rep.add_argument("--reference", default=None, help=f"press to compare every press with (unset: {reference})")
    rep.add_argument("--out", default=None, help="folder for report.md and summary.csv (unset: the first results folder)")
    return r


def command_line(args) -> str:
    """The canonical command of a run, as the report prints it."""
    parts = ["kvprob", "prose", "run", "--split", args.split, "--context", str(args.context)]
    if args.scored_tokens != SCORED_TOKENS:
        parts += ["--scored-tokens", str(args.scored_tokens)]
    if args.model:
        parts += ["--model", args.model]
    return shlex.join(parts + sweep_options(args))


def sweep_arguments(r, ratio, positive_int) -> None:
    """Add the options of a run over essay windows that ``sweep_options`` writes back (presses, ratios,
    seeds, window limits, --out) and --no-report (prose and recall alike)."""
    r.add_argument("--presses", nargs="+", required=True, metavar="NAME",
                   help="registry names (the full cache is always run as the reference)")
    r.add_argument("--ratios", nargs="+", type=ratio, default=[0.5, 0.75], help="compression ratios in [0, 1)")
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the sampling presses")
    r.add_argument("--max-per-essay", type=positive_int("--max-per-essay"), default=None,
                   help="the first windows of each essay only (unset: all)")
    r.add_argument("--max-windows", type=positive_int("--max-windows"), default=None,
                   help="at most this many windows: every essay's first, then every essay's second, ... (unset: all)")
    r.add_argument("--skip-windows", type=nonnegative_int, default=0,
                   help="leave out the first this many windows of that order (a run on the windows a smaller "
                        "run did not reach)")
    r.add_argument("--out", required=True, help="results folder (one split and one setting per folder)")
    r.add_argument("--no-report", action="store_true", help="do not write the report at the end")


def sweep_options(args) -> list[str]:
    """The presses, ratios, seeds, window limits and output folder of a run over essay windows, as its
    command line writes them (prose and recall alike)."""
    parts = ["--presses", *args.presses, "--ratios", *[f"{r:g}" for r in args.ratios],
             "--seeds", *[str(s) for s in args.seeds]]
    for option in ("max_per_essay", "max_windows"):
        if getattr(args, option) is not None:
            parts += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    if args.skip_windows:
        parts += ["--skip-windows", str(args.skip_windows)]
    return parts + ["--out", str(args.out)]


def nonnegative_int(text: str) -> int:
    """``--skip-windows``'s type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--skip-windows must be >= 0, got {value}")
    return value


def check_presses(names) -> None:
    """Stop with the registry's error for a name that is neither registered nor a valid grid name."""
    from kvpress_prob.names.registry import factory

    for name in names:
        try:
            factory(name)
        except (KeyError, ValueError) as error:
            sys.exit(f"unknown press {name!r}: {error}")


def cmd_run(args, load, model_name) -> Path:
    """Run the windows of ``args.split``; ``load(args)`` gives (model, tokenizer), ``model_name(arg)`` the
    records' model name (the kvprob CLI's own)."""
    import torch

    from evaluation.tasks.prose.essays import VERSION, skipped, windows
    from evaluation.tasks.prose.measure import order, run

    def find(tokenizer):
        found = order(windows(tokenizer, args.context, args.scored_tokens, args.split, args.max_per_essay),
                      args.max_windows)[args.skip_windows:]
        short = skipped(tokenizer, args.context, args.scored_tokens, args.split)
        print(f"{args.split}: {len(found)} windows of {len({w.essay for w in found})} essays; {len(short)} essays "
              f"shorter than one window skipped ({', '.join(short)})", file=sys.stderr)
        return found

    def measure(model, tokenizer, found, configs, store):
        return run(model, tokenizer, found, configs, store, model_name=model_name(args.model), split=args.split,
                   scored_tokens=args.scored_tokens)

    if args.threads:
        torch.set_num_threads(args.threads)
    out = run_folder(args, load, model_name, DATASET, VERSION, find, measure, command_line(args))
    if not args.no_report:
        cmd_report(argparse.Namespace(results=[out], reference=None, out=None))
    return out


def run_folder(args, load, model_name, dataset: str, version: str, find, measure, command: str) -> Path:
    """A run over essay windows into ``args.out`` (prose and recall alike): the presses and the folder's
    manifest are checked before the model is loaded (``load(args)``) and again with it, ``find(tokenizer)``
    gives the windows, the run is recorded in the manifest (``command`` its command line), then
    ``measure(model, tokenizer, windows, configurations, store)`` writes the records not yet in the store.
    The manifest's identity: ``manifest.identity`` of the run's settings, ``version`` its dataset version."""
    from evaluation.store import manifest
    from evaluation.engine.runner import configurations
    from evaluation.store.results import ResultStore

    check_presses(args.presses)  # a registered name or any valid grid name; the error lists the valid parts
    out = Path(args.out)
    settings = dict(model=model_name(args.model), dataset=dataset, data_seed=None, context_length=args.context,
                    query_aware=False, split=args.split, scored_tokens=args.scored_tokens, dataset_version=version)
    data_dir = str(args.context)
    manifest.check_folder(out, manifest.identity(**settings), data_dir=data_dir)  # before the model
    model, tokenizer = load(args)
    identity = manifest.identity(**settings, loaded_model=model, tokenizer=tokenizer)
    notes = manifest.check_folder(out, identity, data_dir=data_dir)
    found = find(tokenizer)
    store = ResultStore(out / "results.jsonl")
    entry = manifest.run_entry(n_examples=len(found), tasks=None, decode_batch=1, shard=None, device=str(model.device))
    manifest.write(store.path, identity, entry | {"command": command}, notes)
    store.path.touch()
    start = time.perf_counter()
    written = measure(model, tokenizer, found, configurations(args.presses, args.ratios, args.seeds), store)
    print(f"{written} records written to {store.path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def cmd_report(args) -> str:
    from evaluation.tasks.prose.tables import write

    path, text = write(args.results, args.out, args.reference)
    print(text)
    print(f"written: {path}")
    return text
