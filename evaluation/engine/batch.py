"""Decode batched (``generate_batch``): greedy decoding of a small model on a CPU reads every weight
once per token, whatever the batch, so B configurations of one example decode side by side. Their
caches are stacked along the batch axis layer by layer, each item's layer freed once copied (the
peak is the B caches plus one layer's stack), each layer padded to the longest configuration, and
decoded through the correction's biased attention: bias 0 on a top-k cache, the SNIS log-weights on
a sampled one, the dtype's lowest value on padding (exp of it is exactly 0). The arithmetic is the
same up to float rounding, so a greedy near-tie can flip; kvpress's ``generate_answer`` is the
one-at-a-time reference. Presses that mask instead of evicting (AdaKV) decode in the batch with
the lowest bias on their masked entries; a ragged cache (``kvpress_prob.cache``) is padded to each layer's
longest head the same way (``cache.padded_view``), so its kept entries decode as its own route decodes them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from evaluation.engine.prefill import drop_masks
from kvpress_prob.cache import padded_view
from kvpress_prob.correction import bias as correction
from kvpress_prob.presses.sampling import language_model


@dataclass
class Compressed:
    """One configuration's compressed cache, detached from the model: per layer (1, H_kv, S_l, d)
    keys and values and the (1, H_kv, S_l) correction bias (None: plain attention)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    bias: list[torch.Tensor | None]

    @classmethod
    def take(cls, cache: DynamicCache, layers) -> Compressed:
        """Detach ``cache`` and the modules' correction bias. A press that masks keys instead of
        evicting them (kvpress's AdaKV: ``masked_key_indices``, whose fake keys give those entries
        an attention weight of exactly 0) becomes the dtype's lowest bias on the masked entries,
        and its masks are removed from the modules."""
        keys_, values_, biases = [], [], []
        for layer, cache_layer in zip(layers, cache.layers):
            keys, values, bias = padded_view(cache_layer)  # a ragged layer padded to its longest head
            masked = getattr(layer.self_attn, "masked_key_indices", None)
            drop_masks(layer.self_attn)
            if masked is not None:
                bias = torch.zeros(keys.shape[:3], dtype=keys.dtype, device=keys.device)
                bias[masked[0], masked[1], masked[2]] = correction.padding(keys.dtype)
            keys_.append(keys), values_.append(values), biases.append(bias)
        return cls(keys_, values_, biases)


class RoomyLayer(DynamicLayer):
    """A DynamicLayer that writes new tokens into preallocated room instead of concatenating:
    DynamicLayer copies the whole cache at every decoding step, which dominates a batched decode.
    ``keys`` / ``values`` (B, H_kv, S + room, d) buffers whose first ``length`` entries are filled."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self._keys, self._values = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, cache_kwargs=None):
        s, q = self.keys.shape[2], key_states.shape[2]
        if s + q > self._keys.shape[2]:
            raise RuntimeError(f"RoomyLayer holds {self._keys.shape[2]} entries, {s + q} requested")
        self._keys[:, :, s : s + q], self._values[:, :, s : s + q] = key_states, value_states
        self.keys, self.values = self._keys[:, :, : s + q], self._values[:, :, : s + q]
        return self.keys, self.values

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows."""
        s, rows = self.keys.shape[2], rows.to(self._keys.device)
        self._keys, self._values = self._keys[rows], self._values[rows]
        self.keys, self.values = self._keys[:, :, :s], self._values[:, :, :s]


