"""A SamplingPress inside kvpress's wrappers: which ones can run it, and the refusal of the others.

A SamplingPress evicts every layer at once when the last hooked layer of a prefill is reached, so a
wrapper can run it only if it calls its ``forward_hook`` at every layer of the prefill and cuts no
layer after it: last in a ``ComposedPress``, or as a ``PrefillDecodingPress``'s ``prefilling_press``
with no decoding press. Every other wrapper is refused with a ``TypeError`` naming the wrapper and
what to use instead.

The press finds its wrappers from what it sees itself, never from the call stack and without
changing kvpress's classes: the forward hooks registered on the attention module it is given
(kvpress's ``BasePress.__call__`` registers the outermost press's bound ``forward_hook``), and the
fields of those presses down to itself. It checks them

- at the start of every prefill's attention (``check_hooks``, called by the attention functions
  ``kvpress_prob.correction.corrected_attention`` wraps, which entering a press installs): the presses hooked on that
  module are searched for a SamplingPress, so even a wrapper that never calls the press during the
  prefill (``DecodingPress``) is refused before the first layer's attention runs. Nothing is armed
  or registered for it: it reads only the hooks the wrapper itself registered, so nothing of ours
  is left on the model when the wrapper's context exits, with or without a forward;
- at its ``forward_hook`` of the first layer (``PerLayerCompressionPress``, which never enters the
  press: the attention functions may not be wrapped yet);
- when a wrapper calls ``score`` or ``compress``, which a SamplingPress does not offer.

kvpress's own constructors still refuse a press that is not a ``ScorerPress`` (AdaKV, Chunk, Block,
KeyRerotation, PerLayerCompression, Decoding) with their assertions; the checks above cover the
same wrappers under ``python -O``, edited fields, and wrappers this package does not know.
"""

from __future__ import annotations

from kvpress import (
    AdaKVPress,
    BlockPress,
    ChunkPress,
    ComposedPress,
    DecodingPress,
    KeyRerotationPress,
    PerLayerCompressionPress,
    PrefillDecodingPress,
)
from kvpress.presses.base_press import BasePress
from torch import nn

#: kvpress wrappers that cannot hold a SamplingPress: why, and what to use instead.
REFUSED: dict[type, tuple[str, str]] = {
    PerLayerCompressionPress: (
        "it sets a different compression_ratio on the inner press at each layer's hook, but a SamplingPress "
        "draws every layer at once under one budget at the last layer, so per-layer ratios would be "
        "silently replaced by the last layer's",
        "SamplingPress(budget='layer') (each layer keeps 1 - compression_ratio of its entries in expectation) "
        "or budget='global' (the budget goes where the proposal puts its mass)",
    ),
    KeyRerotationPress: (
        "it takes a top-k of the inner press's scores and re-rotates the kept keys to positions 0..k-1, but a "
        "SamplingPress keeps a random number of entries per head, padded, at their original positions",
        "the SamplingPress alone, or KeyRerotationPress around a kvpress ScorerPress",
    ),
    ChunkPress: (
        "it takes a top-k of the inner press's scores in every chunk, which replaces the sampling and its "
        "correction weights",
        "the SamplingPress alone (budget='head' for a fixed expected budget per head), or ChunkPress around "
        "a kvpress ScorerPress",
    ),
    BlockPress: (
        "it takes a top-k of the inner press's scores block by block, which replaces the sampling and its "
        "correction weights",
        "the SamplingPress alone, or BlockPress around a kvpress ScorerPress",
    ),
    DecodingPress: (
        "it compresses during decoding with a top-k of the inner press's scores and skips the prefill, but a "
        "SamplingPress compresses at prefill, and a decoding-time cut would drop entries that carry correction "
        "weights",
        "PrefillDecodingPress(prefilling_press=<the SamplingPress>, decoding_press=<a SamplingDecodingPress or "
        "None>), or DecodingPress around a kvpress ScorerPress",
    ),
    AdaKVPress: (
        "it masks a head-adaptive top-k of the inner press's scores, which replaces the sampling and frees no "
        "memory; a SamplingPress already spreads its budget over heads and layers",
        "the SamplingPress alone (budget='global' is head- and layer-adaptive), or <scorer>_adaptive "
        "(e.g. get_press('snapkv_adaptive', ratio)): a head-adaptive top-k that frees memory",
    ),
}

MAX_DEPTH = 8  # how deep a wrapper's fields are searched for the press


def path_to(container, press, depth: int = 0) -> list[BasePress] | None:
    """The presses from ``container`` (a press, or a list / tuple / dict of them) down to the one
    holding ``press``, outermost first ([] if ``container`` is ``press``; None if it does not hold it)."""
    if container is press:
        return []
    if depth > MAX_DEPTH:
        return None
    if isinstance(container, dict):
        container = list(container.values())
    if isinstance(container, (list, tuple)):
        for item in container:
            found = path_to(item, press, depth + 1)
            if found is not None:
                return found
        return None
    if isinstance(container, BasePress):
        for value in vars(container).values():
            found = path_to(value, press, depth + 1)
            if found is not None:
                return [container, *found]
    return None


