"""The speed bench's options and entry point (``python -m evaluation.bench speed``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from evaluation.engine.runner import REFERENCE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from evaluation.bench.speed.measure import PREFILL_PRESSES

    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="context lengths (default 2048 4096 8192; --quick: 2048)")
    parser.add_argument("--repeats", type=int, default=None, help="round-robin repeats, medians reported (default 3; --quick: 2)")
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio of the timed runs (default 0.5)")
    parser.add_argument("--memory-ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                        help="compression ratios of the memory table (default 0.25 0.5 0.75)")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (default 32)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before timing (default 2)")
    parser.add_argument("--presses", nargs="+", default=PREFILL_PRESSES,
                        help=f"presses whose prefill is timed ('{REFERENCE}' = no press; 'none' is read as "
                             f"'{REFERENCE}'); default {' '.join(PREFILL_PRESSES)}")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")


def main(args: argparse.Namespace) -> dict:
    import torch

    from evaluation.bench import common
    from evaluation.bench.speed.measure import run
    from evaluation.bench.speed.report import markdown_table_checks, write_outputs

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lengths = args.lengths or ([2048] if args.quick else [2048, 4096, 8192])
    repeats = args.repeats or (2 if args.quick else 3)
    presses = [REFERENCE if name == "none" else name for name in args.presses]
    for required in (REFERENCE, "snapkv", "prob_snapkv"):
        if required not in presses:
            presses.insert(0, required)
    out = Path(args.out) / "speed"
    start = time.time()
    info = common.machine_info()
    model, tokenizer = common.load(args.model)
    info["device"] = str(model.device)
    settings = {"model": args.model, "ratio": args.ratio, "lengths": lengths, "repeats": repeats,
                "decode_steps": args.decode_steps, "warmup_steps": args.warmup_steps, "threads": args.threads,
                "quick": args.quick, "memory_ratios": args.memory_ratios}

    def checkpoint(raw, progress):
        info["loadavg_end"] = common.loadavg()
        info["elapsed_s"] = time.time() - start
        write_outputs(raw, info, settings, out, f"PARTIAL ({progress}; the run was still going)")
        print(f"[speed] checkpoint written: {progress}", flush=True)

    raw = run(model, tokenizer, lengths, repeats, args.ratio, sorted(set(args.memory_ratios) | {args.ratio}),
              args.decode_steps, args.warmup_steps, presses, checkpoint=checkpoint)
    info["loadavg_end"] = common.loadavg()
    info["elapsed_s"] = time.time() - start
    summary = write_outputs(raw, info, settings, out, "complete")
    print(markdown_table_checks(summary))
    print(f"[speed] wrote {out}/speed.json, speed.md, speed.png in {info['elapsed_s']:.0f} s")
    return summary
