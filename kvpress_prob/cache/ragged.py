"""A cache layer whose KV heads each hold their own count of entries, and the eviction that builds it.

transformers stores all heads of a layer at one length, so a press whose heads keep different counts
either masks (frees nothing), pads to the neediest head, or flattens every head to one width.
``RaggedLayer`` stores exactly the kept entries in one flat buffer per layer, as AdaKV's code does (Feng et
al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation", 2024):

- ``flat_keys``, ``flat_values`` (M, d): one region per KV head, head-major: head h's c_h kept entries in
  prefix order, then the t tokens appended after compression (a question, decoded tokens), then free slots;
  ``starts[h]``, ``lengths[h] = c_h`` and ``capacity[h]`` (Python ints, 3 H of them) place the regions;
- ``bias`` (M,) or None: the log-weight of each kept entry added to its attention logit (the SNIS correction
  of a sampled press), 0 on appended tokens; None for weight 1 everywhere.

Right after ``evict_ragged`` the regions hold no free slot: the layer holds exactly the kept entries' K and V
(and bias). Appending grows every region at once (one copy of the layer, the slots then doubling the tail),
so a decoding step writes its token in place and copies nothing of the layer's size (a ``DynamicLayer``
concatenates its whole K and V at every step). Head h's attention reads one contiguous view,
``flat_keys[starts[h] : starts[h] + c_h + t]``.

Two readers, two lengths. ``get_seq_length()`` is the logical length n + t (n the context's length before
eviction): ``model.generate`` and the models' forwards take new tokens' positions from it, so they keep
the context's real positions. ``.keys`` and ``.values`` are a ``LogicalView`` of that same logical length,
not a tensor: kvpress's pipeline slices ``.keys[:, :, :get_seq_length()]`` and writes the slice back to drop
each answer, and that prefix write crops the appended tokens (never into the context). Any other use of the
view raises; ``head``, ``tail`` and ``padded`` read the entries.

``update()`` appends and returns ``RaggedKeys`` placeholders of the logical shape (1, H, n + t, d) (no
memory: one element, expanded) carrying the layer's ``RaggedContext``: only the ragged attention route
(``kvpress_prob.cache.ragged_attention``, a handler of ``kvpress_prob.attention_dispatch``'s one wrapper of
``ALL_ATTENTION_FUNCTIONS``, installed when a layer is built) reads them, so an attention function that does not
know the layout (eager attention) raises instead of attending to the wrong entries. Batch size 1; beam search,
cropping into the context, offloading and batch reshaping are refused with an error naming the operation, and so is
a sliding-window layer (``refuse_sliding``).
"""

from __future__ import annotations

import torch
from transformers import QuantizedCache
from transformers.cache_utils import CacheLayerMixin

from kvpress_prob import attention_dispatch
from kvpress_prob.cache import ragged_attention  # noqa: F401  registers the "ragged" handler that reads the layer
from kvpress_prob.cache.layout import RaggedContext, RaggedKeys

MIN_SLOTS = 32  # free slots per head given at the first append (then the tail's length, doubling)


class LogicalView:
    """``.keys`` / ``.values`` of a ``RaggedLayer``: its logical (1, H, n + t, d) sequence, not a tensor.

    ``view[:, :, :m]`` (or ``view[..., :m, :]``) with m >= n is the prefix a writer may assign back to crop the
    appended tokens to m - n (kvpress's pipeline drops each answer so). Its ``shape``, ``dtype`` and ``device``
    can be read; anything else raises: read the entries through ``RaggedLayer.head``, ``tail`` or ``padded``."""

    def __init__(self, layer: RaggedLayer, which: str, length: int):
        self._layer, self._which, self._length = layer, which, length

    @property
    def shape(self) -> torch.Size:
        return torch.Size((1, len(self._layer.lengths), self._length, self._layer.flat_keys.shape[-1]))

    @property
    def dtype(self) -> torch.dtype:
        return self._layer.flat_keys.dtype

    @property
    def device(self) -> torch.device:
        return self._layer.flat_keys.device

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 4

    def __getitem__(self, index) -> LogicalView:
        cut = _prefix_cut(index)
        if cut is None:
            raise IndexError(f"a RaggedLayer's .{self._which} accepts only a prefix slice along the sequence, "
                             f"[:, :, :m] or [..., :m, :], got {index!r}")
        stop = self._length if cut.stop is None else cut.stop if cut.stop >= 0 else self._length + cut.stop
        return LogicalView(self._layer, self._which, max(0, min(self._length, stop)))

    def __getattr__(self, name):
        raise AttributeError(
            f"{name!r}: .{self._which} of a RaggedLayer is its logical sequence (n context + t appended positions), "
            f"not a tensor: each KV head holds its own entries. Slice a prefix [:, :, :m] to crop the appended "
            f"tokens, or read the entries with layer.head(h), layer.tail() or layer.padded()")

    def __repr__(self):
        return f"LogicalView({self._which}, shape={tuple(self.shape)})"


