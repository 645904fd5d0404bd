"""The prose benchmark: what eviction costs on real text (docs/research/README.md).

Each window of a Paul Graham essay (``evaluation.tasks.prose.essays``: ``n`` context tokens, then ``T``
scored tokens) is prefilled once with the full cache (``evaluation.engine.Prefill``), every
configuration (press, ratio, seed) compresses that prefill, and the ``T`` continuation tokens are
scored teacher-forced on the compressed cache (``evaluation.engine.teacher_forced``) against the full
cache's logits:

- ``kl``: KL(p_full || p_press) per scored token, averaged over the T positions (nats);
- ``nll_delta``: the mean NLL of the T target tokens under the press minus under the full cache
  (nats per token; ``nll`` and ``nll_full`` are both recorded).

Records: one JSON line per (window, configuration, seed) in ``<out>/results.jsonl``, under a run
manifest (``evaluation.store.manifest``: split, context length and scored tokens are part of the identity,
so a resume with other settings is refused). Modules: ``measure`` (the run), ``tables`` (paired
differences over windows, KL ratios, win scores over essays), ``cli`` (``kvprob prose``).
"""

DATASET = "prose"
SCORED_TOKENS = 256
CONTEXTS = (1024, 2048)
