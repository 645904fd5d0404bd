"""The memory bench's options and entry point (``python -m evaluation.bench memory``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_PRESSES = ["full", "snapkv", "prob_snapkv", "prob_min_h"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="context lengths (default 2048 4096 8192; --quick: 1024)")
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio (default 0.5)")
    parser.add_argument("--presses", nargs="*", default=DEFAULT_PRESSES,
                        help=f"registry presses whose prefill peak is measured, under the press and on the runner's path "
                             f"('full' = no press); default {' '.join(DEFAULT_PRESSES)}")
    parser.add_argument("--paths", nargs="+", default=["press", "engine"], choices=["press", "engine"],
                        help="prefill paths measured for --presses: under the press, and the runner's engine (default both)")
    parser.add_argument("--pipeline-presses", nargs="*", default=["full", "prob_min_h"],
                        help="presses run through kvpress's pipeline on one RULER example (default: full prob_min_h)")
    parser.add_argument("--runner-presses", nargs="*", default=["prob_min_h"],
                        help="presses run through the runner on the same example, with the full reference (default: prob_min_h)")
    parser.add_argument("--decode-batch", type=int, default=2, help="the runner's --decode-batch (default 2)")
    parser.add_argument("--batch", type=int, default=4, help="B of the batched-decoding case (0: skip it; default 4)")
    parser.add_argument("--decode-press", default="prob_min_h", help="the press of the B decoded caches (seeds 0..B-1)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="prefill cases: time the block this many more times in the same process, without the "
                             "memory sampler beside it (the reported time is the fastest; default 0: the measured run)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each case (default: torch's)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite memory.md from the memory.json of these --lengths (after a change of the report)")


def main(args: argparse.Namespace) -> object:
    from evaluation.bench import common
    from evaluation.bench.memory.measure import cases, run_case
    from evaluation.bench.memory.report import write_outputs

    lengths = args.lengths or ([1024] if args.quick else [2048, 4096, 8192])
    settings = {"command": "python -m evaluation.bench " + " ".join(sys.argv[1:]), "model": args.model,
                "ratio": args.ratio, "lengths": lengths, "threads": args.threads,
                "repeats": args.repeats}
    info = common.machine_info()
    out = Path(args.out) / "memory" / "-".join(map(str, lengths))
    if args.report_only:
        import json

        saved = json.loads((out / "memory.json").read_text())
        return write_outputs(saved["rows"], saved["settings"], saved["machine"], out, saved["status"])
    rows, todo = [], cases(lengths, args.presses, args.paths, args.ratio, args.pipeline_presses, args.runner_presses,
                           args.decode_press, args.batch, args.decode_batch, args.repeats)
    start = time.time()
    for i, spec in enumerate(todo):
        rows.append(run_case(spec, args.model, args.threads))
        info["elapsed_s"], info["loadavg_end"] = time.time() - start, common.loadavg()
        write_outputs(rows, settings, info, out, "complete" if i == len(todo) - 1 else f"PARTIAL ({i + 1}/{len(todo)} cases)")
    check = write_outputs(rows, settings, info, out, "complete")
    print(common.markdown_table(check.set_index("target"), float_format="{:.3f}") if len(check) else "no checks")
    return check
