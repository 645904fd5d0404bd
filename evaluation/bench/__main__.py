"""CLI: ``python -m evaluation.bench {speed,memory,budget,oracle,fidelity,bytes,shared-prefill,decode-speed,price} [--quick] ...``.

Every bench package takes ``--quick``, ``--out`` (the output root; a bench writes into its own
folder below it) and ``--model``, and its own options (``python -m evaluation.bench <name> --help``).
``decode-speed`` (``evaluation/bench/speed/decoding.py``: throughput and cache bytes of compression while
decoding) and ``price`` (``evaluation/bench/speed/price.py``: each press's prefill time, prefill peak and decode
step over snapkv's, the tables' price columns) parse their own options.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# CLI name -> (package under evaluation.bench, output folder, help)
COMMANDS = {
    "speed": ("speed", "speed", "prefill / decode speed, cache memory and prefill peak memory: prob presses vs "
                                "kvpress top-k vs the full cache"),
    "budget": ("allocation", "budget", "where the budget goes: kept fraction per layer and head, realised vs target "
                                       "ratio, padding, scopes"),
    "oracle": ("oracle", "oracle", "exact (brute-force) eviction on small synthetic instances vs top-k and sampling +- SNIS"),
    "fidelity": ("fidelity", "fidelity", "KL to the full cache (teacher-forced) and layer-wise attention error"),
    "memory": ("memory", "memory", "peak memory, each case in a fresh process: prefill under a press, the runner's "
                                   "path, kvpress's pipeline, batched decoding, against the K+V size"),
    "bytes": ("bytes", "bytes", "bytes held on the cache (keys, values, bias) by each press on the contexts of "
                                "committed records, in fp32 and bf16"),
    "shared-prefill": ("shared_prefill", "shared_prefill", "the runner's shared prefill and batched decoding vs the "
                                                           "naive kvpress pipeline loop"),
}
QUICK_INTO_SUBFOLDER = {"fidelity", "shared-prefill"}  # their --quick output goes to <out>/<folder>/quick
# CLI name -> module with its own ``main(argv)`` and parser (``python -m evaluation.bench <name> --help``)
OWN_PARSERS = {"decode-speed": "evaluation.bench.speed.decoding", "price": "evaluation.bench.speed.price"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m evaluation.bench",
        description="kvpress-prob benchmarks. Each writes JSON, Markdown and PNG under <out>/<folder>/.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join([*COMMANDS, *OWN_PARSERS]) + "}")
    for name, (package, folder, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        quick_out = f"<out>/{folder}/quick" if name in QUICK_INTO_SUBFOLDER else f"<out>/{folder}"
        p.add_argument("--quick", action="store_true",
                       help=f"small settings that finish in minutes on 2 CPU cores (output in {quick_out})")
        p.add_argument("--out", default="results/bench", help=f"output root; files go to <out>/{folder}/")
        p.add_argument("--model", default=None,
                       help="Hugging Face id or local path (None: the embedded SmolLM2-135M-Instruct)"
                       + ("; unused by oracle, whose instances are synthetic" if name == "oracle" else ""))
        importlib.import_module(f"evaluation.bench.{package}.cli").add_arguments(p)
    for name in OWN_PARSERS:
        sub.add_parser(name, help=f"see python -m evaluation.bench {name} --help", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in OWN_PARSERS:
        importlib.import_module(OWN_PARSERS[argv[0]]).main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    package = COMMANDS[args.command][0]
    importlib.import_module(f"evaluation.bench.{package}.cli").main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
