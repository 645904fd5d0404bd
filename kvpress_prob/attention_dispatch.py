"""transformers' attention functions (``ALL_ATTENTION_FUNCTIONS``), wrapped by this package: the correction's
wrapper (``kvpress_prob.correction.corrected_attention``) and the ragged cache's (``kvpress_prob.cache.ragged_attention``) both
wrap every registered function through ``wrap_all``."""

from __future__ import annotations

from typing import Callable

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def wrap_all(mark: str, wrap: Callable[[Callable, str], Callable]) -> None:
    """Replace every function of ``ALL_ATTENTION_FUNCTIONS`` that does not carry the attribute ``mark`` by
    ``wrap(function, name)`` (which sets ``mark`` on what it returns), so calling it again wraps only the
    functions registered since."""
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        func = ALL_ATTENTION_FUNCTIONS[name]
        if not getattr(func, mark, False):
            ALL_ATTENTION_FUNCTIONS[name] = wrap(func, name)


__all__ = ["wrap_all"]
