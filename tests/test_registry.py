"""The registry as a grid: every name of the registry at main a1ed234 builds an equal press (the
snapshot in tests/data, written by tests/registry_snapshot.py from that commit's code), names parse
back into their parts, wrong parts are refused with the valid ones, and every entry has an origin
and a status with its finding."""

import json
import re
from pathlib import Path

import pytest
from registry_snapshot import DATA, RATIOS, tree

from kvpress_prob.names.catalogue import FAMILIES
from kvpress_prob.names.grid import Parts, build, parse_name, press_name
from kvpress_prob.presses.sampling import SamplingPress
from kvpress_prob.names.registry import CATALOGUE, PRESSES, RECOMMENDED, RECOMMENDED_FAST, get_press, is_sampling
from kvpress_prob.samplers.block import BlockSampler
from kvpress_prob.samplers.priority import PrioritySampler

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = json.loads((DATA / "registry-a1ed234.json").read_text())
#: Names of the snapshot no longer registered, each with its reason.
REMOVED: dict[str, str] = {name: "priority over widened spans: biased weights, removed (issue 19 item 1)"
                           for name in ("prob_tova_span8_priority", "prob_keydiff_span8_priority_ent")}
#: Classes that moved module since the snapshot: old path -> new path (kvprob-rewrite: keep) (the registry's own H2O press moved to
#: the h2o module, then the package was laid out in layers).
MOVED = {
    "kvpress_prob.registry.EagerObservedAttentionPress": "kvpress_prob.presses.h2o.EagerObservedAttentionPress",
    "kvpress_prob.calibration.CalibratedProposal": "kvpress_prob.proposals.calibrated.CalibratedProposal",
    "kvpress_prob.press.SamplingPress": "kvpress_prob.presses.sampling.SamplingPress",
    "kvpress_prob.proposals.H2OProposal": "kvpress_prob.proposals.attention.H2OProposal",
    "kvpress_prob.proposals.MinVarianceProposal": "kvpress_prob.proposals.attention.MinVarianceProposal",
    "kvpress_prob.proposals.SampledMinVarianceProposal": "kvpress_prob.proposals.attention.SampledMinVarianceProposal",
    "kvpress_prob.proposals.ScoreProposal": "kvpress_prob.proposals.base.ScoreProposal",
    "kvpress_prob.spans.SpanPress": "kvpress_prob.presses.spans.SpanPress",
    "kvpress_prob.spans.SpanSampler": "kvpress_prob.samplers.spans.SpanSampler",
    **{f"kvpress_prob.summary.{c}": f"kvpress_prob.presses.summary.{c}" for c in ("Summary", "SummaryPress",
                                                                                 "SummarySamplingPress")},
}
#: Init fields added to a class since the snapshot: name -> why (a new field is ignored only if named here).
NEW_FIELDS: dict[str, str] = {"prefill": "issue 21: the global-budget prefill mode (auto by default, issue 27); the draw and kept set of deferred"}


def moved(node):
    if isinstance(node, dict):
        return {k: (MOVED.get(v, v) if k == "class" else moved(v)) for k, v in node.items()}
    return [moved(x) for x in node] if isinstance(node, list) else node


def without_new_fields(new, old):
    """``new`` without the fields of ``NEW_FIELDS`` that ``old`` (the snapshot) does not have, recursively."""
    if isinstance(new, dict) and isinstance(old, dict):
        keep = {k: v for k, v in new.items() if k in old or not (k in NEW_FIELDS and "fields" not in new)}
        return {k: without_new_fields(v, old.get(k)) for k, v in keep.items()}
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        return [without_new_fields(a, b) for a, b in zip(new, old)]
    return new


def test_every_snapshot_name_builds_an_equal_press():
    """Shipped or not: every name of the snapshot builds by name (``PRESSES`` finds the names it does not list)."""
    assert all(name in PRESSES for name in set(SNAPSHOT) - set(REMOVED))
    assert not any(name in PRESSES for name in REMOVED)
    for name in sorted(set(SNAPSHOT) - set(REMOVED)):
        for r in RATIOS:
            old = moved(SNAPSHOT[name][str(r)])
            assert without_new_fields(json.loads(json.dumps(tree(get_press(name, r)))), old) == old, (name, r)


