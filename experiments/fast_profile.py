"""Where the fast press loses against KVzip's global top: the allocation or the scores (SmolLM2-135M, 1024-token
development contexts, the model's default gate), r = 0.5 / 0.75 / 0.9.

Contexts, development split only:
- fitting (the per-head budget profile, and the gate): the default gate's training corpus
  (``evaluation.tasks.prose.gate.contexts``: 20 prose windows of the non-held-out development essays and 10 RULER
  haystacks, each task's examples after the first);
- measuring, disjoint from fitting: RULER, the 8 RULER development examples of the regime runs (each task's first
  ones; the pipeline's context ids); prose, the 4 held-out prose windows (of the essay the gate never saw); recall,
  6 recall windows (1024 tokens) of that essay after those prose windows (no token shared with them).

For each measuring context: KVzip's scores (``learned.labels.kvzip_labels``, cached by the ids' digest under the
model's gate folder) and the gate's (one plain prefill). Every row is a kept set of one context, sinks pinned,
compared with KVzip's global top (``per_head.global_top`` of KVzip's pinned scores, ``topk_kvzip_global``'s kept
set): kept-set recall = |kept & KVzip's| / |KVzip's|. Rows:
- (a) ``profile_kvzip``: each head keeps its profile count (``presses.budget_profile``, ``learned.profile``: the mean share of KVzip's global
  top each head holds on the fitting contexts), filled with KVzip's exact scores: the allocation's loss alone;
- (b) ``profile_gate``: the same counts filled with the gate's scores;
- (c) ``gate_global``: the gate's global top (``topk_gate_ragged``);
- (d) ``gate_layer_thresholds``: KVzap's way, one threshold per layer on the gate's score (a calibrated estimate
  of KVzip's), each the quantile of that layer's gate scores on the fitting contexts at which the layer keeps its
  profile share; each head keeps the entries above it, so the count is not exact: the kept share is reported
  (``kept_share``, matched ratio = 1 - kept_share);
- (e) ``recent25``: ``RECOMMENDED_FAST`` (``topk_gate_layers_recent25``): kvpress's count per head, sinks, the 25 %
  most recent, then the gate's top;
- ``profile_gate_recent<pct>``: (b) with the ``pct`` % most recent of each head's count kept first;
- ``profile_layers_kvzip`` / ``profile_layers_gate``: each layer keeps its profile total (the sum of its heads'
  counts), as the top of KVzip's / the gate's scores over its heads (the heads of a layer share out its budget by
  the scores, as AdaKV does within a layer).
The shipped profile (``kvpress_prob/learned/artefacts/``) is learned on the fitting contexts alone, on ``GRID``:
  PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m experiments.fast_profile learn
  PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m experiments.fast_profile measure
  PYTHONPATH=$PWD .venv/bin/python -m experiments.fast_profile table > results/archive/dev/fast-profile/table.md"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from kvpress.utils import compute_n_kept

from kvpress_prob.learned.profile import GRID, N_SINK  # the shipped profile's ratios and sinks

OUT = Path("results/archive/dev/fast-profile")
RATIOS = (0.5, 0.75, 0.9)
RECALL_WINDOWS = 6


def measuring_contexts(model, tokenizer) -> list[tuple[str, str, torch.Tensor]]:
    """(regime, name, ids (1, n)) of the measuring contexts (see the module)."""
    from kvpress.pipeline import KVPressTextGenerationPipeline

    from evaluation.tasks.prose.gate import contexts
    from evaluation.tasks.recall import CUE_TOKENS, SCORED_TOKENS, SENTENCES
    from evaluation.tasks.recall.cues import windows as recall_windows
    from experiments.zip_gap import ruler_dev

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    out = []
    for row in ruler_dev(tokenizer):
        ids = pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"],
                              max_context_length=10**9)["context_ids"]
        out.append(("ruler", row["id"], ids))
    _, held, essays = contexts(tokenizer)
    out += [("prose", f"heldout-{i}", ids) for i, ids in enumerate(held)]
    prose_end = len(held) * (1024 + 2)  # the held-out prose windows: 1024 tokens and 2 more each, from the start
    found = [w for w in recall_windows(tokenizer, 1024, "dev", SENTENCES, CUE_TOKENS, SCORED_TOKENS)
             if w.essay in essays and w.index * 1024 >= prose_end]
    out += [("recall", f"{w.essay}-{w.index}", w.ids) for w in found[:RECALL_WINDOWS]]
    return out


def fitting_contexts(tokenizer) -> list[torch.Tensor]:
    """The default gate's training contexts (1, n) ids."""
    from evaluation.tasks.prose.gate import contexts

    return contexts(tokenizer)[0]


