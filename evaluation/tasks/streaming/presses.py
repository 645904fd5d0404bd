"""The presses a stream runs under, by name: each a factory ``(schedule, seed, head_dim, dtype) -> press``
(``dtype`` the model's, that of the keys and values) at the
schedule's budget (``target_size``) and interval (``compression_interval``, counted in forwards as kvpress
counts it). Every baseline is kvpress's own ``DecodingPress`` over a ScorerPress, used through its
public constructor:

- ``knorm``, ``snapkv``, ``tova``, ``keydiff``: kvpress's scorers. SnapKV's observation window is the
  largest the buffer allows: min(64, chunk, interval - 1) queries (its scores need more buffered queries
  than the window, and its RoPE the window's positions, which are the current forward's);
- ``h2o``: accumulated attention (``kvpress_prob.decoding.scorers.H2OPress``), half the budget heavy
  hitters and half recent entries, as in the H2O paper;
- ``streaming_llm``: 4 sinks and the most recent entries in positional order (``SinkWindowPress``);
- ``kvpress_streaming_llm``: kvpress's ``StreamingLLMPress`` (4 sinks) as it runs under DecodingPress,
  which loses its sinks after the first round (docs/research/README.md); reported as found, not a baseline.

The corrected presses (``prob_*`` but ``*_nocorr``) keep one correction-bias value per entry and KV head
beside its key and value, so they run at ``equal_memory_target`` in the dtypes actually stored: the keys'
(the model's) and the bias's (float32, or the keys' with ``bias_dtype="keys"``). At head_dim 64: 254
entries for a budget of 256 and 508 for 512 in float32 (or a bfloat16 bias beside bfloat16 keys), 252 and
504 for a float32 bias beside bfloat16 keys; the bias they hold is measured on the cache and reported
(``bias_bytes``).

``BASELINES`` are the rows a press is compared with (the best of them per setting); every name here is
deterministic and runs with the first seed only.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvpress import DecodingPress, KeyDiffPress, KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress

from evaluation.tasks.streaming.drive import Schedule
from kvpress_prob.decoding.scorers import H2OPress, SinkWindowPress

N_SINK = 4


def _decoding(scorer) -> Callable[[Schedule, int, int], DecodingPress]:
    def build(schedule: Schedule, seed: int, head_dim: int, dtype: torch.dtype = torch.float32) -> DecodingPress:
        return DecodingPress(base_press=scorer(schedule), compression_interval=schedule.calls_per_interval,
                             target_size=schedule.budget, hidden_states_buffer_size=schedule.calls_per_interval)
    return build


def _snapkv(schedule: Schedule) -> SnapKVPress:
    window = min(64, schedule.chunk, schedule.interval - 1)
    if window < 1:
        raise ValueError(f"snapkv needs interval >= 2 (its window must be shorter than the buffered queries), "
                         f"got interval={schedule.interval}")
    return SnapKVPress(window_size=window)


DETERMINISTIC: dict[str, Callable[[Schedule, int, int], object]] = {
    "knorm": _decoding(lambda s: KnormPress()),
    "snapkv": _decoding(_snapkv),
    "tova": _decoding(lambda s: TOVAPress()),
    "keydiff": _decoding(lambda s: KeyDiffPress()),
    "h2o": _decoding(lambda s: H2OPress(n_recent=s.budget // 2)),
    "streaming_llm": _decoding(lambda s: SinkWindowPress(n_sink=N_SINK)),
    "kvpress_streaming_llm": _decoding(lambda s: StreamingLLMPress(n_sink=N_SINK)),
}
BASELINES = ("knorm", "snapkv", "tova", "keydiff", "h2o", "streaming_llm")


def stream_presses() -> dict[str, Callable[[Schedule, int, int], object]]:
    """Every name a stream runs under: the ones above, then the decoding presses of
    ``kvpress_prob.names.decoding.DECODING_PRESSES`` (their ``decode_*`` top-k designs and the sampled
    ``prob_decode_*`` with their ``_nocorr`` twins)."""
    from kvpress_prob.names.decoding import DECODING_PRESSES

    return dict(DETERMINISTIC) | {name: _ours(name, factory) for name, factory in DECODING_PRESSES.items()}


def _ours(name: str, factory):
    def build(schedule: Schedule, seed: int, head_dim: int, dtype: torch.dtype = torch.float32):
        press = factory(schedule.budget, schedule.calls_per_interval, seed=seed)
        if not corrects(name):
            return press
        bias = dtype if press.bias_dtype == "keys" else torch.float32  # the dtype the bias is stored in
        budget = equal_memory_target(schedule.budget, head_dim, dtype.itemsize, bias.itemsize)
        return factory(budget, schedule.calls_per_interval, seed=seed)
    return build


def corrects(name: str) -> bool:
    """Whether the press named ``name`` keeps a correction bias beside its entries (``prob_*`` but ``*_nocorr``)."""
    return name.startswith("prob_") and not name.endswith("_nocorr")


def equal_memory_target(budget: int, head_dim: int, kv_bytes: int = 4, bias_bytes: int = 4) -> int:
    """Entries per KV head a press that keeps one bias value (``bias_bytes``) per entry beside its key
    and value (2 x head_dim values of ``kv_bytes`` each) may hold in the bytes of ``budget`` entries:
    floor(budget 2d kv / (2d kv + bias)); floor(budget 2d / (2d + 1)) when both dtypes are the same."""
    entry = 2 * head_dim * kv_bytes
    return budget * entry // (entry + bias_bytes)


def samples(name: str) -> bool:
    """Whether the press named ``name`` draws at random (runs once per seed): the ``prob_*`` presses."""
    return name.startswith("prob_")
