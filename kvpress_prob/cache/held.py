"""What a cache layer holds, read one way from a dense layer, a ``RaggedLayer`` and a ``FoldedLayer`` alike.

A dense transformers layer (``DynamicLayer`` and its kin) stores every KV head at one length, so
``layer.keys.shape[-2]`` is what each head holds, and a correction bias (b, H, S) may sit on it
(``kvpress_prob.correction.bias``: padding and SNIS log-weights). A ``RaggedLayer`` reports its logical
length there (the context plus the appended tokens, the positions new tokens take); what it holds is each
head's kept entries plus the appended tokens, and its own bias on the kept entries. Every reader outside
this package asks these functions (batch row 0 of a dense layer where it reads entries):

- ``head_entries``, ``held_counts``: per KV head, the entries and how many; ``mean_kept`` and ``widest_held``
  the two summaries callers use (the mean over heads, the widest head);
- ``held_bytes`` (one layer) and ``cache_held_bytes`` (a cache): K + V and bias, each storage counted once
  (``ragged.storage_bytes``), a dense layer's correction bias included;
- ``padded_view``: keys, values and bias of every head at one width, as a dense attention reads them;
- ``prompt_entries``: which entries of that view sit before the prompt's end (a decoding round's crop);
- ``kept_positions``: which context positions each head holds, matched against the full keys.
"""

from __future__ import annotations

import torch

from kvpress_prob.cache.folded import FoldedLayer
from kvpress_prob.cache.ragged import RaggedLayer, storage_bytes
from kvpress_prob.correction import bias as correction


