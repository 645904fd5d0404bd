"""What a cache layer holds, per KV head, for a dense layer and a ``RaggedLayer`` alike.

A dense transformers layer stores every KV head at one length, so ``layer.keys.shape[-2]`` is what each head
holds. A ``RaggedLayer`` reports its logical length there (the context plus the appended tokens, the positions
new tokens take); what it holds is each head's kept entries plus the appended tokens. These two functions read
either layer (batch row 0).
"""

from __future__ import annotations

import torch

from kvpress_prob.cache.ragged import RaggedLayer


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
