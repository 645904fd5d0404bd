"""The streaming benchmark (docs/research/README.md): eviction while decoding, scored by the NLL increase and
KL against the full cache, token by token (the perplexity protocol of StreamingLLM, H2O and TOVA).

- ``metrics``: per-token NLL and KL(full || compressed) from logits;
- ``presses``: the named presses a stream runs under (kvpress's DecodingPress baselines, ours);
- ``drive``: feeding a stream through a model in chunks under a press, as a kvpress user does;
- ``runner``: the resumable sweep over streams and presses, one record per (stream, press, seed, setting);
- ``report``: tables paired over streams;
- ``positions``: which stream positions a cache holds (the kvpress sink check);
- ``cli``: ``kvprob stream`` and ``kvprob stream-report``.
"""
