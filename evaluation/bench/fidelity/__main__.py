"""``python -m evaluation.bench.fidelity ...`` = ``python -m evaluation.bench fidelity ...``."""

import sys

from evaluation.bench.__main__ import main

sys.exit(main(["fidelity", *sys.argv[1:]]))
