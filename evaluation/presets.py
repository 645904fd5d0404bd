"""Named sweeps for ``kvprob reproduce --preset NAME`` (and ``make demo``).

The demo's presses are ``DEMO_PRESSES``: change them there, nowhere else.
"""

from __future__ import annotations

from kvpress_prob.names.registry import RECOMMENDED, RECOMMENDED_PROSE, RECOMMENDED_RETRIEVAL

PAPER_METHODS = ["streaming_llm", "snapkv", "tova", "h2o", "knorm", "prob_min", "prob_min_h", "prob_h2o", "prob_h2o_h"]
PAPER_RATIOS = [0.1, 0.25, 0.5, 0.75, 0.9]

# make demo = the cpu-quick preset: these presses at these ratios, one example of each of DEMO_TASKS (the RULER
# tasks where the full cache finds something and the presses differ):
# the press recommended for retrieval next to the best top-k presses of RULER's development split
# (kvpress's KeyDiff, and top-k over blocks of KeyDiff's scores, the recommended press's deterministic twin).
DEMO_PRESSES = list(dict.fromkeys(["keydiff", "topk_keydiff_block8", RECOMMENDED_RETRIEVAL, RECOMMENDED]))  # a pick named twice runs once
DEMO_RATIOS = [0.5, 0.75]
DEMO_TASKS = ["niah_single_3", "niah_multivalue", "niah_multiquery", "fwe"]

PRESETS = {
    "paper-ruler": dict(dataset="ruler", context_length=4096, n_examples=130, presses=PAPER_METHODS,
                        ratios=PAPER_RATIOS, seeds=[0, 1, 2]),
    "paper-longbench": dict(dataset="longbench", context_length=3000, n_examples=None, presses=PAPER_METHODS,
                            ratios=PAPER_RATIOS, seeds=[0, 1, 2]),
    "cpu-quick": dict(dataset="ruler", context_length=1024, n_examples=len(DEMO_TASKS), tasks=DEMO_TASKS,
                      presses=DEMO_PRESSES, ratios=DEMO_RATIOS, seeds=[0, 1, 2]),
}

# make demo's prose part (``kvprob prose run``): the first window of one development essay, prefill n = 1024,
# the next 256 tokens teacher-forced; the best kvpress top-k press of the prose development split (h2o) next to
# the three recommendations (RECOMMENDED by maximin over three regimes, and the retrieval and prose picks).
PROSE_DEMO = dict(split="dev", context=1024, max_windows=1, max_per_essay=1,
                  presses=list(dict.fromkeys(["h2o", RECOMMENDED_RETRIEVAL, RECOMMENDED_PROSE, RECOMMENDED])), ratios=[0.5, 0.75],
                  seeds=[0, 1, 2])

# Where each preset writes by default, and the committed runs ``make demo`` compares itself with.
DEMO_OUT = "results/demo"
DEMO_REFERENCE = "results/cpu-quick"
PROSE_DEMO_REFERENCE = "results/prose-quick"


def default_out(preset: str, context_length: int) -> str:
    """``results/<preset>``, with the context length appended for paper-ruler (it is run at several)."""
    return f"results/{preset}" + (f"-{context_length}" if preset == "paper-ruler" else "")
