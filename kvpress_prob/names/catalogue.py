"""What ships: the presses that ``PRESSES`` holds and ``kvprob presses`` lists, each with its origin
(``kvpress``, ``paper``, ``ours``), its family and a one-word status.

Statuses: ``measured`` (decoded on a split and kept as a design a user may want), ``learned`` (measured, and
scored by an artefact trained for each model, which ships for the embedded model alone: ``PRESSES`` and the sweeps
over it, which run presses on any model, leave these out; they build by name), ``dropped`` (a family whose names
no longer ship; they still build by name). Which presses are recommended is the registry's
``RECOMMENDED*`` constants alone. The findings behind each family, with their numbers, are in the document named
by ``Family.docs``.

Any name the grid reads (``kvpress_prob.names.grid``) or ``kvpress_prob.names.named`` lists builds through
``get_press``, shipped or not, so a record that names a dropped press stays reproducible.

Adding a press: its module (a dataclass press, or a proposal or sampler the grid composes), then one entry
here: its grid point in ``SHIPPED`` (and its option or part in ``grid``), or, for a press outside the
grammar, its factory in ``named.NAMED`` and its name in ``NAMED_SHIPPED``; a new family adds a ``Family`` row
and a rule in ``family_of``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpress_prob.names.grid import Parts, grid, press_name

DOCS = "docs/presses.md"
#: The statuses of a family, in the order ``kvprob presses`` counts them.
STATUSES = ("measured", "learned", "dropped")


@dataclass(frozen=True)
class Family:
    origin: str  # kvpress | paper | ours
    name: str
    pattern: str  # how its names are written
    paper: str
    status: str
    anchor: str  # its section of docs/presses.md

    @property
    def docs(self) -> str:
        return f"{DOCS}#{self.anchor}"

    @property
    def finding(self) -> str:
        return f"findings: {self.docs}"


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("kvpress", "top-k", "<scorer>", "StreamingLLM, SnapKV, TOVA, H2O, K-norm, KeyDiff, LagKV, "
           "ExpectedAttention (under AdaKV), KVzip", "measured", "top-k-kvpress"),
    Family("kvpress", "AdaKV", "adakv_<scorer>", "AdaKV (Feng et al. 2024)", "measured", "adakv"),
    Family("paper", "sampled", "prob_<proposal>", "Geh et al. 2026", "measured", "sampled-the-papers-presses"),
    Family("ours", "proposals and draws", "prob_<proposal>_<c|shared|w<k>|strata|coord|ht>", "ours", "measured",
           "proposals-and-draws"),
    Family("ours", "designs", "prob_<proposal>_<threshold|priority>[_s<k>][_floor][_head]",
           "threshold (pi-ps) and priority sampling (Duffield et al. 2007)", "measured", "designs"),
    Family("ours", "blocks", "prob_<proposal>_block<k>[_priority]", "cluster sampling", "measured", "blocks"),
    Family("ours", "top-k twins", "topk_<proposal>[_block<k>]", "ours", "measured", "top-k-twins"),
    Family("ours", "adaptive", "<scorer>_adaptive", "AdaKV's budget (Feng et al. 2024), memory freed", "measured",
           "adaptive"),
    Family("ours", "hybrids", "hybrid_<proposal>_block<k>_a<pct>[_threshold|_global], cross_<scorer>_block<k>_a<pct>",
           "ours; cross: after Error Certificates (arXiv 2607.21475)", "measured", "hybrids"),
    Family("ours", "summaries", "<press>_sum<V>[_seg][_tau<t>]", "ours", "measured", "summaries"),
    Family("ours", "calibrated", "prob_<scorer>_block8_priority_<rank|ent>", "ours", "measured", "calibrated"),
    Family("ours", "decoding", "<decode|prob_decode>_<proposal>_<design>",
           "kvpress DecodingPress; VaSE (arXiv 2606.03928) for value protection", "measured", "decoding"),
    Family("ours", "learned gates", "topk_gate_<widest|ragged|layers>[_recent<pct>], topk_gate_profile_<...>_ragged",
           "Fast KVzip (Kim, Han, Yun 2026, arXiv 2601.17668)", "learned", "the-fast-presss-gate"),
    Family("ours", "entropy hybrids", "<prob|hybrid>_<proposal>[_block8]_ent_alpha[_nocorr]", "ours", "dropped",
           "entropy-hybrids"),
    Family("ours", "spans", "topk_<proposal>_span<k>[_nowiden]", "ours", "dropped", "spans"),
]}

PAPER_PROPOSALS = ("streaming_llm", "snapkv", "tova", "h2o", "knorm", "min", "min_h", "h2o_h")


def family_of(parts: Parts) -> str:
    keys = {o.rstrip("0123456789.") for o in parts.options}
    if "sum" in keys:
        return "summaries"
    if parts.unit.startswith("span"):
        return "spans"
    if keys & {"rank", "ent"}:
        return "calibrated"
    if parts.kind in ("kvpress", "adakv"):
        return {"kvpress": "top-k", "adakv": "AdaKV"}[parts.kind]
    if parts.kind in ("adaptive", "hybrid", "cross"):
        return {"adaptive": "adaptive", "hybrid": "hybrids", "cross": "hybrids"}[parts.kind]
    if parts.kind == "topk":
        return "top-k twins"
    if parts.unit.startswith("block"):
        return "blocks"
    if parts.design != "poisson":
        return "designs"
    if parts.proposal in PAPER_PROPOSALS and keys <= {"nocorr"}:
        return "sampled"
    return "proposals and draws"


#: The shipped points of the grid, in the order ``kvprob presses --all`` lists them.
SHIPPED: list[Parts] = [
    *grid("kvpress", ["streaming_llm", "snapkv", "tova", "h2o", "knorm", "expected_attention", "keydiff", "lagkv",
                      "kvzip"]),
    *grid("adakv", ["snapkv", "tova", "knorm", "keydiff", "lagkv"]),
    *grid("prob", PAPER_PROPOSALS),
    *grid("prob", ["min"], options=[("c",)]),
    *grid("prob", ["min_h"], options=[("strata",), ("coord",), ("shared",), ("ht",)]),
    *grid("prob", ["snapkv"], options=[("strata",), ("ht",)]),
    *grid("prob", ["expected_attention", "min_h_s256"]),
    *grid("prob", ["min_h"], designs=["priority"]),
    *grid("prob", ["knorm"], units=["block8"]),
    *grid("prob", ["tova"], units=["block16"]),
    *grid("prob", ["tova", "keydiff", "expected_attention"], units=["block8"], designs=["priority"]),
    *grid("prob", ["keydiff"], units=["block8"], designs=["priority"], options=[("rank",)]),
    *grid("topk", ["min_h"]),
    *grid("topk", ["tova", "knorm", "keydiff"], units=["block8"]),
    *grid("topk", ["tova"], units=["block16"]),
    *grid("adaptive", ["snapkv", "tova", "knorm", "keydiff", "lagkv"]),
    *grid("hybrid", ["keydiff", "tova"], units=["block8"], options=[("a50",), ("a75",), ("a90",)]),
    *grid("hybrid", ["expected_attention"], units=["block8"], options=[("a75",)]),
    *grid("hybrid", ["keydiff"], units=["block8"], options=[("a75", "global")]),
    *grid("kvpress", ["keydiff"], options=[(f"sum{c}",) for c in (1, 4, 16)]),
    *grid("kvpress", ["tova"], options=[(f"sum{c}",) for c in (4, 16)]),
    *grid("kvpress", ["knorm"], options=[("sum4",)]),
    *grid("topk", ["keydiff"], units=["block8"], options=[("sum4",)]),
    *grid("hybrid", ["keydiff"], units=["block8"], options=[("a75", "sum4")]),
    *grid("cross", ["keydiff", "expected_attention"], units=["block8"], options=[("a25",), ("a50",), ("a75",)]),
    *grid("prob", ["uniform"], designs=["priority"], options=[("head",)]),
    *grid("topk", ["kvzip"], options=[("head",)]),
    *grid("prob", ["kvzip"], designs=["priority"], options=[("head",)]),
    *grid("hybrid", ["kvzip"], units=["block8"], options=[("a50",)]),
    *grid("cross", ["kvzip"], units=["block8"], options=[("a50",), ("a75",), ("a50", "layers")]),
    *grid("topk", ["kvzip"], options=[("layers",)]),
    *grid("cross", ["kvzip"], units=["block1"], options=[("a75", "mix50", "layers")]),
    *grid("cross", ["kvzip"], units=["block1"], options=[("a50", "toprest", "widest"), ("a75", "toprest", "widest"),
                                                          ("a75", "widest"), ("a50", "toprest", "ragged"),
                                                          ("a75", "toprest", "ragged")]),
]

#: Shipped presses outside the grammar: name -> family. A prefill press among them is built from
#: ``named.NAMED``; a decoding press by ``get_decoding_press(name, target_size, compression_interval)``.
NAMED_SHIPPED: dict[str, str] = {
    **{name: "decoding" for name in (
        "decode_streaming_llm", "decode_knorm_topk", "decode_tova_topk", "decode_keydiff_topk", "decode_attn_topk",
        "decode_h2o_topk", "decode_min_variance_topk", "prob_decode_attn_priority", "prob_decode_h2o_priority",
        "prob_decode_min_variance_priority", "prob_decode_tova_priority", "prob_decode_attn_threshold",
        "prob_decode_attn_stratified", "prob_decode_attn_block4", "prob_decode_attn_vase",
        "prob_decode_min_variance_priority_floor20", "prob_decode_min_variance_priority_floor20_layers",
        "prob_decode_min_variance_priority_floor20_heads", "decode_attn_topk_heads")},
    **{f"topk_kvzip_{a}": "top-k twins" for a in ("padded", "widest", "ragged_fit", "global")},
    **{f"topk_gate_{a}": "learned gates" for a in ("widest", "ragged", "layers", "layers_recent10", "layers_recent25",
                                                   "layers_recent50", "profile_ragged", "profile_layers_ragged",
                                                   "profile_recent10_ragged", "profile_recent25_ragged",
                                                   "profile_a25_minh256_ragged", "profile_a50_minh256_ragged",
                                                   "profile_a75_minh256_ragged")},
}

@dataclass(frozen=True)
class Entry:
    name: str
    parts: Parts | None  # None outside the grammar
    origin: str
    family: str
    status: str

    @property
    def docs(self) -> str:
        return FAMILIES[self.family].docs

    @property
    def finding(self) -> str:
        return FAMILIES[self.family].finding


def origin_of(parts: Parts) -> str:
    return FAMILIES[family_of(parts)].origin


def entries() -> dict[str, Entry]:
    """Every shipped press by name, in ``SHIPPED`` order, then ``NAMED_SHIPPED``."""
    out = {}
    for parts in SHIPPED:
        name, family = press_name(parts), FAMILIES[family_of(parts)]
        out[name] = Entry(name, parts, family.origin, family.name, family.status)
    for name, family in NAMED_SHIPPED.items():
        fam = FAMILIES[family]
        out[name] = Entry(name, None, fam.origin, family, fam.status)
    return out
