"""The attention functions the correction runs in: transformers' ``ALL_ATTENTION_FUNCTIONS``, wrapped.

Nothing is wrapped at import. ``install()`` wraps every entry present at the time it is called, on
top of whatever is there (kvpress's own wrapper, which AdaKV needs, included); a wrapped entry is
never wrapped twice. It is called when a SamplingPress is entered (``post_init_from_model``), when
a correction bias is given (``correction.set_bias``) and before every forward that reads one
(``correction``'s pre-hook), so an attention function registered after import, or after the
eviction, is corrected too.

A wrapped function runs the original unchanged unless the module's current forward carries a bias
(``correction.active_bias``, set by the correction's pre-hook for a cache compressed by a
SamplingPress) and is not a prefill; then it returns ``correction.corrected_sdpa``.
"""

from __future__ import annotations

import functools

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_prob import correction

_WRAPPED = "_kvprob_wrapped"  # on a wrapper function: marks it as ours


def wrap(func):
    """Wrap one attention function with the correction (idempotent)."""
    if getattr(func, _WRAPPED, False):
        return func

    @functools.wraps(func)
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        bias = correction.active_bias(module)
        if bias is None or query.shape[2] == key.shape[2]:  # plain attention, or a prefill
            return func(module, query, key, value, attention_mask, *args, **kwargs)
        if query.shape[0] != bias.shape[0]:
            raise ValueError(
                f"batch size {query.shape[0]} differs from the batch size {bias.shape[0]} the cache was compressed with"
            )
        return correction.corrected_sdpa(query, key, value, bias, kwargs.get("scaling")), None

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def install() -> None:
    """Wrap every attention function transformers knows now (idempotent)."""
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        func = ALL_ATTENTION_FUNCTIONS[name]
        if not getattr(func, _WRAPPED, False):
            ALL_ATTENTION_FUNCTIONS[name] = wrap(func)


def check_implementation(model) -> None:
    """Raise if ``model``'s attention implementation is not one of ``ALL_ATTENTION_FUNCTIONS`` (eager
    attention, whose function cannot be wrapped)."""
    implementation = model.config._attn_implementation
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"SamplingPress needs an attention implementation from ALL_ATTENTION_FUNCTIONS "
            f"{sorted(ALL_ATTENTION_FUNCTIONS.keys())}, got attn_implementation={implementation!r}: "
            f"load the model with attn_implementation='sdpa'"
        )
