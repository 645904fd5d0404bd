"""Decode-time correction: which bias each attention forward reads, and for how long it lives.

After eviction each layer of the compressed cache carries a bias of shape (b, H_kv, S): the
log-weight / T of each stored prefix entry (T the press's temperature) (S = the layer's largest kept count), and the dtype's
most negative finite value on padding. Every later forward on that cache reads it through the wrapped
attention functions (``kvpress_prob.correction.corrected_attention.corrected_sdpa``: self-normalised importance sampling
as an additive logit bias).

Lifetime: the bias belongs to the one compressed cache, and lives on its layer objects (it is
freed with the cache, copied with ``copy.deepcopy``, and never seen by another cache). A forward
pre-hook, registered on an attention module when it is given a bias, runs before each of its
forwards under any attention implementation (eager included) and hands the attention function the
bias of that forward's own cache layer, or none. So nothing a press leaves behind reaches a later
prefill, another press, a plain forward or ``model.generate``, while the kvpress pipeline, which
decodes after the press's ``with`` block, decodes its compressed cache with the correction, and
two compressed caches can be decoded in any interleaving. A layer emptied and prefilled again in
the same cache object loses its bias. Decoding a biased cache on eager attention, whose function
is not wrapped, raises instead of silently skipping the correction.

The hooks live only as long as a cache that holds a bias of that module's layer (or a bias given
without a cache): when the last such cache is freed (``weakref.finalize``) they are removed, and
the module carries nothing of ours. The module's state (hook handles, the cache it last ran on) is
kept here, in a dictionary weakly keyed by the module, never as attributes on the model.

The attention functions themselves are wrapped by ``kvpress_prob.attention_dispatch`` (on entry of a press,
whenever a bias is given and before a forward that reads one; never at import); its "corrected" handler
(``kvpress_prob.correction.corrected_attention``) reads the bias. The state is read
and written only through ``set_bias``, ``store``, ``bias_of``, ``held_by`` and ``reset``.

A top-k eviction (weight 1 everywhere) that leaves a layer without padding stores no bias (``store``):
that layer is K and V only, as kvpress's, and decodes through the model's own attention.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob import attention_dispatch
from kvpress_prob.correction import corrected_attention

_BIAS = "_kvprob_bias"  # on a cache layer: its (b, H_kv, S) bias (the only attribute of ours, and not on the model)


def padding(dtype: torch.dtype) -> float:
    """The bias of a padding entry (or of a masked one) in a bias of ``dtype``: its lowest finite
    value, whose exp added to any logit is exactly 0. The one definition: ``is_padding`` finds it."""
    return torch.finfo(dtype).min


def is_padding(bias: torch.Tensor) -> torch.Tensor:
    """Which entries of ``bias`` are padding (``padding(bias.dtype)``), as a bool tensor of its shape."""
    return bias == padding(bias.dtype)


def cast(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bias`` in ``dtype``, its padding that dtype's padding (a plain cast would turn float32's
    lowest into -inf in bfloat16 or float16, and bfloat16's lowest into a float32 value that
    ``is_padding`` does not recognise)."""
    return torch.where(is_padding(bias), padding(dtype), bias.to(dtype)) if bias.dtype != dtype else bias


@dataclass
class _State:
    """What this module knows of one attention module while it carries our hooks."""

    handles: tuple  # its pre- and post-forward hook handles
    holders: set = field(default_factory=set)  # ids of the live caches holding a bias of its layer
    current: weakref.ref | None = None  # the cache it last ran on or was given
    pending: torch.Tensor | None = None  # a bias given without a cache, for its next decoding forward


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> _State


def _layer(cache, layer_idx: int):
    layers = getattr(cache, "layers", None)
    return layers[layer_idx] if layers is not None and layer_idx < len(layers) else None


def _current_cache(module):
    state = _STATES.get(module)
    return state.current() if state is not None and state.current is not None else None


def _attach(module: torch.nn.Module) -> _State:
    """The module's state, registering its hooks if it has none yet."""
    state = _STATES.get(module)
    if state is None:
        state = _State(handles=(
            module.register_forward_pre_hook(_before_forward, with_kwargs=True),
            module.register_forward_hook(_after_forward, always_call=True),
        ))
        _STATES[module] = state
    return state


def _hold(module: torch.nn.Module, state: _State, cache) -> None:
    """Keep the module's hooks while ``cache`` lives: it holds a bias of the module's layer."""
    key = id(cache)
    if key not in state.holders:
        state.holders.add(key)
        weakref.finalize(cache, _release, weakref.ref(module), key)


