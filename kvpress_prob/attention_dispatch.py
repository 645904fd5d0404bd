"""The one wrapper of transformers' attention functions, the handlers that answer a forward in their place, and the
routes they run.

transformers' models call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value,
attention_mask, dropout=..., scaling=..., **kwargs)``. kvpress wraps every entry when it is imported (its attention
patch, which AdaKV's head-wise masking needs) by writing into that instance's ``_local_mapping``, which transformers
reads before the class-wide registry, so a function registered by name through ``AttentionInterface.register`` would
never be called. ``install()`` therefore replaces every entry present by ``wrap(entry)``, on top of whatever is there
(kvpress's wrapper included). The wrapper carries ``MARK``, so ``install()`` is idempotent and wraps only what was
registered since; nothing is wrapped at import.

Handlers. ``register(name, handler, priority)`` adds a handler; the cache's ragged route
(``kvpress_prob.cache.ragged_attention``) and the correction (``kvpress_prob.correction.corrected_attention``) register
theirs when imported. A handler is called as ``handler(module, query, key, value, attention_mask, **kwargs)``, with the
arguments the model passed (``dropout``, ``scaling``, ``sliding_window``, ``softcap``, ... as keywords), and returns
None ("not mine": the next handler is asked) or the pair ``(output, weights)`` an attention function returns (output
(b, q, H_q, d), weights or None). Handlers are asked in decreasing ``priority`` (ties: the first registered first);
when none answers, the wrapped function runs with every argument forwarded and the model's mask refitted to this
layer's key length (``own_length_mask``: unchanged wherever it fits).

A handler's answer replaces the function, so it computes plain softmax attention: an argument that asks for something
else is refused with a ``ValueError`` naming it and the handler (``refuse_unhonoured``): ``softcap`` not None,
``dropout`` > 0, and a ``sliding_window`` shorter than the keys attended (a ragged layer's logical length).

Routes. ``set_route(ragged=..., corrected=...)`` sets the route each handler runs (``ROUTES``); ``route(kind)`` reads
it.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

MARK = "_kvprob_wrapped"  # on the wrapper: this package's, never wrapped twice
POSITIONAL = ("dropout", "scaling")  # the arguments after attention_mask a caller may pass by position

#: The routes each handler kind can run. ragged: "auto" (FlexAttention on CUDA where torch has it, the portable route
#: elsewhere), "portable", "flex", "nested", "flash" (``kvpress_prob.cache.ragged_attention``); corrected: "auto"
#: (FlexAttention on CUDA and under a flash-attention implementation, SDPA elsewhere), "fused" (FlexAttention
#: everywhere), "sdpa" (never FlexAttention) (``kvpress_prob.correction.corrected_attention``).
ROUTES = {"ragged": ("auto", "portable", "flex", "nested", "flash"), "corrected": ("auto", "fused", "sdpa")}
_ROUTE = {kind: "auto" for kind in ROUTES}
_HANDLERS: dict[str, tuple[int, int, Callable]] = {}  # name -> (priority, registration number, handler)
_ORDER: list[tuple[str, Callable]] = []  # (name, handler) in the order asked
_NUMBERS = itertools.count()


def register(name: str, handler: Callable, priority: int) -> None:
    """Add ``handler`` under ``name`` (a second call with the same name replaces it and keeps its first place among
    equal priorities). ``handler(module, query, key, value, attention_mask, **kwargs)`` returns None, or the
    ``(output, weights)`` pair that answers the forward; handlers are asked in decreasing ``priority``."""
    if not callable(handler):
        raise TypeError(f"handler must be callable, got {type(handler).__name__}")
    if not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {priority!r}")
    number = _HANDLERS[name][1] if name in _HANDLERS else next(_NUMBERS)
    _HANDLERS[name] = (priority, number, handler)
    _ORDER[:] = [(n, h) for n, (_, _, h) in sorted(_HANDLERS.items(), key=lambda item: (-item[1][0], item[1][1]))]


def unregister(name: str) -> None:
    """Remove the handler registered as ``name`` (none: nothing happens)."""
    if _HANDLERS.pop(name, None) is not None:
        _ORDER[:] = [(n, h) for n, h in _ORDER if n != name]


def handlers() -> tuple[str, ...]:
    """The registered handlers' names, in the order they are asked."""
    return tuple(n for n, _ in _ORDER)


def set_route(*, ragged: str | None = None, corrected: str | None = None) -> dict[str, str]:
    """Set the route of the ragged handler and of the corrected one (None: unchanged; see ``ROUTES``). Returns the
    setting before the call: ``set_route(**previous)`` restores it."""
    previous = dict(_ROUTE)
    for kind, name in (("ragged", ragged), ("corrected", corrected)):
        if name is not None and name not in ROUTES[kind]:
            raise ValueError(f"{kind} must be one of {ROUTES[kind]}, got {name!r}")
    for kind, name in (("ragged", ragged), ("corrected", corrected)):
        if name is not None:
            _ROUTE[kind] = name
    return previous


