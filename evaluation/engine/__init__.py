"""The one engine for prefill, compress and decode, used by the runner and every benchmark.

- ``prefill``: planning and the shared prefill (``Plan``, ``plan``, ``Prefill``, ``ReplayedScores``,
  ``hooked_prefill``, ``press_prefill``) and what a compressed cache holds (``cache_summary``, ``bias_bytes``);
- ``batch``: the batched cache and decoding (``Compressed``, ``RoomyLayer``, ``stack``, ``generate_batch``);
- ``forced``: teacher forcing (``teacher_forced``);
- ``sizing``: the decode batch sized from the free device memory (``BatchSizer``, ``free_bytes``).
"""

from evaluation.engine.batch import Compressed, RoomyLayer, generate_batch, stack
from evaluation.engine.forced import teacher_forced
from evaluation.engine.prefill import (Plan, Prefill, ReplayedScores, bias_bytes, cache_summary, hooked_prefill,
                                       plan, press_prefill)

__all__ = ["Compressed", "Plan", "Prefill", "ReplayedScores", "RoomyLayer", "bias_bytes", "cache_summary", "generate_batch",
           "hooked_prefill", "plan", "press_prefill", "stack", "teacher_forced"]