def _release(module_ref: weakref.ref, key: int) -> None:
    """A cache holding a bias of this module's layer was freed: drop the hooks after the last one."""
    module = module_ref()
    state = _STATES.get(module) if module is not None else None
    if state is None:
        return
    state.holders.discard(key)
    _detach_if_unused(module, state)


def _detach_if_unused(module: torch.nn.Module, state: _State) -> None:
    if not state.holders and state.pending is None and corrected_attention.active_bias(module) is None:
        for handle in state.handles:
            handle.remove()
        del _STATES[module]


def set_bias(module: torch.nn.Module, bias: torch.Tensor | None, cache=None) -> None:
    """Give layer ``module.layer_idx`` of ``cache`` the bias (b, H_kv, S) of its S stored prefix
    entries (None: ``reset``). Without a cache, the bias goes to the cache of the module's next
    forward that is not a prefill."""
    if bias is None:
        reset(module)
        return
    attention_dispatch.install()
    if cache is None:
        _attach(module).pending = bias
        return
    layer = _layer(cache, module.layer_idx)
    if layer is None:
        raise ValueError(f"the cache has no layer {module.layer_idx} to hold the correction of that layer")
    state = _attach(module)
    setattr(layer, _BIAS, bias)
    state.current = weakref.ref(cache)
    state.pending = None
    _hold(module, state, cache)


def store(module: torch.nn.Module, bias: torch.Tensor, cache) -> int:
    """What an eviction stores for layer ``module.layer_idx`` of ``cache``: its bias (b, H_kv, S) through
    ``set_bias``, unless every entry of it is 0 (weight 1 on every stored entry, no padding). Then the layer
    holds its keys and values only, any bias it held is dropped, and it decodes through the model's own
    attention function (``kvpress_prob.attention_dispatch`` refits the mask to its own length where the
    model's, built from layer 0's, does not fit). Returns the bytes stored for the bias (0 when none)."""
    attention_dispatch.install()
    if bool((bias == 0).all()):
        layer = _layer(cache, module.layer_idx)
        if layer is not None and hasattr(layer, _BIAS):
            delattr(layer, _BIAS)
        return 0
    set_bias(module, bias, cache)
    return bias.numel() * bias.element_size()


def bias_of(module: torch.nn.Module, cache=None) -> torch.Tensor | None:
    """The bias of this module's layer of ``cache`` (default: the cache the module last ran on or
    was given by ``set_bias``; then also a bias given without a cache). None: plain attention."""
    if cache is None:
        state = _STATES.get(module)
        if state is not None and state.pending is not None:
            return state.pending
        cache = _current_cache(module)
    return held_by(_layer(cache, module.layer_idx))


def held_by(layer) -> torch.Tensor | None:
    """The bias (b, H_kv, S) a cache layer holds (``set_bias``), or None: plain attention."""
    return getattr(layer, _BIAS, None)


def reset(module: torch.nn.Module) -> None:
    """Drop the correction of this module's layer of the cache it last ran on or was given (that
    cache then decodes with plain attention), and any bias given without a cache."""
    layer = _layer(_current_cache(module), module.layer_idx)
    if layer is not None and hasattr(layer, _BIAS):
        delattr(layer, _BIAS)
    state = _STATES.get(module)
    if state is not None:
        state.pending = None
        _detach_if_unused(module, state)


def _before_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the bias for this forward is the one of its own cache layer, if any."""
    state = _STATES.get(module)
    if state is None:
        return None
    corrected_attention.activate(module, None)
    cache = kwargs.get("past_key_values")
    layer = _layer(cache, module.layer_idx)
    if cache is not None and (state.current is None or state.current() is not cache):
        state.current = weakref.ref(cache)
    stored = layer.get_seq_length() if layer is not None else 0
    if state.pending is not None:
        pending, state.pending = state.pending, None
        if stored > 0:
            setattr(layer, _BIAS, pending)
            _hold(module, state, cache)
    bias = getattr(layer, _BIAS, None)
    if bias is None:
        return None
    if stored == 0:  # the layer was emptied and is prefilled again: its old correction is void
        delattr(layer, _BIAS)
        return None
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise RuntimeError(
            f"layer {module.layer_idx} decodes a cache compressed by a SamplingPress, whose correction runs in "
            f"the attention functions of ALL_ATTENTION_FUNCTIONS, but attn_implementation={implementation!r}: "
            f"call model.set_attn_implementation('sdpa') before decoding"
        )
    attention_dispatch.ensure_installed(implementation)  # one registered since the bias was given is wrapped too
    corrected_attention.activate(module, bias)
    return None


def _after_forward(module: torch.nn.Module, args: tuple, output) -> None:
    corrected_attention.activate(module, None)
    state = _STATES.get(module)
    if state is not None:
        _detach_if_unused(module, state)
    return None