def pinned(scores: torch.Tensor, n_sink: int = N_SINK) -> torch.Tensor:
    """(L, 1, H, n) of ``scores`` (L, H, n), the first ``n_sink`` entries above every other (as the presses pin)."""
    scores = scores.float().clone()[:, None]
    scores[..., :n_sink] = scores.amax() + 1.0
    return scores


def head_top(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(L, 1, H, n) bool: each head's top ``counts`` (L, 1, H) of ``scores`` (L, 1, H, n)."""
    rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return rank < counts[..., None]


def layer_top(scores: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """(L, 1, H, n) bool: each layer's top ``totals`` (L,) of ``scores`` (L, 1, H, n) over all its heads."""
    L, _, H, n = scores.shape
    flat = scores.reshape(L, H * n)
    rank = flat.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return (rank < totals[:, None]).view(L, 1, H, n)


def recent_first(scores: torch.Tensor, counts: torch.Tensor, window: float) -> torch.Tensor:
    """``scores`` (L, 1, H, n) re-ranked so each head's ``int(window * count)`` most recent entries come right after
    its sinks (``LayerGatePress.kept_indices``'s order, with each head's own count)."""
    n = scores.shape[-1]
    top = scores.amax() + 1.0
    position = torch.arange(n, dtype=torch.float32) / n
    recent = (window * counts.float()).floor()[..., None]  # (L, 1, H, 1)
    in_window = torch.arange(n) >= n - recent
    ranked = torch.where(in_window, top + position, scores)
    ranked[..., :N_SINK] = top + 2.0
    return ranked


def rows(kvzip: torch.Tensor, gate: torch.Tensor, profile, ratio: float, thresholds: torch.Tensor | None
         ) -> dict[str, torch.Tensor]:
    """Each row's kept set (L, 1, H, n) bool for one context (see the module); KVzip's own under ``"kvzip_global"``."""
    from kvpress_prob.presses.budget_profile import profile_counts
    from kvpress_prob.presses.per_head import global_top

    L, H, n = kvzip.shape
    zk, zg = pinned(kvzip), pinned(gate)
    counts = profile_counts(profile, ratio, n)[:, None]  # (L, 1, H)
    k = compute_n_kept(n, ratio)
    out = {"kvzip_global": global_top(zk, ratio), "profile_kvzip": head_top(zk, counts),
           "profile_gate": head_top(zg, counts), "gate_global": global_top(zg, ratio),
           "profile_layers_kvzip": layer_top(zk, counts.sum((1, 2))),
           "profile_layers_gate": layer_top(zg, counts.sum((1, 2))),
           "recent25": head_top(recent_first(zg, torch.full_like(counts, k), 0.25), torch.full_like(counts, k))}
    for pct in (10, 25):
        out[f"profile_gate_recent{pct}"] = head_top(recent_first(zg, counts, pct / 100), counts)
    if thresholds is not None:
        out["gate_layer_thresholds"] = zg >= thresholds[:, None, None, None]
    return out


def layer_thresholds(gates: list[torch.Tensor], profile, ratio: float) -> torch.Tensor:
    """(L,) per-layer thresholds on the gate's scores: on the fitting contexts' gate scores ``gates`` (each (L, H, n)),
    the quantile at which each layer keeps its profile share of snapkv's count (KVzap's thresholds, calibrated
    offline to the budget)."""
    from kvpress_prob.presses.budget_profile import profile_counts

    L = gates[0].shape[0]
    out = torch.empty(L)
    for layer in range(L):
        kept = sum(int(profile_counts(profile, ratio, g.shape[-1])[layer].sum()) for g in gates)
        values = torch.cat([pinned(g)[layer].flatten() for g in gates])
        out[layer] = values.sort(descending=True).values[min(kept, len(values)) - 1]
    return out


def score_file(digest: str, gate_name: str) -> Path:
    from kvpress_prob.models import cache_dir

    return cache_dir() / "fast-profile" / gate_name / f"{digest}.pt"


def scores(model, ids: torch.Tensor, gate_name: str, gates) -> dict:
    """KVzip's labels (L, H, n) and the gate's scores (L, H, n) of ``ids``, cached per gate and context."""
    from kvpress_prob.learned import labels as lb, training as tr
    from kvpress_prob.presses import artefacts, gate_store

    path = score_file(lb.ids_digest(ids), gate_name)
    if path.exists():
        return torch.load(path, weights_only=True)
    labels, scored_from = lb.kvzip_labels(model, ids)
    gate = tr.gate_scores(gates, lb.attention_inputs(model, ids))
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = {"kvzip": labels, "scored_from": scored_from, "gate": gate}
    torch.save(saved, path)
    return saved


def main():
    """Labels and gate scores of every fitting and measuring context (cached), the profile, then one JSON line per
    (context, ratio, row)."""
    from evaluation.bench import common
    from kvpress_prob.learned.profile import fit_profile
    from kvpress_prob.learned import labels as lb, training as tr
    from kvpress_prob.presses import artefacts, gate_store

    torch.set_num_threads(1)
    model, tokenizer = common.load(None)
    measuring = measuring_contexts(model, tokenizer)
    if sys.argv[2:] == ["labels"]:  # KVzip's labels only (no gate needed): the measuring contexts first
        for _, _, ids in measuring + [("fit", "", c) for c in fitting_contexts(tokenizer)]:
            lb.kvzip_labels(model, ids)
        return
    gate_name, gates = gate_store.load(model)
    fit = [scores(model, ids, gate_name, gates) for ids in fitting_contexts(tokenizer)]
    profile = fit_profile([f["kvzip"] for f in fit], grid=RATIOS, n_sink=N_SINK)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "recall.jsonl"
    with path.open("w") as f:
        for ratio in RATIOS:
            thresholds = layer_thresholds([g["gate"] for g in fit], profile, ratio)
            for regime, name, ids in measuring:
                s = scores(model, ids, gate_name, gates)
                kept = rows(s["kvzip"], s["gate"], profile, ratio, thresholds)
                reference = kept["kvzip_global"]
                for row, keep in kept.items():
                    counts = keep.sum(-1).flatten()
                    f.write(json.dumps({
                        "regime": regime, "context": name, "compression_ratio": ratio, "row": row,
                        "n": ids.shape[1], "recall": int((keep & reference).sum()) / int(reference.sum()),
                        "kept_share": int(keep.sum()) / reference.numel(), "count_min": int(counts.min()),
                        "count_max": int(counts.max())}) + "\n")
    (OUT / "meta.json").write_text(json.dumps({
        "gate": gate_name, "fitting_digests": [lb.ids_digest(c) for c in fitting_contexts(tokenizer)],
        "measuring": [[r, n, lb.ids_digest(i)] for r, n, i in measuring]}, indent=1) + "\n")


def learn():
    """Fit the profile of KVzip's global allocation on the fitting contexts' labels and write it to the package's
    artefacts (``learned.profile.learn_profile``), with the model key, the contexts' digests and the command."""
    from evaluation.bench import common
    from kvpress_prob.learned.profile import learn_profile

    torch.set_num_threads(1)
    model, tokenizer = common.load(None)
    print(learn_profile(model, fitting_contexts(tokenizer),
                        "PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python -m experiments.fast_profile learn",
                        package=True))


RULER = Path("results/archive/dev/fast-profile-ruler-1024")
#: RULER development records of the presses not rerun here (deterministic, no gate): the same 8 examples.
RULER_RECORDS = (Path("results/archive/dev/ragged-ruler-1024"), Path("results/archive/dev/round3-ruler-1024"))


def quality():
    """RULER development scores (8 examples) of the fast presses (``results/archive/dev/run-fast-profile.sh ruler``), with
    each one's paired difference to KVzip's global top, 95 % t-intervals over the examples."""
    import pandas as pd

    from evaluation.report.stats import paired_table
    from evaluation.report.tables import markdown_table

    frames = [pd.read_json(RULER / "results.jsonl", lines=True)]
    frames += [pd.read_json(f / "results.jsonl", lines=True) for f in RULER_RECORDS]
    df = pd.concat(frames)
    df = df[df["press"] != "full"].drop_duplicates(["example_id", "press", "compression_ratio", "seed"])
    reference = "topk_kvzip_global"
    presses = [p for p in pd.read_json(RULER / "results.jsonl", lines=True)["press"].unique() if p != "full"]
    rows = [paired_table(df, "score", "press", p, reference, by=["compression_ratio"]) for p in presses + ["snapkv"]]
    out = pd.concat(rows)[["a", "compression_ratio", "mean_a", "mean_b", "mean", "lo", "hi", "n"]]
    out.columns = ["press", "r", "RULER", f"{reference}", "difference", "lo", "hi", "examples"]
    print("\n## RULER development (8 examples, 1024 tokens): each press against KVzip's global top, paired\n")
    print("Command: `sh results/archive/dev/run-fast-profile.sh ruler`, then `... quality`.\n")
    out["r"] = out["r"].map("{:g}".format)
    print(markdown_table(out.sort_values(["press", "r"]), index=False, float_format="{:.1f}"))
    today = "topk_gate_layers_recent25"
    rows = [paired_table(df, "score", "press", p, today, by=["compression_ratio"]) for p in presses if p != today]
    out = pd.concat(rows)[["a", "compression_ratio", "mean_a", "mean_b", "mean", "lo", "hi", "n"]]
    out.columns = ["press", "r", "RULER", today, "difference", "lo", "hi", "examples"]
    out["r"] = out["r"].map("{:g}".format)
    print(f"\nThe same, against today's `RECOMMENDED_FAST` ({today}), paired:\n")
    print(markdown_table(out.sort_values(["press", "r"]), index=False, float_format="{:.1f}"))


def table():
    import pandas as pd

    from evaluation.report.tables import markdown_table

    df = pd.read_json(OUT / "recall.jsonl", lines=True)
    meta = json.loads((OUT / "meta.json").read_text())
    order = ["profile_kvzip", "profile_gate", "profile_gate_recent10", "profile_gate_recent25", "gate_global",
             "gate_layer_thresholds", "recent25", "profile_layers_kvzip", "profile_layers_gate"]
    recall = df.pivot_table(index="row", columns=["regime", "compression_ratio"], values="recall").reindex(order)
    share = df.pivot_table(index="row", columns="compression_ratio", values="kept_share").reindex(order)
    recall.columns = [f"{a} r={b}" for a, b in recall.columns]
    share.columns = [f"kept share r={c}" for c in share.columns]
    contexts = df.groupby("regime")["context"].nunique().to_dict()
    print("# Kept-set recall of KVzip's global top (development contexts, SmolLM2-135M, 1024 tokens)\n")
    print(f"Gate: `{meta['gate']}`. Fitting: the gate's {len(meta['fitting_digests'])} training contexts. "
          f"Measuring (disjoint): {contexts}.\n")
    print(f"Command: `{__doc__.splitlines()[-2].strip()}`, then `... table`.\n")
    print(markdown_table(recall.join(share).reset_index(), index=False, float_format="{:.3f}"))


if __name__ == "__main__":
    {"measure": main, "table": table, "learn": learn, "quality": quality}[sys.argv[1]]()
