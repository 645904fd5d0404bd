"""What ``kvprob presses`` prints: the registry's families by origin (``family_table``), one press
(``press_detail``), and one-line descriptions derived from the press objects themselves.

Nothing here is a second list of presses: ``describe(name)`` builds the press with
``kvpress_prob.names.registry.get_press`` and reads its class, its docstring and the dataclass fields
that differ from their defaults; families, statuses and findings come from ``kvpress_prob.names.catalogue``;
the recommendations, their quality, price and evidence from ``evaluation.report.recommended``.
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


_ORIGINS = {"kvpress": "kvpress's presses (baselines)", "paper": "the paper's presses (Geh et al. 2026)",
            "ours": "beyond the paper (ours)"}


def family_table(every: bool = False) -> list[str]:
    """``kvprob presses``: one block per family, grouped by origin; ``every``: each name on its line; then the
    four recommendations (``recommended_lines``) and the counts (``kvpress_prob.names.registry.counts``)."""
    from kvpress_prob.names.catalogue import FAMILIES, STATUSES
    from kvpress_prob.names.registry import counts

    lines, origin = [], None
    for (org, family), entries in _grouped().items():
        if org != origin:
            origin = org
            lines += ["", f"== {_ORIGINS[org]} =="]
        fam = FAMILIES[family]
        status = ", ".join(f"{sum(e.status == s for e in entries)} {s}" for s in STATUSES
                           if any(e.status == s for e in entries))
        lines.append(f"{family:<20} {len(entries):>3}  {fam.pattern}")
        lines += textwrap.wrap(f"{status}. {fam.finding}", 100, initial_indent=" " * 25, subsequent_indent=" " * 25)
        if every:
            lines.append(f"{'':<25}{fam.paper}; {fam.docs}")
            width = max(len(e.name) for e in entries)
            lines += [f"    {e.name:<{width}}  {e.status:<11}  {e.finding}" for e in entries]
    n = counts()
    lines += ["", "recommended (kvprob recommended: each one's evidence; kvprob presses RECOMMENDED: one):",
              *recommended_lines(),
              "", *textwrap.wrap(
                  f"{n['prefill']} prefill presses (get_press) and {n['decoding']} decoding presses (get_decoding_press) "
                  "ship; the families above list the prefill presses and the main decoding ones. kvprob presses --all "
                  "lists every name; kvprob presses NAME shows one. Any valid grid name builds "
                  "(kvpress_prob/names/grid.py).", 100)]
    return lines[1:]


def recommended_lines() -> list[str]:
    """Per recommendation: its label, constant and press; its quality with the evidence; its price."""
    from evaluation.report import recommended as rec
    from evaluation.report.price import COLUMNS

    lines = []
    for r in rec.rows():
        lines += [f"  {r.label:<10} {r.constant} = {r.press}",
                  f"{'':<13}worst q {rec.quality_cell(r)}, q RULER / prose / recall {rec.regimes_cell(r)}",
                  f"{'':<13}evidence: {rec.evidence_cell(r)}",
                  f"{'':<13}over snapkv's: " + (rec.NO_PRICE if r.price is None else ", ".join(
                      f"{name.split(' /')[0]} {r.price.cell(f)}" for f, name in COLUMNS.items()))]
    return lines


def _family(name: str, entry, parts):
    """The family of a name: its catalogue entry's, its grid parts', or that of the named press it is."""
    from kvpress_prob.names.catalogue import FAMILIES, family_of
    from kvpress_prob.names.named import ENTROPY_HYBRIDS

    if entry is not None:
        return FAMILIES[entry.family]
    if parts is not None:
        return FAMILIES[family_of(parts)]
    return FAMILIES["entropy hybrids" if name in ENTROPY_HYBRIDS else "top-k twins"]


def press_detail(name: str) -> list[str]:
    """``kvprob presses NAME`` (a name ``get_press`` builds, a catalogued decoding press, or one of the registry's
    ``RECOMMENDED*`` constants): the name's parts, its construction, its status, and, for a recommended press,
    what it is recommended for with its quality and evidence (``evaluation.report.recommended``); its price."""
    from evaluation.report import recommended as rec
    from kvpress_prob.names import registry
    from kvpress_prob.names.grid import parse_name
    from kvpress_prob.names.named import NAMED

    alias = name if name in rec.LABELS else None
    name = getattr(registry, alias) if alias else name
    entry = registry.CATALOGUE.get(name)
    parts = entry.parts if entry else None if name in NAMED else parse_name(name)
    family = _family(name, entry, parts)
    lines = [f"{alias} ({rec.LABELS[alias]}) = {name}" if alias else name]
    if parts is not None:
        opts = ", ".join(parts.options) or "none"
        lines.append(f"  parts:   kind {parts.kind}, proposal {parts.proposal}, unit {parts.unit}, "
                     f"design {parts.design}, options {opts}")
    built = describe(name) if name in registry.PRESSES or entry is None else "built by its own factory, not get_press"
    lines += [f"  press:   {built}",
              f"  origin:  {family.origin}, family {family.name} ({family.paper})"]
    if entry:
        lines.append(f"  status:  {entry.status}: {entry.finding} ({entry.docs})")
    elif name in NAMED:
        lines.append(f"  status:  not registered (built by name: kvpress_prob/names/named.py; {family.finding})")
    else:
        lines.append("  status:  not registered (a valid grid name, never measured)")
    for r in [rec.recommendation(c) for c in rec.LABELS if getattr(registry, c) == name]:
        lines += [f"  recommended: {r.label} ({r.constant}): {r.purpose}",
                  f"  quality: worst q {rec.quality_cell(r)}; q RULER / prose / recall {rec.regimes_cell(r)}",
                  f"  evidence: {rec.evidence_cell(r)}; {r.evidence.table if r.evidence else rec.NO_QUALITY}"]
    return lines + [f"  price:   {price_line(name)}"]


def price_line(name: str, path=None) -> str:
    """The press's price over snapkv's (``evaluation.report.recommended.price_of``: the newest price record that
    prices it, with the range over every record; only the record at ``path`` where given), or why there is none."""
    from evaluation.report import price
    from evaluation.report import recommended as rec

    records = None if path is None else [(str(path), price.load(path))] if price.maybe_load(path) is not None else []
    return rec.price_line(name, rec.price_of(name, records))