def head_entries(layer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per KV head, the keys and values (c_h, d) the layer holds, in order: a ``RaggedLayer``'s kept entries then
    its appended tokens (copies), or a dense layer's row (views)."""
    if isinstance(layer, RaggedLayer):
        tail_keys, tail_values = layer.tail()  # (1, H, t, d)
        return [(torch.cat([k, tail_keys[0, h]]), torch.cat([v, tail_values[0, h]]))
                for h, (k, v, _) in enumerate(map(layer.head, range(len(layer.lengths))))]
    return [(layer.keys[0, h], layer.values[0, h]) for h in range(layer.keys.shape[1])]


def held_counts(layer) -> tuple[int, ...]:
    """Per KV head, how many entries the layer holds (kept context entries plus appended tokens)."""
    if isinstance(layer, RaggedLayer):
        return tuple(c + layer.appended for c in layer.lengths)
    return (int(layer.keys.shape[-2]),) * int(layer.keys.shape[1])


def mean_kept(layer) -> float:
    """Entries the layer holds per KV head, the mean over its heads (a dense layer: its length)."""
    counts = held_counts(layer)
    return sum(counts) / len(counts)


def widest_held(layer) -> int:
    """Entries the layer's widest KV head holds (its kept count plus the appended tokens; a dense layer: its
    length): what a dense cache of this layer would pad every head to."""
    return max(held_counts(layer))


def layer_bias(layer) -> torch.Tensor | None:
    """The bias the layer holds beside K and V, or None: a ragged layer's own (N,) over its kept entries, or the
    correction bias (b, H, S) a press left on a dense layer (``correction.bias.held_by``)."""
    if isinstance(layer, RaggedLayer):
        return layer.bias
    return correction.held_by(layer)


def held_bytes(layer) -> tuple[int, int]:
    """(bytes of the layer's K and V, bytes of its bias: 0 where it holds none), each storage counted once (a
    view counts its whole storage; a ragged layer counts its flat buffers, free slots for appended tokens
    included). An empty dense layer holds (0, 0)."""
    if isinstance(layer, RaggedLayer):
        return storage_bytes(layer.flat_keys, layer.flat_values), storage_bytes(layer.bias)
    if not getattr(layer, "is_initialized", True) or layer.keys is None:
        return 0, 0
    return storage_bytes(layer.keys, layer.values), storage_bytes(layer_bias(layer))


def cache_held_bytes(cache) -> tuple[int, int]:
    """(bytes of K and V, bytes of biases) that every layer of ``cache`` holds (``held_bytes``, summed)."""
    sizes = [held_bytes(layer) for layer in cache.layers]
    return sum(kv for kv, _ in sizes), sum(bias for _, bias in sizes)


def padded_view(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys and values (1, H, m, d) of every head at one width, and the bias over them, as a dense attention
    reads the layer (a copy for a ragged layer, read once and never held; the tensors themselves for a dense one).

    A ragged layer: each head's c_h kept entries, zeros up to S = max c_h, then the t appended tokens (m = S + t);
    its bias (1, H, m) float32 is the stored log-weight on kept entries (0 where it stores none), 0 on appended
    tokens, ``correction.padding(float32)`` on the padding (exp of it is 0 in any softmax). A dense layer: its
    keys, values (b, H, n, d) and its correction bias as stored (b, H, S), S <= n (None: plain attention)."""
    if not isinstance(layer, RaggedLayer):
        return layer.keys, layer.values, layer_bias(layer)
    keys, values, real = layer.padded()
    bias = torch.zeros(real.shape, dtype=torch.float32, device=real.device)
    if layer.bias is not None:
        for h in range(len(layer.lengths)):
            bias[0, h, : layer.lengths[h]] = layer.head(h)[2].float()
    return keys, values, bias.masked_fill(~real, correction.padding(torch.float32))


def prompt_entries(layer, real: torch.Tensor, first_decoding: int | None, length: int) -> tuple[int, torch.Tensor]:
    """(the prompt's length, (1, H, m) bool: which entries of ``padded_view(layer)`` sit before it), for a
    decoding round that must crop back to the prompt. ``real`` (1, H, m): the view's entries that are not
    padding; ``first_decoding``: the logical length at the layer's first decoding forward (None where unknown:
    a ``FoldedLayer`` needs none); ``length``: the logical length now. A ``FoldedLayer`` knows its prompt (each
    head's first ``prompt_kept[h]`` entries, before ``prompt_length``); any other layer still holds every token
    since the first decoding forward, in every head, as its last ``length - first_decoding`` entries."""
    if isinstance(layer, FoldedLayer):
        slot = torch.arange(real.shape[-1], device=real.device)
        kept = torch.tensor(layer.prompt_kept, device=real.device)[:, None]
        return layer.prompt_length, (slot < kept)[None]
    if first_decoding is None:
        raise ValueError("first_decoding is needed for a layer that was not folded by a decoding round")
    from_end = real.flip(-1).cumsum(-1).flip(-1)  # 1 on each head's last real entry
    return first_decoding, real & (from_end > length - first_decoding)


@torch.no_grad()
def kept_positions(layer, full_keys: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Which context positions each KV head of ``layer`` holds: (H, n) bool, each held key matched to the nearest
    (Euclidean, float64) of its head's ``full_keys`` (H, n, d) (or (1, H, n, d)), the full prefill's keys; and
    the largest matching distance (0 where the layer holds exact copies; a recomputed prefill's keys differ in
    their last bits). Read right after compression: an appended token would be matched to some position too."""
    full = full_keys[0] if full_keys.dim() == 4 else full_keys
    entries = head_entries(layer)
    if full.dim() != 3 or full.shape[0] != len(entries):
        raise ValueError(f"full_keys must be (H, n, d) with the layer's H = {len(entries)} heads, got "
                         f"{tuple(full_keys.shape)}")
    keep = torch.zeros(full.shape[:2], dtype=torch.bool, device=full.device)
    worst = 0.0
    for h, (keys, _) in enumerate(entries):
        if len(keys) == 0:
            continue
        distance = torch.cdist(keys.to(full.device, torch.float64), full[h].double())  # (c_h, n)
        nearest = distance.min(dim=-1)
        keep[h, nearest.indices] = True
        worst = max(worst, float(nearest.values.max()))
    return keep, worst


__all__ = ["cache_held_bytes", "head_entries", "held_bytes", "held_counts", "kept_positions", "layer_bias",
           "mean_kept", "padded_view", "prompt_entries", "widest_held"]
