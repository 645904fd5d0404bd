"""Speed and memory of probabilistic eviction vs kvpress top-k and the full cache.

For each context length (a RULER context cut to exactly that many tokens), ``repeats`` rounds; in
each round every press is run once, in the same order (round-robin, so that slow drift or other
load on the machine hits every press alike), and the median over rounds is reported:

- prefill: wall time of ``engine.press_prefill`` (``with press(model): model.model(...)``, the
  kvpress pipeline's prefill), eviction included (a SamplingPress evicts when the decoder ends);
- decode: ``decode_steps`` single-token steps after ``warmup_steps`` untimed ones, the variants
  interleaved step by step (each variant's correction bias is put back on the attention modules
  before its step), on (a) the corrected prob_snapkv cache, (b) the same kept set uncorrected
  (prob_snapkv_nocorr, same seed: bias 0, still the corrected code path), (c) the same padded
  cache with the bias removed, i.e. plain sdpa (timing only: padding is attended, the output is
  meaningless), (d) kvpress snapkv's cache of (1 - r) n entries (plain sdpa), (e) the full cache;
- memory: bytes of keys + values held in the cache (sum of numel * element_size over layers),
  for the full cache, kvpress snapkv and prob_snapkv (kept entries, stored = padded, bias
  metadata), at r = ``ratio`` and at the ``memory_ratios``;
- peak memory of the prefill (``common.PeakMemory``: the process's resident set on a CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA), above what the process held before, for the full
  cache, snapkv, prob_snapkv and prob_min_h, both under the press (``press_prefill``) and on the
  runner's path (``engine.Prefill`` told the press, computing its proposal or scores inside the
  prefill's hooks, then ``compress``). ``python -m evaluation.bench memory`` measures the same in a
  fresh process per case, with kvpress's pipeline and the runner beside.

On CUDA every timing synchronises the device and records ``torch.cuda.max_memory_allocated``.
The SamplingPress seed is the round index, so the realised ratios average over draws.

Modules: ``measure`` (the runs), ``report`` (summary, ``speed.md``, ``speed.json``, ``speed.png``),
``cli`` (``python -m evaluation.bench speed``).
"""