def route(kind: str) -> str:
    """The route set for ``kind`` ("ragged" or "corrected")."""
    return _ROUTE[kind]


def refuse_unhonoured(handler: str, key: torch.Tensor, kwargs: dict) -> None:
    """Raise where the handler ``handler``, which computes plain softmax attention over ``key``'s length, was asked
    for something else: logits soft-capped, dropout, or a sliding window shorter than the keys attended."""
    softcap, dropout, window = kwargs.get("softcap"), kwargs.get("dropout") or 0.0, kwargs.get("sliding_window")
    if softcap is not None:
        reason = f"softcap={softcap} (logit soft-capping)"
    elif dropout > 0:
        reason = f"dropout={dropout} (attention dropout; put the model in eval mode)"
    elif window is not None and window < key.shape[-2]:
        reason = f"sliding_window={window}, shorter than the {key.shape[-2]} positions attended"
    else:
        return
    raise ValueError(f"the {handler!r} attention route computes plain softmax attention and cannot honour {reason}: "
                     "use a dense cache without this press on this model")


def own_length_mask(attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The model's 4-d mask (b or 1, 1, q, k0), built for layer 0's key length k0, refitted to this layer's k
    keys (b, H_kv, k, d): unchanged where it fits (or is not 4-d: flash attention's is None without padding).
    A compressed cache whose layers differ in length (a top-k press's, stored without a bias) needs it in a
    forward of several new tokens: the q new tokens are the last q keys of every layer, so their block (the
    mask's last q columns) is kept, and the k - q stored entries before them are all visible. A mask that
    hides a stored entry (padding in a batch) cannot be refitted, and raises."""
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[-1] == key.shape[2]:
        return attention_mask
    q_len, k_len = query.shape[2], key.shape[2]
    k0 = attention_mask.shape[-1]
    new = attention_mask[..., k0 - q_len:]  # (b, 1, q, q): the new tokens' block
    past = attention_mask[..., : k0 - q_len]
    visible = past if past.dtype == torch.bool else past == 0
    if not bool(visible.all()):
        raise ValueError(
            f"a layer holds {k_len} keys but the attention mask was built for {k0}, and it hides stored entries "
            f"(padding): a cache whose layers differ in length decodes with batch size 1 and no padding")
    fill = torch.ones((), dtype=torch.bool, device=new.device) if new.dtype == torch.bool else new.new_zeros(())
    return torch.cat([fill.expand(*new.shape[:-1], k_len - q_len), new], dim=-1)


def wrap(func: Callable, name: str | None = None) -> Callable:
    """``func`` (registered as ``name``) behind the handlers (see the module); ``func`` itself if it carries
    ``MARK``. The wrapper's ``__wrapped__`` is ``func``."""
    if getattr(func, MARK, False):
        return func

    def dispatch(module, query, key, value, attention_mask, *args, **kwargs):
        if len(args) > len(POSITIONAL):
            raise TypeError(f"attention function {name!r} takes at most {len(POSITIONAL)} arguments after "
                            f"attention_mask by position ({', '.join(POSITIONAL)}), got {len(args)}")
        kwargs.update(zip(POSITIONAL, args))
        for handler_name, handler in _ORDER:
            answer = handler(module, query, key, value, attention_mask, **kwargs)
            if answer is not None:
                refuse_unhonoured(handler_name, key, kwargs)
                return answer
        return func(module, query, key, value, own_length_mask(attention_mask, query, key), **kwargs)

    functools.update_wrapper(dispatch, func, updated=())  # its name and __wrapped__; not func's attributes
    setattr(dispatch, MARK, True)
    return dispatch


def install() -> None:
    """Wrap every function of ``ALL_ATTENTION_FUNCTIONS`` not wrapped yet (idempotent)."""
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        func = ALL_ATTENTION_FUNCTIONS[name]
        if not getattr(func, MARK, False):
            ALL_ATTENTION_FUNCTIONS[name] = wrap(func, name)


def ensure_installed(implementation: str) -> None:
    """``install()`` unless the function registered as ``implementation`` is wrapped already: the one check a
    forward needs (a dictionary look-up, not a pass over every function, at every step)."""
    if not getattr(ALL_ATTENTION_FUNCTIONS[implementation], MARK, False):
        install()


def check_implementation(model, who: str) -> None:
    """Raise if ``model``'s attention implementation is not one of ``ALL_ATTENTION_FUNCTIONS`` (eager attention,
    whose function cannot be wrapped); ``who`` names what needs it."""
    implementation = model.config._attn_implementation
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"{who} needs an attention implementation from ALL_ATTENTION_FUNCTIONS "
            f"{sorted(ALL_ATTENTION_FUNCTIONS.keys())}, got attn_implementation={implementation!r}: "
            f"load the model with attn_implementation='sdpa'"
        )


__all__ = ["MARK", "ROUTES", "check_implementation", "ensure_installed", "handlers", "install", "own_length_mask",
           "refuse_unhonoured", "register", "route", "set_route", "unregister", "wrap"]
