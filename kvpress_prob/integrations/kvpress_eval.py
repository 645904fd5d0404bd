"""Our presses in kvpress's own evaluation harness (``evaluation/evaluate.py`` of the kvpress repository).

kvpress's harness names presses through ``PRESS_REGISTRY`` in ``evaluation/evaluate_registry.py``:
a dict from a name to a press *instance* (or None for "no_press"). ``evaluate.py`` looks the name
up, sets ``press.compression_ratio`` on that instance (for presses outside its special cases:
DuoAttention, DMS, Composed, ThinK, Decoding) and runs its pipeline with it. ``register`` adds our
presses to such a dict, built by ``kvpress_prob.names.registry.get_press`` at ratio 0 (evaluate.py sets
the ratio it is asked for).

Two ways to use it, from kvpress's ``evaluation/`` folder (that folder is not in the kvpress wheel:
clone https://github.com/NVIDIA/kvpress):

1. add two lines at the end of ``evaluate_registry.py``::

       from kvpress_prob.integrations.kvpress_eval import register
       register(PRESS_REGISTRY)

2. or leave it untouched and launch evaluate.py through this module, which registers first::

       cd kvpress/evaluation
       python -m kvpress_prob.integrations.kvpress_eval --dataset ruler --data_dir 4096 \\
           --model Qwen/Qwen3-4B --press_name prob_min_h --compression_ratio 0.5
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Iterable, MutableMapping

from kvpress import BasePress

from kvpress_prob.names import registry
from kvpress_prob.names.registry import PRESSES, get_press

#: The registry's recommendations (``RECOMMENDED``, ``RECOMMENDED_FAST``, ``RECOMMENDED_PROSE``,
#: ``RECOMMENDED_RETRIEVAL``, ``RECOMMENDED_SLOW``).
RECOMMENDATIONS = ("RECOMMENDED", "RECOMMENDED_FAST", "RECOMMENDED_PROSE", "RECOMMENDED_RETRIEVAL", "RECOMMENDED_SLOW")


def default_names() -> list[str]:
    """Every shipped prefill press (``PRESSES``), then each recommended press ``PRESSES`` does not list
    (``RECOMMENDED_FAST``'s gate press is built by name only: the catalogue's sweeps run on random models,
    which have no trained gate)."""
    names = list(dict.keys(PRESSES))
    return names + [p for p in dict.fromkeys(getattr(registry, c) for c in RECOMMENDATIONS) if p not in names]


def _settable_fields(press: BasePress) -> set[str]:
    """Field names ``get_press`` accepts as overrides: the press's own, its sampler's and its proposal's."""
    parts = [press, getattr(press, "sampler", None), getattr(press, "proposal", None)]
    return {f.name for part in parts if dataclasses.is_dataclass(part) for f in dataclasses.fields(part) if f.init}


def press_instances(names: Iterable[str] | None = None, prefix: str = "", **overrides) -> dict[str, BasePress]:
    """``{prefix + name: press}`` for our registry ``names`` (default: all), each at compression
    ratio 0 with ``overrides`` applied to the presses that have those fields (``seed=1``; a field
    of the sampler or the proposal, e.g. ``chunk_size=256``, as ``get_press`` takes it)."""
    names = default_names() if names is None else list(names)
    unknown = [n for n in names if n not in PRESSES]
    if unknown:
        raise ValueError(f"unknown press(es) {unknown}; valid names: {', '.join(sorted(PRESSES))}")
    out, used = {}, set()
    for name in names:
        press = get_press(name, 0.0)
        fields = _settable_fields(press)
        applicable = {k: v for k, v in overrides.items() if k in fields}
        used |= set(applicable)
        out[prefix + name] = get_press(name, 0.0, **applicable) if applicable else press
    if set(overrides) - used:
        raise ValueError(f"no selected press has the field(s) {sorted(set(overrides) - used)}")
    return out


def register(
    press_registry: MutableMapping[str, BasePress | None],
    names: Iterable[str] | None = None,
    *,
    prefix: str = "",
    overwrite: bool = False,
    **overrides,
) -> list[str]:
    """Add our presses to kvpress's ``PRESS_REGISTRY`` (in place) and return the names added.

    Parameters
    ----------
    press_registry : dict
        kvpress's ``evaluate_registry.PRESS_REGISTRY`` (name -> press instance or None).
    names : iterable of str, optional
        Our registry names to add. Default: every name of ``default_names()`` (the shipped presses and the
        four recommendations) that kvpress does not already have (kvpress's
        own ``snapkv``, ``tova``, ``knorm``, ``streaming_llm``, ``adakv_snapkv`` are the same
        presses, so they are left as they are).
    prefix : str, default ""
        Prepended to every added name (e.g. "kvprob_" to keep ours apart).
    overwrite : bool, default False
        Whether a name given explicitly in ``names`` may replace an entry already there; without
        it such a name raises ValueError.
    **overrides
        Dataclass fields set on every press that has them (``seed``, ``budget``, ``temperature``...).
    """
    if not isinstance(press_registry, MutableMapping):
        raise TypeError(f"press_registry must be a dict (kvpress's PRESS_REGISTRY), got {type(press_registry).__name__}")
    explicit = names is not None
    presses = press_instances(names, prefix, **overrides)
    clashes = [name for name in presses if name in press_registry]
    if clashes and explicit and not overwrite:
        raise ValueError(f"press_registry already has {clashes}; pass overwrite=True to replace them, "
                         "or a prefix to add ours under other names")
    added = []
    for name, press in presses.items():
        if name in press_registry and not (explicit and overwrite):
            continue
        press_registry[name] = press
        added.append(name)
    return added


def main(argv: list[str] | None = None) -> None:
    """Register every press into ``evaluate_registry.PRESS_REGISTRY`` (imported from the current
    folder: run it from kvpress's ``evaluation/``), then run kvpress's ``evaluate.py`` command line."""
    import os

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        import evaluate_registry
    except ImportError as error:
        sys.exit(f"kvpress_prob.integrations.kvpress_eval: run this from kvpress's evaluation/ folder "
                 f"(git clone https://github.com/NVIDIA/kvpress; cd kvpress/evaluation): {error}")
    register(evaluate_registry.PRESS_REGISTRY)
    import evaluate
    from fire import Fire

    Fire(evaluate.CliEntryPoint, command=sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
