"""Speed-up of the runner's shared prefill over the naive per-configuration pipeline loop.

For each example, side by side: (a) the kvpress pipeline run once per configuration (a prefill
each), (b) one shared prefill (``engine.Prefill``) that every configuration compresses, then the
pipeline's decoding one configuration at a time, (c) the same shared prefill with every
configuration decoded in one batch (``engine.generate_batch``, the runner's ``decode_batch``).
The figures are total time (a) / (b) and (a) / (c), with whether (b) and (c) give the pipeline's
predictions. On CUDA the clock is read after ``torch.cuda.synchronize``.

Modules: ``measure`` (the three loops), ``report`` (``shared_prefill.md``, ``.json``), ``cli``
(``python -m evaluation.bench shared-prefill``; ``--quick``: 1 example at 1024 tokens, output in
``<out>/shared_prefill/quick``).
"""