def stack(items: list[Compressed], room: int) -> tuple[DynamicCache, list[torch.Tensor]]:
    """One batched cache of B configurations, with room for ``room`` new tokens, and its
    per-layer (B, H_kv, S_max) bias (each layer padded to its longest configuration, the padding
    ``correction.padding``). A layer's bias has the widest dtype of its items' biases and keys (a
    press's float32 bias stays float32 beside bfloat16 keys). Consumes ``items``: each item's layer
    is released as soon as it is copied, layer by layer, so memory peaks at the B caches plus one
    layer's stack (the items' tensors are freed if nothing else holds them)."""
    cache, biases = DynamicCache(), []
    for layer in range(len(items[0].keys)):
        first = items[0].keys[layer]
        s_max = max(item.keys[layer].shape[2] for item in items)
        b, h = len(items), first.shape[1]
        keys = first.new_empty(b, h, s_max + room, first.shape[-1])  # (B, H_kv, S_max + room, d)
        values = first.new_empty(b, h, s_max + room, items[0].values[layer].shape[-1])
        dtype = functools.reduce(torch.promote_types, [item.bias[layer].dtype for item in items
                                                       if item.bias[layer] is not None], first.dtype)
        bias = torch.full((b, h, s_max), correction.padding(dtype), dtype=dtype, device=first.device)
        for i, item in enumerate(items):
            k, v, item_bias = item.keys[layer], item.values[layer], item.bias[layer]
            s = k.shape[2]
            keys[i, :, :s], values[i, :, :s] = k[0], v[0]
            keys[i, :, s:s_max], values[i, :, s:s_max] = 0, 0
            bias[i, :, :s] = 0 if item_bias is None else correction.cast(item_bias[0], dtype)
            item.keys[layer] = item.values[layer] = item.bias[layer] = None
        cache.layers.append(RoomyLayer(keys, values, s_max))
        biases.append(bias)
    return cache, biases


@torch.no_grad()
def generate_batch(model, tokenizer, question_ids: torch.Tensor, items: list[Compressed], context_length: int,
                   max_new_tokens: int) -> list[str]:
    """kvpress's ``generate_answer`` for B compressed caches at once (``items`` are consumed by
    ``stack``; greedy, same stopping rule:
    the first token is never checked, a later stop token ends that row and is kept, then skipped
    by ``skip_special_tokens``). Finished rows leave the batch once a quarter of it is done, so
    one long answer does not keep every short one decoding."""
    layers = language_model(model).layers
    cache, biases = stack(items, room=question_ids.shape[1] + max_new_tokens)
    b, device = len(items), question_ids.device
    stop = model.generation_config.eos_token_id
    stop_ids = set(stop if isinstance(stop, list) else [stop])
    stop = torch.tensor(sorted(stop_ids), device=device)
    rows: list[list[int]] = [[] for _ in range(b)]
    active = torch.arange(b, device=device)  # which of the B rows are still in the batch
    try:
        for layer, bias in zip(layers, biases):
            correction.set_bias(layer.self_attn, bias, cache)
            drop_masks(layer.self_attn)  # masks of another cache: this one's are in its bias
        q_len = question_ids.shape[1]
        position_ids = torch.arange(context_length, context_length + q_len, device=device)
        logits = model(input_ids=question_ids.expand(b, q_len), past_key_values=cache,
                       position_ids=position_ids.expand(b, q_len), logits_to_keep=1).logits
        new = logits[:, -1].argmax(-1)  # (B_active,)
        position = context_length + q_len
        for i in range(max_new_tokens):
            for row, token in zip(active.tolist(), new.tolist()):
                rows[row].append(token)
            if i == max_new_tokens - 1:
                break
            done = torch.isin(new, stop) if i > 0 else torch.zeros_like(new, dtype=torch.bool)
            if done.all():
                break
            if int(done.sum()) >= max(1, len(active) // 4):  # drop finished rows
                keep = (~done).nonzero().squeeze(1)
                for layer, cache_layer in zip(layers, cache.layers):
                    cache_layer.select(keep)
                    bias = correction.bias_of(layer.self_attn, cache)
                    correction.set_bias(layer.self_attn, bias[keep.to(bias.device)], cache)
                active, new = active[keep], new[keep]
            position_ids = torch.full((len(active), 1), position + i, device=device)
            logits = model(input_ids=new[:, None], past_key_values=cache, position_ids=position_ids).logits
            new = logits[:, -1].argmax(-1)
    finally:
        for layer in layers:
            correction.reset(layer.self_attn)
    answers = []
    for row in rows:
        end = next((t + 1 for t in range(1, len(row)) if row[t] in stop_ids), len(row))
        answers.append(str(tokenizer.decode(row[:end], skip_special_tokens=True)))
    return answers
