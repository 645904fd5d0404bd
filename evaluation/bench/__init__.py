"""Benchmarks of kvpress-prob: ``python -m evaluation.bench {speed,budget,oracle,fidelity,memory,shared-prefill,decode-speed}``.

- ``speed``: prefill time, decode tokens/s, cache bytes and prefill peak memory of probabilistic
  eviction vs kvpress top-k;
- ``budget`` (package ``allocation``): realised kept fractions per layer and head, realised vs
  target ratio, padding, scopes;
- ``oracle``: exact (brute-force) eviction on small synthetic instances vs top-k and sampling;
- ``fidelity``: end-to-end KL to the full cache and layer-wise attention error;
- ``shared-prefill``: the runner's shared prefill and batched decoding vs the naive pipeline loop;
- ``memory``: peak memory, each case in a fresh process;
- ``decode-speed`` (``speed/decoding.py``, its own parser): throughput and cache bytes while decoding.

Each bench is a package: ``measure`` (the runs, through ``evaluation.engine`` where a model is
involved), ``report`` (tables, Markdown, JSON, plots) and ``cli`` (``add_arguments(parser)`` and
``main(args)``). Each writes under ``<out>/<folder>/`` (default ``results/bench``).
"""