def holds(container, press) -> bool:
    """Whether ``container`` (a press, or a list / tuple / dict of them) holds ``press``, at any depth."""
    return path_to(container, press) is not None


def refusal(kind: type, fields: dict, press) -> str | None:
    """Why a wrapper of type ``kind`` with these ``fields`` cannot run ``press`` (None: it can)."""
    name = kind.__name__
    if issubclass(kind, ComposedPress):
        presses = list(fields.get("presses") or [])
        if presses and holds(presses[-1], press) and not holds(presses[:-1], press):
            return None
        return (
            f"ComposedPress must have the SamplingPress last: a SamplingPress evicts every layer when the last "
            f"layer is reached, so a press after it would shorten layers 0..L-2 before the draw. Use instead: "
            f"ComposedPress([<other presses>, <the SamplingPress>])"
        )
    if issubclass(kind, PrefillDecodingPress):

        decoding = fields.get("decoding_press")
        if holds(fields.get("prefilling_press"), press) and (decoding is None or getattr(decoding, "keeps_correction", False)):
            return None
        return (
            f"{name} may hold a SamplingPress only as its prefilling_press, with decoding_press=None or a "
            f"SamplingDecodingPress: another decoding press would cut a cache whose entries carry correction weights "
            f"and drop them. Use instead: PrefillDecodingPress(prefilling_press=<the SamplingPress>, "
            f"decoding_press=SamplingDecodingPress(...))"
        )
    for refused, (why, instead) in REFUSED.items():
        if issubclass(kind, refused):
            return f"{name} cannot wrap a SamplingPress: {why}. Use instead: {instead}"
    return (
        f"{name} cannot wrap a SamplingPress: it has not been checked with one, and a wrapper that does not "
        f"call its forward_hook at every layer would silently skip the eviction. Use instead: the "
        f"SamplingPress alone, last in a ComposedPress, or as a PrefillDecodingPress's prefilling_press"
    )


def wrappers(press, module: nn.Module) -> list[BasePress]:
    """The presses hooked on ``module`` that hold ``press``, and every press between them and it,
    outermost first (empty when ``press`` runs alone or is called directly)."""
    found = []
    for owner in _owners(module):
        if owner is not press:
            chain = path_to(owner, press)
            found += [wrapper for wrapper in chain or [] if wrapper not in found]
    return found


def check(press, module: nn.Module) -> None:
    """Raise TypeError if ``press`` runs inside a kvpress wrapper (hooked on ``module``) that would not
    run it correctly."""
    for wrapper in wrappers(press, module):
        reason = refusal(type(wrapper), vars(wrapper), press)
        if reason is not None:
            raise TypeError(reason)


def refusal_message(press, module: nn.Module | None, method: str) -> str:
    """The error of a wrapper calling SamplingPress's ``method`` (which it does not offer) on ``module``."""
    for wrapper in wrappers(press, module) if isinstance(module, nn.Module) else []:
        reason = refusal(type(wrapper), vars(wrapper), press)
        if reason is not None:
            return reason
    return (
        f"SamplingPress has no per-layer {method}(): it draws every layer at once at the end of the prefill "
        f"(propose / evict). Use it alone, last in a ComposedPress, or as a PrefillDecodingPress's prefilling_press"
    )


def _owners(module: nn.Module) -> list[BasePress]:
    """The presses whose bound ``forward_hook`` is registered on ``module``."""
    owners = [getattr(hook, "__self__", None) for hook in getattr(module, "_forward_hooks", {}).values()]
    return [owner for owner in owners if isinstance(owner, BasePress)]


def _sampling_presses(container, depth: int = 0) -> list:
    """The SamplingPresses ``container`` (a press, or a list / tuple / dict of them) is or holds: the
    presses with its public compression API, ``propose`` and ``evict`` (``kvpress_prob.presses.sampling``
    imports this module, so it is not imported here)."""
    if isinstance(container, BasePress) and all(callable(getattr(type(container), name, None))
                                                for name in ("propose", "evict")):
        return [container]
    if depth > MAX_DEPTH:
        return []
    if isinstance(container, dict):
        container = list(container.values())
    if isinstance(container, BasePress):
        container = list(vars(container).values())
    if isinstance(container, (list, tuple)):
        return [press for item in container for press in _sampling_presses(item, depth + 1)]
    return []


def check_hooks(module: nn.Module) -> None:
    """Raise TypeError if a press hooked on ``module`` holds a SamplingPress in a wrapper that would
    not run it correctly (``check``). Reads the module's hooks only; a plain forward, or a press
    holding no SamplingPress, finds nothing to check."""
    for owner in _owners(module):
        for press in _sampling_presses(owner):
            check(press, module)
