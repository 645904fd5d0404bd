"""``kvprob recall run`` / ``kvprob recall report``: the recall benchmark's commands (docs/research/README.md).

    kvprob recall run --split dev --presses snapkv prob_min_h --ratios 0.5 0.75 --seeds 0 1 2 \\
        --max-windows 12 --out runs/recall-dev-1024
    kvprob recall report --results runs/recall-dev-1024
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from evaluation.tasks.prose.cli import add_verbs, run_folder, sweep_arguments, sweep_options
from evaluation.tasks.recall import CONTEXT, CUE_TOKENS, DATASET, SCORED_TOKENS, SENTENCES, VERSION


def add_parser(sub, add, ratio, positive_int, model_option) -> None:
    """Register ``recall`` with its ``run`` and ``report`` under ``sub`` (as ``evaluation.tasks.prose.cli``)."""
    from evaluation.tasks.prose.essays import SPLITS

    p = add("recall", "the recall benchmark: prefill an essay window, cue one of its sentences, score its rest")
    r = add_verbs(p, "recall", model_option, "the top-k press with the best accuracy per ratio")
    r.add_argument("--split", required=True, choices=SPLITS, help="essays of the development or test split")
    r.add_argument("--context", type=positive_int("--context"), default=CONTEXT, help="context tokens per window")
    r.add_argument("--sentences", type=positive_int("--sentences"), default=SENTENCES,
                   help="cued sentences per window (one per equal part of the context)")
    r.add_argument("--cue-tokens", type=positive_int("--cue-tokens"), default=CUE_TOKENS,
                   help="the sentence's first tokens given after the blank line")
    r.add_argument("--scored-tokens", type=positive_int("--scored-tokens"), default=SCORED_TOKENS,
                   help="at most this many of the sentence's next tokens scored")
    sweep_arguments(r, ratio, positive_int)


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
    from evaluation.tasks.recall.cues import order, windows
    from evaluation.tasks.recall.measure import run

    def find(tokenizer):
        found = order(windows(tokenizer, args.context, args.split, args.sentences, args.cue_tokens,
                              args.scored_tokens, args.max_per_essay), args.max_windows)[args.skip_windows:]
        print(f"{args.split}: {len(found)} windows of {len({w.essay for w in found})} essays, "
              f"{sum(len(w.cues) for w in found)} cues", file=sys.stderr)
        return found

    def measure(model, tokenizer, found, configs, store):
        return run(model, found, configs, store, model_name=model_name(args.model), split=args.split)

    version = f"{VERSION}/sentences{args.sentences}/cue{args.cue_tokens}"
    out = run_folder(args, load, model_name, DATASET, version, find, measure, command_line(args))
    if not args.no_report:
        cmd_report(argparse.Namespace(results=[out], reference=None, out=None))
    return out


def cmd_report(args) -> str:
    from evaluation.tasks.recall.tables import write

    path, text = write(args.results, args.out, args.reference)
    print(f"wrote {path}", file=sys.stderr)
    return text
