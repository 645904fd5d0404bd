"""One-line descriptions of the registry presses, derived from the press objects themselves.

Nothing here is a second list of presses: ``describe(name)`` builds the press with
``kvpress_prob.registry.get_press`` and reads its class, its docstring and the dataclass fields
that differ from their defaults, so a press added to the registry is described without edits here.
"""

from __future__ import annotations

import dataclasses
import re

from kvpress_prob.registry import PRESSES, get_press

_SKIP_FIELDS = {"compression_ratio"}  # the sweep variable, not part of what a name means


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _differs(value, default) -> bool:
    if default is dataclasses.MISSING:
        return True
    try:
        return bool(value != default)
    except Exception:  # objects without a usable comparison count as changed
        return True


def spec(obj) -> str:
    """``Class(field=value, ...)`` with only the fields that differ from the class defaults. Nested
    presses, proposals, samplers and scorers are written the same way; a press's ``proposal`` or
    inner ``press`` comes first, without its field name."""
    name = type(obj).__name__
    if not dataclasses.is_dataclass(obj):
        return name
    parts = []
    for f in dataclasses.fields(obj):
        if not f.init or not f.repr or f.name in _SKIP_FIELDS:
            continue
        value = getattr(obj, f.name)
        nested = dataclasses.is_dataclass(value) and not isinstance(value, type)
        if nested and f.name in ("proposal", "press"):
            parts.append(spec(value))
        elif _differs(value, _default(f)):
            parts.append(f"{f.name}={spec(value) if nested else repr(value)}")
    return f"{name}({', '.join(parts)})" if parts else name


def first_sentence(cls: type) -> str:
    """The first sentence of a class docstring (its first paragraph, joined), or ''."""
    paragraph = re.split(r"\n\s*\n", (cls.__doc__ or "").strip())[0]
    text = " ".join(paragraph.split())
    match = re.match(r"(.+?\.)(?=\s+[A-Z(]|$)", text)  # "et al. 2023" does not end it
    return match.group(1) if match else text


def design(sampler) -> str:
    """A sampler's name for its design: its docstring's first sentence up to a colon or a parenthesis."""
    return re.split(r":| \(", first_sentence(type(sampler)), maxsplit=1)[0].rstrip(".")


def _correction(press) -> str:
    if not getattr(press, "correct", True) or getattr(press, "temperature", 1.0) == float("inf"):
        return "uncorrected (plain renormalisation over the kept entries)"
    if not getattr(getattr(press, "sampler", None), "random", True):
        return "deterministic"
    temperature = getattr(press, "temperature", 1.0)
    return "SNIS-corrected" + ("" if temperature == 1.0 else f" at temperature {temperature:g}")


def describe(name: str) -> str:
    """One line: the press's construction and what it does (see the module docstring)."""
    from kvpress_prob.press import SamplingPress

    press = get_press(name, 0.5)
    if isinstance(press, SamplingPress):
        what = f"{design(press.sampler)}; {_correction(press)}"
        if press.budget != "global":
            what += f"; one budget per {press.budget}"
    else:
        inner = getattr(press, "press", None)
        what = "top-k (kvpress): " + first_sentence(type(press))
        if inner is not None and dataclasses.is_dataclass(inner):
            what += " Scores: " + first_sentence(type(inner))
    return f"{spec(press)}: {what}"


def press_lines() -> list[str]:
    """``name  description`` for every registry press, in registry order, names aligned."""
    width = max(map(len, PRESSES))
    return [f"{name:<{width}}  {describe(name)}" for name in PRESSES]