def test_parts_whose_name_reads_back_as_another_press_are_refused():
    """min_h with sharpness 256 is written prob_min_h_s256, the name of proposal min_h_s256 (sampled query
    rows): building those parts would give a press that its own name does not build (issue 25 item 5)."""
    from kvpress_prob.names.grid import check
    from kvpress_prob.proposals.attention import MinVarianceProposal, SampledMinVarianceProposal

    ambiguous = Parts("prob", "min_h", "token", "poisson", ("s256",))
    assert press_name(ambiguous) == "prob_min_h_s256"
    with pytest.raises(ValueError, match="'min_h'.*written like proposal 'min_h_s256'"):
        check(ambiguous)
    with pytest.raises(ValueError, match="written like proposal"):
        build(ambiguous, 0.5)
    assert type(get_press("prob_min_h_s256", 0.5).proposal) is SampledMinVarianceProposal
    # another sharpness has one reading, and it round-trips
    sharp = Parts("prob", "min_h", "token", "poisson", ("s2",))
    assert parse_name(press_name(sharp)) == sharp
    assert build(sharp, 0.5).proposal == MinVarianceProposal(harmonic=True, sharpness=2.0)


def test_names_parse_back_into_their_parts():
    for name, entry in CATALOGUE.items():
        if entry.parts is not None:  # NAMED presses stand outside the grammar
            assert parse_name(name) == entry.parts and press_name(entry.parts) == name
    # written by hand, not by the grid
    assert parse_name("prob_tova_block8_priority") == Parts("prob", "tova", "block8", "priority", ())
    assert parse_name("prob_tova_block8") == Parts("prob", "tova", "block8", "threshold", ())
    assert parse_name("prob_min_h_s256") == Parts("prob", "min_h_s256", "token", "poisson", ())
    assert parse_name("prob_min_h_strata_nocorr") == Parts("prob", "min_h", "token", "poisson", ("strata", "nocorr"))
    assert parse_name("hybrid_keydiff_block8_a75_global_sum4") == Parts(
        "hybrid", "keydiff", "block8", "stratified", ("a75", "global", "sum4"))
    assert parse_name("expected_attention_adaptive") == Parts("adaptive", "expected_attention", "token", "topk", ())
    assert parse_name("keydiff_sum16_tau0.5") == Parts("kvpress", "keydiff", "token", "topk", ("sum16", "tau0.5"))
    assert parse_name("topk_tova_span8_nowiden") == Parts("topk", "tova", "span8", "topk", ("nowiden",))


@pytest.mark.parametrize("name, wrong", [
    ("prob_nope", "no proposal"),
    ("prob_tova_blok8", r"unknown part\(s\) \['blok8'\]"),
    ("hybrid_keydiff_block8", "a<percent>"),
    ("adakv_expected_attention", "already runs under AdaKV"),
    ("prob_tova_poisson", "is the default"),
    ("prob_tova_block8_priority_head", "repeats the default"),
    ("prob_tova_threshold_strata", "applies to the poisson design"),
    ("prob_tova_nocorr_s4", "out of order"),
    ("prob_tova_span8", "span units take the priority design"),
    ("prob_tova_span8_priority", "biased weights"),
    ("prob_min_h_rank", "calibrate one kvpress scorer"),
    ("h2o_adaptive", "no scorer"),
    ("keydiff_block8", "keeps tokens"),
    ("adakv_tova_sum4", "not AdaKV"),
])
def test_a_wrong_part_is_refused_with_the_valid_parts(name, wrong):
    with pytest.raises(ValueError, match=wrong) as error:
        get_press(name, 0.5)
    assert "Valid parts: kinds" in str(error.value) and "block<k>" in str(error.value)


def test_an_unregistered_valid_name_builds_what_it_says():
    assert "prob_lagkv_block8_priority" not in CATALOGUE and "prob_lagkv_block8_priority" not in list(PRESSES)
    assert "prob_lagkv_block8_priority" in PRESSES and "prob_lagkv_blok8" not in PRESSES and "full" not in PRESSES
    press = get_press("prob_lagkv_block8_priority", 0.3, seed=2)
    assert isinstance(press, SamplingPress) and press.budget == "head" and press.seed == 2
    assert type(press.proposal.scorer).__name__ == "LagKVPress"
    assert isinstance(press.sampler, BlockSampler) and press.sampler.size == 8
    assert isinstance(press.sampler.inner, PrioritySampler) and press.compression_ratio == 0.3
    assert is_sampling("prob_lagkv_block8_priority") and not is_sampling("topk_lagkv_block16")
    assert build(parse_name("topk_lagkv_block16"), 0.5).sampler.size == 16


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_entry_has_an_origin_a_status_and_a_finding_in_the_docs():
    statuses = {"measured", "learned"}  # what ships; which presses are recommended is the registry's constants alone
    for entry in CATALOGUE.values():
        assert entry.origin in ("kvpress", "paper", "ours") and entry.status in statuses, entry
        assert entry.finding and entry.family in FAMILIES, entry
    assert RECOMMENDED in CATALOGUE and RECOMMENDED_FAST in CATALOGUE
    learned = {name for name, entry in CATALOGUE.items() if entry.status == "learned"}
    assert learned and not learned & set(dict.keys(PRESSES)) and all(name in PRESSES for name in learned)
    assert {e.origin for e in CATALOGUE.values() if e.name == "snapkv" or e.name.startswith("adakv_")} == {"kvpress"}
    assert CATALOGUE["prob_min_h"].origin == "paper" and CATALOGUE["prob_min_h_ht"].origin == "ours"
    assert {e.family for e in CATALOGUE.values()} == {f.name for f in FAMILIES.values() if f.status != "dropped"}
    for family in FAMILIES.values():  # each family's findings are a docs section that exists
        path, _, anchor = family.docs.partition("#")
        text = (ROOT / path).read_text()
        anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
        assert not anchor or anchor in anchors, (family.name, family.docs)


