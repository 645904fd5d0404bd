"""What ``kvprob presses`` prints: the registry's families by origin (``family_table``), one press
(``press_detail``), and one-line descriptions derived from the press objects themselves.

Nothing here is a second list of presses: ``describe(name)`` builds the press with
``kvpress_prob.names.registry.get_press`` and reads its class, its docstring and the dataclass fields
that differ from their defaults; families, statuses and findings come from ``kvpress_prob.names.catalogue``.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap

from kvpress_prob.names.registry import get_press

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
    from kvpress_prob.presses.sampling import SamplingPress

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


def _grouped() -> dict[tuple[str, str], list]:
    from kvpress_prob.names.catalogue import FAMILIES
    from kvpress_prob.names.registry import CATALOGUE

    groups = {(f.origin, f.name): [] for f in FAMILIES.values()}
    for entry in CATALOGUE.values():
        groups[(entry.origin, entry.family)].append(entry)
    return {key: entries for key, entries in groups.items() if entries}


STATUSES = ("recommended", "measured", "rejected", "unmeasured")
_ORIGINS = {"kvpress": "kvpress's presses (baselines)", "paper": "the paper's presses (Geh et al. 2026)",
            "ours": "beyond the paper (ours)"}


def family_table(every: bool = False) -> list[str]:
    """``kvprob presses``: one block per family, grouped by origin; ``every``: each name on its line."""
    from kvpress_prob.names.catalogue import FAMILIES
    from kvpress_prob.names.registry import CATALOGUE, RECOMMENDED

    lines, origin = [], None
    for (org, family), entries in _grouped().items():
        if org != origin:
            origin = org
            lines += ["", f"== {_ORIGINS[org]} =="]
        fam = FAMILIES[family]
        counts = ", ".join(f"{sum(e.status == s for e in entries)} {s}" for s in STATUSES
                           if any(e.status == s for e in entries))
        lines.append(f"{family:<20} {len(entries):>3}  {fam.pattern}")
        lines += textwrap.wrap(f"{counts}. {fam.finding}", 100, initial_indent=" " * 25, subsequent_indent=" " * 25)
        if every:
            lines.append(f"{'':<25}{fam.paper}; {fam.docs}")
            width = max(len(e.name) for e in entries)
            lines += [f"    {e.name:<{width}}  {e.status:<11}  {e.finding}" for e in entries]
    recommended = [e for e in CATALOGUE.values() if e.status == "recommended"]
    lines += ["", "recommended:"]
    for e in recommended:
        lines += textwrap.wrap(f"{e.name}{' (RECOMMENDED)' if e.name == RECOMMENDED else ''}: {e.finding}", 100,
                               initial_indent="    ", subsequent_indent="        ")
    lines += ["", f"{len(CATALOGUE)} registered presses. kvprob presses --all lists every name; kvprob presses "
              "NAME shows one. Any valid grid name builds (kvpress_prob/names/grid.py)."]
    return lines[1:]


def press_detail(name: str) -> list[str]:
    """``kvprob presses NAME``: the name's parts, its construction and its status line."""
    from kvpress_prob.names.catalogue import FAMILIES, family_of
    from kvpress_prob.names.grid import parse_name
    from kvpress_prob.names.registry import CATALOGUE, PRESSES

    entry = CATALOGUE.get(name)
    parts = entry.parts if entry else parse_name(name)
    family = FAMILIES[entry.family if entry else family_of(parts)]
    lines = [name]
    if parts is not None:
        opts = ", ".join(parts.options) or "none"
        lines.append(f"  parts:   kind {parts.kind}, proposal {parts.proposal}, unit {parts.unit}, "
                     f"design {parts.design}, options {opts}")
    built = describe(name) if name in PRESSES or entry is None else "built by its own factory, not get_press"
    lines += [f"  press:   {built}",
              f"  origin:  {family.origin}, family {family.name} ({family.paper})"]
    if entry:
        lines.append(f"  status:  {entry.status}: {entry.finding} ({entry.docs})")
    else:
        lines.append("  status:  not registered (a valid grid name, never measured)")
    return lines + [f"  price:   {price_line(name)}"]


def price_line(name: str, path=None) -> str:
    """The press's price over snapkv's from the price record (``evaluation.report.price``), or why there is none."""
    from evaluation.report import price

    path = price.RECORD if path is None else path
    record = price.maybe_load(path)
    if record is None or name not in record.index:
        return f"{price.MISSING} (no price record for {name}: python -m evaluation.bench price --presses {name})"
    row = record.loc[name]
    return (f"over snapkv's, median [range] of {row['rounds']} rounds on {row['device']} at n = {row['n']}, "
            f"r = {row['ratio']:g}: prefill time {price.cell(row, 'prefill')}, prefill peak {price.cell(row, 'peak')}, "
            f"decode step {price.cell(row, 'decode')} (decoded by {row['decode_route']}); {row['command']}")
