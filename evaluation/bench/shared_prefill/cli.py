"""The shared-prefill bench's options and entry point (``python -m evaluation.bench shared-prefill``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TASKS = ["niah_single_1", "niah_single_2", "niah_multikey_1"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from evaluation.bench.shared_prefill.measure import PRESSES

    p.add_argument("--context-length", type=int, default=None, help="default 2048 (--quick: 1024)")
    p.add_argument("--n-examples", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--ratio", type=float, default=0.5, help="compression ratio (default: %(default)s)")
    p.add_argument("--presses", nargs="+", default=PRESSES, help="the configurations (default: %(default)s)")


def main(args: argparse.Namespace) -> dict:
    from evaluation.bench import common
    from evaluation.bench.shared_prefill.measure import measure
    from evaluation.bench.shared_prefill.report import summarise, write_outputs
    from evaluation.tasks.ruler.offline import generate_ruler

    context_length = args.context_length or (1024 if args.quick else 2048)
    n_examples = args.n_examples or (1 if args.quick else 3)
    model, tokenizer = common.load(args.model)
    df = generate_ruler(tokenizer, context_length, n_examples, seed=0, tasks=TASKS)
    rows = measure(model, tokenizer, [r for _, r in df.iterrows()], args.presses, args.ratio)
    settings = dict(command="python -m evaluation.bench " + " ".join(sys.argv[1:]), context_length=context_length,
                    presses=args.presses, ratio=args.ratio, device=str(model.device))
    summary = summarise(rows, settings, common.machine_info())
    out = Path(args.out) / "shared_prefill" / ("quick" if args.quick else "")
    print(write_outputs(summary, out))
    return summary