def test_a_field_added_since_the_snapshot_is_ignored_only_when_named(monkeypatch):
    old = {"class": "P", "fields": {"a": "1", "inner": {"class": "S", "fields": {"b": "2"}}}}
    new = {"class": "P", "fields": {"a": "1", "prefill": "'x'", "inner": {"class": "S", "fields": {"b": "2", "c": "3"}}}}
    assert without_new_fields(new, old) != old
    monkeypatch.setitem(NEW_FIELDS, "prefill", "test")
    monkeypatch.setitem(NEW_FIELDS, "c", "test")
    assert without_new_fields(new, old) == old
    new["fields"]["a"] = "2"  # a changed field still counts
    assert without_new_fields(new, old) != old


def test_every_rejected_name_keeps_its_row_and_reason_in_the_docs_and_none_ships():
    text = (ROOT / "docs" / "presses.md").read_text().split("## Rejected designs", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \| ([\w -]+) \| (.+) \|$", text, re.M)
    assert len(rows) >= 20
    for name, family, why in rows:
        assert name not in CATALOGUE and why, name
        if name not in REMOVED:
            assert name in PRESSES, name  # still builds by name
    for name in REMOVED:
        assert f"| `{name}` |" in text, name


def test_a_decoding_press_name_points_to_get_decoding_press():
    """get_press is for ratios at prefill; a decoding press's name says where it is built (issue 25 item 5)."""
    from kvpress_prob.names.decoding import DECODING_PRESSES

    for name in ("prob_decode_attn_priority", "decode_knorm_topk"):
        assert name in DECODING_PRESSES
        with pytest.raises(ValueError, match=rf"decoding press.*get_decoding_press\('{name}', target_size"):
            get_press(name, 0.5)


def test_every_old_decoding_name_still_builds():
    """The 35 decoding presses the catalogue listed at 7ab10c4: 17 ship, every one still builds by name."""
    from kvpress_prob.names.decoding import DECODING_PRESSES, get_decoding_press

    base = ["decode_streaming_llm", "decode_knorm_topk", "decode_tova_topk", "decode_keydiff_topk", "decode_attn_topk",
            "decode_h2o_topk", "decode_min_variance_topk"]
    sampled = ["prob_decode_attn_priority", "prob_decode_h2o_priority", "prob_decode_min_variance_priority",
               "prob_decode_tova_priority", "prob_decode_attn_threshold", "prob_decode_attn_stratified",
               "prob_decode_attn_block4", "prob_decode_attn_vase", "prob_decode_min_variance_h_priority",
               "prob_decode_min_variance_priority_t2", "prob_decode_min_variance_priority_cap16",
               "prob_decode_min_variance_priority_renorm", "prob_decode_min_variance_priority_floor20"]
    layers = "prob_decode_min_variance_priority_floor20_layers"
    old = base + sampled + [f"{n}_nocorr" for n in sampled] + [layers, f"{layers}_nocorr"]
    heads = "prob_decode_min_variance_priority_floor20_heads"
    assert list(DECODING_PRESSES) == old + [heads, f"{heads}_nocorr", "decode_attn_topk_heads"]  # then the per-head ones
    for name in old:
        press = get_decoding_press(name, 64, 8)
        assert press.correct == (not name.endswith("_nocorr")), name
    assert {n for n, e in CATALOGUE.items() if e.family == "decoding"} == set(base + sampled[:8]) | {
        "prob_decode_min_variance_priority_floor20", layers, heads, "decode_attn_topk_heads"}
