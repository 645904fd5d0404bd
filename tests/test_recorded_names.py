"""Every press name recorded under results/ (archive included) builds today, through the rename map beside the
records (results/renames.json).

A recorded name is the ``press`` of a row of any ``*.jsonl`` under results/, or a word after ``--presses`` in a
manifest's command. It is read as one of:

- an anchor of the map: the full-cache reference, or a press of kvpress built as shipped by the bench that
  recorded it (each built here by that bench's own builder);
- a name the map renames: the label it maps to builds, and the old name no longer does;
- a design the map withdraws: the registry refuses it, and the nearest design named beside it builds;
- a decoding press of the streaming harness (``evaluation.tasks.streaming.presses.stream_presses``);
- a registry name (``kvpress_prob.names.registry.get_press``), optionally with overrides: ``name[field=value,...]``
  (the runner's labels) or ``name@tau=T@budget=B`` (the fidelity bench's labels before the runner's were used).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from kvpress_prob.names.registry import get_press
from tests.kept_snapshot import record_sources

ROOT = Path(__file__).resolve().parents[1]
RENAMES = json.loads((ROOT / "results" / "renames.json").read_text())


def recorded_names() -> dict[str, str]:
    """Every press name recorded under results/ (any ``*.jsonl``, and the manifests) -> one file that records it."""
    return {name: str(Path(path).relative_to(ROOT)) for name, path in record_sources("*.jsonl").items()}


NAMES = recorded_names()


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    try:
        return float(text)
    except ValueError:
        return text


@functools.cache
def _schedule():
    from evaluation.tasks.streaming.drive import Schedule

    return Schedule(n=1024, budget=256, chunk=32, interval=32)


def _decoding_bench(name: str):
    from experiments.decoding import build

    return build(name, target=256, interval=32, window=32, seed=0, tokens_per_step=1)


def _stream(name: str):
    from evaluation.tasks.streaming.presses import stream_presses

    return stream_presses()[name](_schedule(), 0, 64)


def _price_anchor(name: str):
    from evaluation.bench.speed.price_one import ANCHORS

    return ANCHORS[name](0.5)


#: anchor -> how the bench that recorded it builds it (None: the reference, no press)
ANCHOR_BUILDERS = {"full": lambda name: None, "kvpress_kvzip": _price_anchor, "kvpress_streaming_llm": _stream,
                   "kvpress_tova": _decoding_bench, "kvpress_knorm": _decoding_bench}


def build(label: str, ratio: float = 0.5):
    """The press a recorded label names, today."""
    if "@" in label:
        from evaluation.bench.fidelity.tables import legacy_setting

        return legacy_setting(label, ratio).build()
    name, _, rest = label.partition("[")
    overrides = {k: _value(v) for k, v in (item.split("=", 1) for item in rest[:-1].split(","))} if rest else {}
    return get_press(name, ratio, **overrides)


def route(name: str) -> str:
    if name in RENAMES["anchors"]:
        return "anchor"
    if name in RENAMES["renamed"]:
        return "renamed"
    if name in RENAMES["withdrawn"]:
        return "withdrawn"
    if name.startswith(("decode_", "prob_decode_")):
        return "stream"
    return "registry"


@pytest.mark.parametrize("name", sorted(NAMES), ids=str)
def test_every_recorded_name_builds_today(name):
    how = route(name)
    if how == "anchor":
        press = ANCHOR_BUILDERS[name](name)
        assert (press is None) == (name == "full"), name
    elif how == "renamed":
        with pytest.raises(ValueError):
            build(name)  # else the old name still builds and the map would give it a second meaning
        assert build(RENAMES["renamed"][name]) is not None
    elif how == "withdrawn":
        with pytest.raises(ValueError, match="biased"):
            build(name)
        assert build(RENAMES["withdrawn"][name]["nearest"]) is not None
    elif how == "stream":
        assert _stream(name) is not None
    else:
        assert build(name) is not None, f"{name} ({NAMES[name]})"


def test_the_map_covers_the_records_and_nothing_else():
    """Every entry of the map is a name some record uses, and every anchor has its builder here."""
    assert len(NAMES) > 200 and "topk_kvzip_ragged" in NAMES and any("/archive/" in p for p in NAMES.values())
    mapped = set(RENAMES["anchors"]) | set(RENAMES["renamed"]) | set(RENAMES["withdrawn"])
    assert mapped <= set(NAMES), f"map entries no record uses: {sorted(mapped - set(NAMES))}"
    assert set(ANCHOR_BUILDERS) == set(RENAMES["anchors"])
    from tests import kept_snapshot as ks

    snapshot_names = ks.record_names()  # the kept-set snapshots' coverage reads the archive too
    assert snapshot_names <= set(NAMES) and "topk_kvzip_ragged" in snapshot_names
    from evaluation.engine.runner import REFERENCE

    assert REFERENCE == "full"


def test_a_label_reads_its_overrides():
    press = build("prob_snapkv[sampler=topk,budget=head]")
    assert press.budget == "head" and type(press.sampler).__name__ == "TopKSampler"
    assert build("prob_min_h[temperature=inf]").temperature == math.inf
    assert build("prob_snapkv@tau=2@budget=layer").budget == "layer"
    with pytest.raises(ValueError):
        build("no_such_press")
