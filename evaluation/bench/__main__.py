"""CLI: ``python -m evaluation.bench {speed,budget,oracle,fidelity,shared-prefill} [--quick] ...``.

fidelity and shared-prefill parse their own options (``python -m evaluation.bench fidelity --help``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "speed": "prefill / decode speed and cache memory: prob presses vs kvpress top-k vs the full cache",
    "budget": "realised budget: kept fraction per layer and head, realised vs target ratio, padding, scopes",
    "oracle": "exact (brute-force) eviction on small synthetic instances vs top-k and sampling +- SNIS",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m evaluation.bench",
        description="kvpress-prob benchmarks. Each writes JSON, Markdown and PNG under <out>/<command>/.",
    )
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join([*COMMANDS, *OWN_PARSERS]) + "}")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--quick", action="store_true", help="small settings that finish in a few minutes on 2 CPU cores")
        p.add_argument("--out", default="results/bench", help="output root; files go to <out>/<command>/ (default results/bench)")
        p.add_argument("--model", default=None,
                       help="Hugging Face id or local path (default: the embedded SmolLM2-135M-Instruct)"
                       + ("; unused by oracle, whose instances are synthetic" if name == "oracle" else ""))
        importlib.import_module(f"evaluation.bench.{name}").add_arguments(p)
    for name in OWN_PARSERS:
        sub.add_parser(name, help=f"see python -m evaluation.bench {name} --help", add_help=False)
    return parser


OWN_PARSERS = {"fidelity": "evaluation.bench.fidelity", "shared-prefill": "evaluation.bench.shared_prefill",
               "decompose": "evaluation.bench.decompose"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in OWN_PARSERS:
        importlib.import_module(OWN_PARSERS[argv[0]]).main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"evaluation.bench.{args.command}")
    module.main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
