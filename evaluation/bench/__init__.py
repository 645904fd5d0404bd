"""Benchmarks of kvpress-prob: ``python -m evaluation.bench {speed,budget,oracle}``.

- ``speed``: prefill time, decode tokens/s and cache bytes of probabilistic eviction vs kvpress top-k;
- ``budget``: realised kept fractions per layer and head, realised vs target ratio, padding, scopes;
- ``oracle``: exact (brute-force) eviction on small synthetic instances vs top-k and sampling.

``fidelity`` (end-to-end KL and layer-wise attention error) is a separate module with its own CLI:
``python -m evaluation.bench.fidelity``.

Each of speed / budget / oracle writes JSON, a Markdown table and PNG plot(s) under ``<out>/<name>/`` (default ``results/bench``).
"""
