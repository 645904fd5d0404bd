"""A ragged layer rebuilt while decoding: ``FoldedLayer``, and ``fold``, which builds it.

A decoding round reads every entry a layer holds, dense or ragged (``held.padded_view``: each head's kept entries,
then the tokens appended since, as one padded (1, H, S + t, d) copy, never held), chooses each head's kept set, and
stores exactly those entries in a ``FoldedLayer``: the appended tokens are folded into the heads' regions, where
the next round may evict them like any other entry. Within a head the kept entries stay in positional order.

The prompt: kvpress's pipeline drops an answer by cropping the cache to the length it had before the question
(``.keys[:, :, :n]`` written back). After a round, the answer's tokens that survived sit among each head's kept
entries, so the layer also counts, per head, its kept entries at positions before ``prompt_length`` (the
layer's logical length at its first decoding forward): they are each head's first ``prompt_kept[h]`` entries,
and cropping to ``prompt_length`` keeps exactly them (H more integers, no per-entry positions).
"""

from __future__ import annotations

import torch

from kvpress_prob import attention_dispatch
from kvpress_prob.cache.ragged import RaggedLayer, refuse_sliding


class FoldedLayer(RaggedLayer):
    """A ``RaggedLayer`` built by a decoding round (see the module). Its ``context_length`` is the logical
    length at the round (the prompt and every token decoded up to it); a crop keeps the tokens appended since,
    or goes back to exactly ``prompt_length``.

    Parameters
    ----------
    flat_keys, flat_values, lengths, context_length, bias
        As ``RaggedLayer``'s.
    prompt_length : int
        The logical length before the first decoding forward, <= context_length.
    prompt_kept : sequence of int
        (H,) how many of each head's kept entries sit at positions before ``prompt_length`` (its first ones).
    """

    def __init__(self, flat_keys: torch.Tensor, flat_values: torch.Tensor, lengths, context_length: int,
                 bias: torch.Tensor | None, prompt_length: int, prompt_kept):
        super().__init__(flat_keys, flat_values, lengths, context_length, bias)
        self.prompt_length = int(prompt_length)
        self.prompt_kept = tuple(int(c) for c in prompt_kept)
        if not 0 <= self.prompt_length <= self.context_length:
            raise ValueError(f"prompt_length must be in [0, context_length = {self.context_length}], "
                             f"got {prompt_length}")
        if len(self.prompt_kept) != len(self.lengths) or any(not 0 <= p <= c for p, c in
                                                            zip(self.prompt_kept, self.lengths)):
            raise ValueError(f"prompt_kept must give, per head, 0 to its kept count {self.lengths}, got {prompt_kept}")

    def crop(self, max_length: int) -> None:
        """Drop the tokens appended since the round beyond ``max_length`` logical positions (negative: that many
        from the end), or, at exactly ``prompt_length``, every entry from the first decoding forward on (each
        head keeps its first ``prompt_kept[h]`` entries). Any other length is refused: the kept entries carry
        no positions between the two."""
        if max_length < 0:
            max_length = self.get_seq_length() + max_length
        if max_length >= self.context_length:
            return super().crop(max_length)
        if max_length != self.prompt_length:
            raise ValueError(f"cannot crop this layer to {max_length} positions: a decoding round folded the "
                             f"positions {self.prompt_length} to {self.context_length} into its kept entries; crop "
                             f"to the prompt's {self.prompt_length} or to at least {self.context_length}")
        self.lengths, self.context_length, self.appended = self.prompt_kept, self.prompt_length, 0

    def __repr__(self):
        return (f"FoldedLayer(kept={self.lengths}, context={self.context_length}, appended={self.appended}, "
                f"prompt={self.prompt_length}, bias={self.bias is not None})")


def fold(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor,
         bias: torch.Tensor | None, context_length: int, prompt_length: int, prompt: torch.Tensor) -> FoldedLayer:
    """Replace ``cache.layers[layer_idx]`` by a ``FoldedLayer`` holding exactly the entries of keys, values
    (1, H, n, d) where ``keep`` (1, H, n) bool is True, in their order, with ``bias`` (1, H, n) there (None, or
    0 at every kept entry: none stored). ``prompt`` (1, H, n) bool marks the entries before ``prompt_length``;
    each head's kept ones among them must come first. ``context_length``: the logical length now."""
    refuse_sliding(cache.layers[layer_idx], layer_idx)
    k = keep[0]
    prompt_kept = (k & prompt[0]).sum(-1)
    lengths = k.sum(-1)
    if not torch.equal((k.cumsum(-1) <= prompt_kept[:, None]) & k, k & prompt[0]):  # rank among kept <= p_h
        raise ValueError("each head's kept prompt entries must come before its kept decoded entries")
    flat_bias = None
    if bias is not None:
        flat_bias = bias[0][k]
        flat_bias = flat_bias if bool((flat_bias != 0).any()) else None
    layer = FoldedLayer(keys[0][k], values[0][k], lengths.tolist(), context_length, flat_bias, prompt_length,
                        prompt_kept.tolist())
    cache.layers[layer_idx] = layer
    attention_dispatch.install()  # the one wrapper of every attention function, whose "ragged" handler reads it
    return layer


__all__ = ["FoldedLayer", "fold"]
