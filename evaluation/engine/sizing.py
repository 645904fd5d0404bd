"""The decode batch sized from free device memory (``runner.run(decode_batch="auto")``).

A batch of B configurations decoded side by side (``batch.generate_batch``) holds, at its peak, the
B compressed caches still waiting (``Compressed`` items: each layer freed as ``stack`` copies it)
and the stacked cache: every item padded to the longest configuration of its layer, with room for
the question and the answer, and the per-layer bias. ``BatchSizer`` adds configurations to a batch
while

  sum of the items' bytes + the stacked cache's bytes + the largest item that can come next
  + the reserve  <=  the free memory measured when the example's batches started,

the largest next item being the full K+V with 5 % padding (it is computed, and held, before the
batch it would not fit in is decoded). The reserve is ``RESERVE`` of the free memory plus the
decoding's logits (B x vocabulary in float32). At least one configuration is always decoded; an
explicit ``decode_batch`` (an int) is used as given. ``AUTO_MAX`` caps an automatic batch (on a CPU
with a small model everything fits: the cap keeps the batch the old default's size).
"""

from __future__ import annotations

import torch

RESERVE = 0.10  # share of the free memory kept for activations and the allocator's fragmentation
AUTO_MAX = 16
PADDING = 1.05  # a sampled press stores up to ~5 % padding over its kept entries (the memory bench)


def free_bytes(device) -> int:
    """Bytes a batch may still allocate on ``device``: on CUDA the driver's free memory plus the
    blocks torch's allocator holds unused; on a CPU the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    from kvpress_prob.presses.prefill_modes import host_available

    return host_available()


def _bytes(tensor) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def item_bytes(item) -> int:
    """Bytes one waiting ``Compressed`` item holds (keys, values, bias)."""
    return sum(_bytes(k) + _bytes(v) + _bytes(b) for k, v, b in zip(item.keys, item.values, item.bias))


def stacked_bytes(items: list, room: int) -> int:
    """Bytes of ``batch.stack(items, room)``'s cache: per layer B x H_kv x (S_max + room) x d for keys
    and values, and a B x H_kv x S_max bias in the widest dtype (float32 at most: 4 bytes)."""
    total = 0
    for layer in range(len(items[0].keys)):
        k, v = items[0].keys[layer], items[0].values[layer]
        s_max = max(item.keys[layer].shape[2] for item in items)
        width = max([item.bias[layer].element_size() for item in items if item.bias[layer] is not None] + [k.element_size()])
        total += len(items) * k.shape[1] * ((s_max + room) * (k.shape[-1] + v.shape[-1]) * k.element_size() + s_max * width)
    return total


class BatchSizer:
    """Whether the next configuration joins the waiting batch (``fits``) or the batch is decoded first.

    ``full_bytes``: the example's full K+V; ``room``: question + answer tokens; ``vocab``: logits width;
    ``free``: the free memory when the example's batches start (``free_bytes``, measured by the caller);
    ``decode_batch``: an int (used as given) or "auto"."""

    def __init__(self, decode_batch, free: int, full_bytes: int, room: int, vocab: int):
        if decode_batch != "auto" and not (isinstance(decode_batch, int) and decode_batch >= 1):
            raise ValueError(f"decode_batch must be an integer >= 1 or 'auto', got {decode_batch!r}")
        self.decode_batch, self.free, self.full_bytes, self.room, self.vocab = decode_batch, free, full_bytes, room, vocab

    def projected(self, items: list) -> int:
        """Peak bytes of decoding ``items`` in one batch while the next item is computed and held."""
        return (sum(map(item_bytes, items)) + stacked_bytes(items, self.room) + int(PADDING * self.full_bytes)
                + 4 * len(items) * self.vocab)

    def fits(self, pending: list, item) -> bool:
        """Whether ``item`` joins ``pending`` (else ``pending`` is decoded first, then ``item`` waits alone)."""
        if not pending:
            return True
        if self.decode_batch != "auto":
            return len(pending) < self.decode_batch
        return len(pending) < AUTO_MAX and self.projected([*pending, item]) <= (1 - RESERVE) * self.free

    def full(self, pending: list) -> bool:
        """Whether ``pending`` is to be decoded now (an explicit size reached)."""
        return self.decode_batch != "auto" and len(pending) >= self.decode_batch
