"""``kvprob gpu-check`` (``run.main``): the GPU path checked in one command, offline, on random
weights of the paper's shapes (``models``, ``configs/``); ``--dry-run`` on a CPU. docs/gpu-and-memory.md."""
