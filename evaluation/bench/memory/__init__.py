"""Peak memory of the prefill, the runner's path, kvpress's pipeline and batched decoding, each
measured in a fresh process (``python -m evaluation.bench memory``).

Every case runs in its own subprocess (``child``), which imports the same modules whatever the case,
loads the model, builds its inputs, then measures one block with ``common.PeakMemory``: on a CPU
the rise of the resident set's high-water mark over what the process held before the block (the
model, the inputs and the imports); on CUDA ``torch.cuda.max_memory_allocated`` over the tensors
allocated before. The process's own max RSS (``ru_maxrss``) is reported beside. Cases, per context
length n (one RULER example cut to exactly n tokens for the prefills):

- ``press``: ``engine.press_prefill`` under the press, i.e. kvpress's pipeline's prefill;
- ``engine``: the runner's prefill path, ``engine.Prefill(model, ids, [press])`` then ``compress``;
- ``pipeline``: ``KVPressTextGenerationPipeline`` answering one RULER example of about n tokens;
- ``runner``: ``evaluation.engine.runner.run`` on the same example (the full reference and the press, one
  seed), into a temporary store;
- ``decode``: ``engine.generate_batch`` of B compressed caches (held before the block), against the
  bound "one layer's stack" (the block's rise over the B caches).

Every row carries the full K+V size (2 L H_kv d n bytes per element) to compare with. Modules:
``child`` (one case), ``measure`` (the subprocesses), ``report`` (``memory.md``, ``memory.json``),
``cli``.
"""