def _prefix_cut(index) -> slice | None:
    """The slice along the sequence axis of ``[:, :, s]``, ``[:, :, s, :]`` or ``[..., s, :]`` when the other
    parts are full slices and ``s`` starts at 0 with step 1; else None."""
    full = slice(None)
    if not isinstance(index, tuple):
        return None
    if len(index) == 3 and index[0] is Ellipsis and index[2] == full:
        cut = index[1]
    elif len(index) in (3, 4) and index[0] == full and index[1] == full and (len(index) == 3 or index[3] == full):
        cut = index[2]
    else:
        return None
    if not isinstance(cut, slice) or cut.start not in (None, 0) or cut.step not in (None, 1):
        return None
    return cut


class RaggedLayer(CacheLayerMixin):
    """One layer of a cache whose KV heads each hold their own kept entries (see the module).

    Parameters
    ----------
    flat_keys, flat_values : torch.Tensor
        (N, d): every head's kept entries, head-major, in prefix order within a head.
    lengths : sequence of int
        (H,) kept count per KV head; they sum to N.
    context_length : int
        n, the context's length before eviction (the logical length of the compressed context).
    bias : torch.Tensor or None
        (N,) log-weight of each kept entry, added to its attention logit; None for weight 1.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, flat_keys: torch.Tensor, flat_values: torch.Tensor, lengths, context_length: int,
                 bias: torch.Tensor | None = None):
        lengths = tuple(int(c) for c in lengths)
        if flat_keys.dim() != 2 or flat_keys.shape != flat_values.shape:
            raise ValueError(f"flat_keys and flat_values must both be (N, d), got {tuple(flat_keys.shape)} and "
                             f"{tuple(flat_values.shape)}")
        if not lengths or any(c < 0 for c in lengths) or sum(lengths) != flat_keys.shape[0]:
            raise ValueError(f"lengths must be >= 0, one per head, and sum to the {flat_keys.shape[0]} flat "
                             f"entries, got {lengths}")
        if max(lengths) > context_length:
            raise ValueError(f"context_length {context_length} is below a head's kept count {max(lengths)}")
        if bias is not None and bias.shape != (flat_keys.shape[0],):
            raise ValueError(f"bias must be (N,) = ({flat_keys.shape[0]},), got {tuple(bias.shape)}")
        self.flat_keys, self.flat_values, self.bias = flat_keys, flat_values, bias
        self.lengths = lengths
        self.capacity = lengths  # region sizes: no free slot yet
        self.starts = tuple(sum(lengths[:h]) for h in range(len(lengths)))
        self.context_length = int(context_length)
        self.appended = 0  # t
        self.dtype, self.device = flat_keys.dtype, flat_keys.device
        self.is_initialized = True

    # ---- what the attention route and readers see

    def context(self) -> RaggedContext:
        """The layer as the attention route reads it (views of the flat buffers, nothing copied)."""
        return RaggedContext(self.flat_keys, self.flat_values, self.bias, self.starts, self.lengths, self.appended)

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """KV head ``h``'s kept keys and values (c_h, d) and their bias (c_h,) or None: views, nothing copied."""
        s = slice(self.starts[h], self.starts[h] + self.lengths[h])
        return self.flat_keys[s], self.flat_values[s], None if self.bias is None else self.bias[s]

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The appended tokens' keys and values (1, H, t, d) (a copy: every head holds them all)."""
        index = torch.tensor([s + c + i for s, c in zip(self.starts, self.lengths) for i in range(self.appended)],
                             dtype=torch.long, device=self.device)
        shape = (1, len(self.lengths), self.appended, self.flat_keys.shape[-1])
        return self.flat_keys[index].view(shape), self.flat_values[index].view(shape)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A padded copy to read, never held: keys and values (1, H, S + t, d), each head's c_h kept entries
        first, zeros up to S = max c_h, then the appended tokens; and the (1, H, S + t) bool of real entries."""
        H, S, t = len(self.lengths), max(self.lengths), self.appended
        keys = self.flat_keys.new_zeros(1, H, S + t, self.flat_keys.shape[-1])
        values = torch.zeros_like(keys)
        real = torch.zeros(1, H, S + t, dtype=torch.bool, device=self.device)
        for h in range(H):
            k, v, _ = self.head(h)
            keys[0, h, : len(k)], values[0, h, : len(v)], real[0, h, : len(k)] = k, v, True
        keys[:, :, S:], values[:, :, S:] = self.tail()
        real[:, :, S:] = True
        return keys, values, real

    def nbytes(self) -> int:
        """Bytes of the storage of every tensor this layer holds, K, V and bias (``storage_bytes``); the
        3 H Python ints placing the regions are not tensors and not counted."""
        return storage_bytes(self.flat_keys, self.flat_values, self.bias)

    # ---- transformers' cache-layer interface

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # built initialised, by ``evict_ragged``

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        """Append the new tokens (1, H, q, d) to every head's region; returns placeholders of the logical shape
        (1, H, n + t, d) carrying the layer's ``RaggedContext`` (see the module)."""
        b, H, q, d = key_states.shape
        if b != 1:
            raise ValueError(f"a RaggedLayer holds one sequence (batch size 1), got batch size {b}")
        if H != len(self.lengths) or d != self.flat_keys.shape[-1]:
            raise ValueError(f"new keys (1, H, q, d) must have this layer's H = {len(self.lengths)} heads of "
                             f"d = {self.flat_keys.shape[-1]}, got {tuple(key_states.shape)}")
        if any(c + self.appended + q > cap for c, cap in zip(self.lengths, self.capacity)):
            self._grow(max(MIN_SLOTS, 2 * (self.appended + q)))
        index = torch.tensor([s + c + self.appended + i for s, c in zip(self.starts, self.lengths) for i in range(q)],
                             dtype=torch.long, device=self.device)
        self.flat_keys.index_copy_(0, index, key_states.to(self.dtype).reshape(H * q, d))
        self.flat_values.index_copy_(0, index, value_states.to(self.dtype).reshape(H * q, d))
        self.appended += q
        return self._placeholder(), self._placeholder()

    def _placeholder(self) -> RaggedKeys:
        shape = (1, len(self.lengths), self.get_seq_length(), self.flat_keys.shape[-1])
        keys = torch.Tensor._make_subclass(RaggedKeys, self.flat_keys.new_zeros(()).expand(shape))
        keys.context = self.context()
        return keys

    def _grow(self, tail_slots: int) -> None:
        """Re-lay the regions with ``tail_slots`` slots each for appended tokens (one copy of the layer)."""
        capacity = tuple(c + tail_slots for c in self.lengths)
        starts = tuple(sum(capacity[:h]) for h in range(len(capacity)))
        total, d = sum(capacity), self.flat_keys.shape[-1]
        keys, values = self.flat_keys.new_zeros(total, d), self.flat_values.new_zeros(total, d)
        bias = None if self.bias is None else self.bias.new_zeros(total)
        for old, new, c in zip(self.starts, starts, self.lengths):
            used = c + self.appended
            keys[new: new + used], values[new: new + used] = self.flat_keys[old: old + used], self.flat_values[old: old + used]
            if bias is not None:
                bias[new: new + used] = self.bias[old: old + used]
        self.flat_keys, self.flat_values, self.bias = keys, values, bias
        self.starts, self.capacity = starts, capacity

    def get_seq_length(self) -> int:
        """The logical length: the context's n + the t tokens appended since (new tokens' positions start here)."""
        return self.context_length + self.appended

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """The model's mask covers the logical length; the ragged route builds its own per-head mask."""
        return self.get_seq_length() + cache_position.shape[0], 0

    def get_max_cache_shape(self) -> int:
        return -1

    @property
    def keys(self) -> LogicalView:
        return LogicalView(self, "keys", self.get_seq_length())

    @keys.setter
    def keys(self, view) -> None:
        self._cut(view, "keys")

    @property
    def values(self) -> LogicalView:
        return LogicalView(self, "values", self.get_seq_length())

    @values.setter
    def values(self, view) -> None:
        self._cut(view, "values")

    def _cut(self, view, which: str) -> None:
        if not (isinstance(view, LogicalView) and view._layer is self and view._which == which):
            raise TypeError(f"a RaggedLayer's .{which} accepts only a prefix slice of its own .{which} "
                            f"([:, :, :m], m >= its context length {self.context_length}), got {type(view).__name__}")
        self.crop(view._length)

    def crop(self, max_length: int) -> None:
        """Drop appended tokens beyond ``max_length`` logical positions (negative: that many from the end);
        cropping into the compressed context is refused. The slots stay allocated for the next tokens."""
        if max_length < 0:
            max_length = self.get_seq_length() + max_length
        if max_length >= self.get_seq_length():
            return
        if max_length < self.context_length:
            raise ValueError(f"cannot crop a RaggedLayer to {max_length} positions, inside its compressed context "
                             f"of {self.context_length}: only the appended tokens can be dropped")
        self.appended = max_length - self.context_length

    def reset(self) -> None:
        raise NotImplementedError("a RaggedLayer cannot be reset in place: build a new cache for a new context")

    def offload(self):
        raise NotImplementedError("a RaggedLayer does not offload: build the cache without offloading=True")

    def prefetch(self):
        raise NotImplementedError("a RaggedLayer does not offload: build the cache without offloading=True")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a RaggedLayer holds one sequence: beam search (num_beams > 1) is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("a RaggedLayer holds one sequence: num_return_sequences and beams must be 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.numel() != 1 or int(indices.reshape(-1)[0]) != 0:
            raise NotImplementedError("a RaggedLayer holds one sequence: it cannot select batch indices")

    def __repr__(self):
        return (f"RaggedLayer(kept={self.lengths}, context={self.context_length}, appended={self.appended}, "
                f"bias={self.bias is not None})")


def storage_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the storage behind ``tensors`` (None skipped), each storage counted once: a view keeps its
    whole storage alive, so the storage counts, not the view's own elements. The one byte counter of the
    package (``kvpress_prob.cache.held.held_bytes`` reads every layer through it)."""
    held = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            held[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(held.values())


def check_evictable(cache, batch_size: int, who: str) -> None:
    """Refuse what a ragged cache cannot hold, naming ``who`` evicts into it: a ``QuantizedCache`` (its layers
    hold quantized K and V), and a batch of more than one sequence (each head of each sequence would keep its
    own count)."""
    if isinstance(cache, QuantizedCache):
        raise ValueError(f"{who} evicts into a ragged cache: a QuantizedCache is not supported, use a DynamicCache")
    if batch_size != 1:
        raise ValueError(f"{who} evicts into a ragged cache, which holds one sequence (its heads keep different "
                         f"counts): batch size must be 1, got {batch_size}")


def evict_ragged(cache, layer_idx: int, keep: torch.Tensor, bias: torch.Tensor | None = None,
                 device: torch.device | str | None = None) -> RaggedLayer:
    """Replace ``cache.layers[layer_idx]`` (dense K, V (1, H, n, d)) by a ``RaggedLayer`` holding exactly the
    entries where ``keep`` (1, H, n) bool is True, in prefix order, and their ``bias`` (1, H, n) (a corrected
    press's log-weights, read at the kept entries; None or all zero: weight 1, nothing stored), its buffers on
    ``device`` (default: the dense keys'). The cache no longer references the dense tensors. Refuses what
    ``check_evictable`` refuses. Returns the new layer."""
    layers = getattr(cache, "layers", None)
    if layers is None or not 0 <= layer_idx < len(layers):
        raise ValueError(f"layer_idx must index the cache's {0 if layers is None else len(layers)} layers, "
                         f"got {layer_idx}")
    layer = layers[layer_idx]
    if isinstance(layer, RaggedLayer):
        raise ValueError(f"layer {layer_idx} is already a RaggedLayer: evict_ragged reads a dense layer")
    refuse_sliding(layer, layer_idx)
    keys, values = layer.keys, layer.values
    check_evictable(cache, keys.shape[0] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 1, "evict_ragged")
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[0] != 1:
        raise ValueError(f"layer {layer_idx} must hold dense keys (1, H, n, d) to evict, got "
                         f"{getattr(keys, 'shape', keys)}")
    if keep.dtype != torch.bool or tuple(keep.shape) != tuple(keys.shape[:3]):
        raise ValueError(f"keep must be a bool tensor of shape {tuple(keys.shape[:3])} (1, H, n), got {keep.dtype} "
                         f"{tuple(keep.shape)}")
    if bias is not None and tuple(bias.shape) != tuple(keep.shape):
        raise ValueError(f"bias must be (1, H, n) = {tuple(keep.shape)}, got {tuple(bias.shape)}")
    k = keep[0].to(keys.device)  # (H, n)
    flat_keys, flat_values = keys[0][k], values[0][k]  # (N, d): boolean indexing is row-major: head-major
    flat_bias = None
    if bias is not None:
        flat_bias = bias[0].to(keys.device)[k]
        flat_bias = flat_bias if bool((flat_bias != 0).any()) else None
    if device is not None and torch.device(device) != keys.device:  # a prefill that waits in host memory
        flat_keys, flat_values = flat_keys.to(device), flat_values.to(device)
        flat_bias = None if flat_bias is None else flat_bias.to(device)
    ragged = RaggedLayer(flat_keys, flat_values, k.sum(-1).tolist(), keys.shape[2], flat_bias)
    layers[layer_idx] = ragged
    attention_dispatch.install()  # the one wrapper of every attention function, whose "ragged" handler reads it
    return ragged


def evict_layers(cache, keep: torch.Tensor, bias: torch.Tensor | None = None,
                 layers: list[int] | None = None) -> list[RaggedLayer]:
    """``evict_ragged`` on every layer of ``layers`` (default: 0 .. L - 1), the i-th to ``keep[i]`` (L, 1, H, n)
    bool with ``bias[i]`` (L, 1, H, n) or none: a press that chose every layer's kept set at once. Returns the
    new layers, in that order."""
    layers = list(range(keep.shape[0])) if layers is None else list(layers)
    if keep.dim() != 4 or keep.shape[0] != len(layers):
        raise ValueError(f"keep must be (L, 1, H, n) with one row per layer of {layers}, got {tuple(keep.shape)}")
    return [evict_ragged(cache, idx, keep[i], None if bias is None else bias[i]) for i, idx in enumerate(layers)]


def refuse_sliding(layer, layer_idx: int) -> None:
    """Raise if ``layer`` is a sliding-window layer (``layer.is_sliding``, transformers' ``DynamicSlidingWindowLayer``):
    a ragged layer keeps entries at any position and its route attends to all of them, so the window would be lost."""
    if getattr(layer, "is_sliding", False):
        raise ValueError(f"layer {layer_idx} is a sliding-window layer ({type(layer).__name__}, is_sliding=True): a "
                         "ragged layer attends to every kept entry and cannot keep a window; evict only full-attention "
                         "layers (the model's config.layer_types), or keep this model's cache dense")


__all__ = ["LogicalView", "RaggedContext", "RaggedKeys", "RaggedLayer", "check_evictable", "evict_layers",
           "evict_ragged", "refuse_sliding", "storage_bytes"]  # the layout's two re-exported
