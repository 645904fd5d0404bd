"""The fidelity bench's options and entry point (``python -m evaluation.bench fidelity``).

Usage::

    python -m evaluation.bench fidelity --quick           # 3 examples at 1024 tokens -> results/bench/fidelity/quick
    python -m evaluation.bench fidelity                   # 6 examples at 2048 tokens -> results/bench/fidelity
    python -m evaluation.bench fidelity --sweep           # + temperature / ratio sweep (bias^2 vs variance)
    python -m evaluation.bench fidelity --report-only     # rebuild the report from records.jsonl
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from evaluation.bench.fidelity import DEFAULT_PRESSES
from evaluation.bench.fidelity.measure import DEFAULT_TASKS, SWEEP_PRESSES, SWEEP_RATIOS, SWEEP_TEMPERATURES

logger = logging.getLogger("evaluation.bench.fidelity")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options besides --quick (3 examples at 1024 tokens, output in <out>/fidelity/quick),
    --out and --model, which every bench shares."""
    p.add_argument("--presses", nargs="+", default=list(DEFAULT_PRESSES), help="registry presses (default: %(default)s)")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5], help="compression ratios (default: %(default)s)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="seeds of the sampling methods; deterministic ones run the first only (default: %(default)s)")
    p.add_argument("--n-examples", type=int, default=None, help="default 6 (3 with --quick)")
    p.add_argument("--context-length", type=int, default=None, help="default 2048 (1024 with --quick)")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help="RULER tasks (default: %(default)s)")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the RULER examples (default: %(default)s)")
    p.add_argument("--no-layerwise", dest="layerwise", action="store_false",
                   help="skip the per-layer attention outputs (KL only)")
    p.add_argument("--sweep", action="store_true",
                   help="also run the temperature / ratio sweep of --sweep-presses (bias² vs variance)")
    p.add_argument("--sweep-presses", nargs="+", default=list(SWEEP_PRESSES), help="(default: %(default)s)")
    p.add_argument("--sweep-ratios", nargs="+", type=float, default=list(SWEEP_RATIOS), help="(default: %(default)s)")
    p.add_argument("--temperatures", nargs="+", type=float, default=list(SWEEP_TEMPERATURES),
                   help="temperatures T of the sweep, 'inf' = no correction (default: %(default)s)")
    p.add_argument("--scopes", nargs="+", default=[], choices=["global", "layer", "head"],
                   help="also run every sampling press under these budget scopes (scope table vs kvpress top-k)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new example after this many minutes (rerun to resume)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, 0 = torch's default (default: %(default)s)")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from records.jsonl")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the --quick dependent defaults; ``args.out`` becomes the bench's own folder."""
    if args.n_examples is None:
        args.n_examples = 3 if args.quick else 6
    if args.context_length is None:
        args.context_length = 1024 if args.quick else 2048
    args.out = Path(args.out) / "fidelity" / ("quick" if args.quick else "")
    return args


def main(args: argparse.Namespace) -> dict:
    from evaluation.bench.fidelity.measure import run
    from evaluation.bench.fidelity.report import write_report

    args = resolve(args)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logger.setLevel(logging.INFO)
    if not args.report_only:
        run(args, on_example=write_report)
    elif not (args.out / "records.jsonl").exists():
        raise FileNotFoundError(f"--report-only: no records to report, {args.out / 'records.jsonl'} does not exist")
    paths = write_report(args.out)
    if "report_md" in paths:
        print(Path(paths["report_md"]).read_text())
        print("written:", ", ".join(str(p) for p in paths.values()))
    return paths
